"""A null model: the engine's host path (server, scheduler, KV allocator, sampler) with a
forward pass that costs next to nothing, so that path can be measured on a CPU.

`--load-format null` serves it: no weights are read (config.json alone sets the shapes),
the KV pool is sized and allocated as for the real model, and each step's logits have the
real shape (S, vocab) and pick a fixed token pattern, so greedy decoding is deterministic:
the token after position p is ``pattern[(p * 7919) % len(pattern)]``, where the pattern is
every id except the EOS and BOS ids. `--null-step-ms` gives it a simulated device: the
model runner makes each step's picks ready that long after the device is free to run it
(worker/model_runner.py), so the host path is measured at a GPU's step rate, with the
batches such a rate builds up, in lockstep or with overlapped scheduling.
"""

from __future__ import annotations

import torch
from torch import nn

from omnibus.engine.config import ModelConfig
from omnibus.engine.model.llama import ForwardBatch

_STRIDE = 7919  # a prime: consecutive positions pick scattered ids, so the text varies


class NullModel(nn.Module):
    """Same call interface as LlamaForCausalLM; hidden states are (T, 1): each token's
    position, from which `compute_logits` derives the next token."""

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        excluded = {*cfg.eos_token_ids, cfg.bos_token_id}
        ids = [i for i in range(cfg.vocab_size) if i not in excluded]
        self.register_buffer("pattern", torch.tensor(ids, dtype=torch.long, device=device))

    def forward(self, batch: ForwardBatch,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None) -> torch.Tensor:
        """(T, 1) float32 positions; writes no KV (nothing ever reads it)."""
        del kv_caches
        return batch.positions.to(torch.float32)[:, None]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, vocab) float32: 1 at the pattern's next token, 0 elsewhere."""
        return torch.zeros(hidden.shape[0], self.cfg.vocab_size, device=hidden.device).scatter_(
            1, self.next_tokens(hidden[:, 0].long())[:, None], 1.0)

    def next_tokens(self, positions: torch.Tensor) -> torch.Tensor:
        """The id that greedy decoding picks after the token at each position."""
        return self.pattern[(positions * _STRIDE) % self.pattern.numel()]
