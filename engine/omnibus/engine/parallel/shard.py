"""Which part of each checkpoint tensor a tensor-parallel rank holds (Megatron's split).

- Column-parallel (the output rows split): `qkv_proj` by heads (query heads split evenly;
  KV heads split, or replicated when there are fewer than ranks), `gate_up_proj` by
  intermediate channels, and their biases alike. Each rank computes its heads' attention
  and its channels' activation with no communication.
- Row-parallel (the input columns split): `o_proj` and `down_proj`; each rank's product is
  a partial sum that the layer all-reduces. A bias is added once: rank 0 keeps it, the
  other ranks hold zeros.
- Vocabulary-parallel: `embed_tokens` and `lm_head` rows by token id, ceil(vocab / N)
  per rank (the last padded with zero rows); lookups are masked and summed, logits are
  gathered.
- Norms are replicated.

A size that does not split (heads, channels, a group-quantized weight's groups) is
refused when the model is built, naming the numbers (`check_divisible`).
"""

from __future__ import annotations

import torch

from omnibus.engine.config import ModelConfig, ModelLoadError
from omnibus.engine.model.quant.weights import Weight, WeightFormatError, take_columns, take_rows
from omnibus.engine.parallel.group import TensorParallel, padded_vocab_part, vocab_range

_ROW_PARALLEL = ("o_proj", "down_proj")


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """ModelLoadError unless `cfg` splits over `size` ranks."""
    problems = []
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} attention heads (num_attention_heads)")
    kv = cfg.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"{kv} KV heads (num_key_value_heads; with fewer KV heads than ranks, "
                        "the ranks must be a multiple of them)")
    if cfg.intermediate_size % size:
        problems.append(f"{cfg.intermediate_size} MLP channels (intermediate_size)")
    if problems:
        raise ModelLoadError(f"--tensor-parallel-size {size} does not divide the model's "
                             + " or ".join(problems))


def local_kv_heads(cfg: ModelConfig, tp: TensorParallel) -> int:
    return max(cfg.num_kv_heads // tp.size, 1)


def kv_head_range(num_kv_heads: int, size: int, rank: int) -> range:
    """The model's KV heads rank `rank` of `size` holds: its share, or with fewer KV heads
    than ranks the one head its group of ranks replicates."""
    if num_kv_heads >= size:
        n = num_kv_heads // size
        return range(rank * n, (rank + 1) * n)
    first = rank // (size // num_kv_heads)
    return range(first, first + 1)


class ShardPlan:
    """The slices of one rank (`tp.rank`) of a model of `cfg`."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        check_divisible(cfg, tp.size)
        self.cfg, self.tp = cfg, tp
        d, r = cfg.head_dim, tp.rank
        heads, kv = tp.part(cfg.num_heads), kv_head_range(cfg.num_kv_heads, tp.size, r)
        first_kv, kv_heads = kv.start, len(kv)
        inter = tp.part(cfg.intermediate_size)
        # the rows of each fused part (q, k, v; gate, up) this rank keeps
        self.part_rows = {
            "qkv_proj": [slice(r * heads * d, (r + 1) * heads * d),
                         slice(first_kv * d, (first_kv + kv_heads) * d),
                         slice(first_kv * d, (first_kv + kv_heads) * d)],
            "gate_up_proj": [slice(r * inter, (r + 1) * inter)] * 2,
        }
        self.columns = {"o_proj": (r * heads * d, (r + 1) * heads * d),
                        "down_proj": (r * inter, (r + 1) * inter)}
        self.vocab = vocab_range(cfg.vocab_size, tp)
        self.vocab_part = padded_vocab_part(cfg.vocab_size, tp)

    def shard(self, target: str, idx: int | None, tensor: torch.Tensor | Weight) -> torch.Tensor | Weight:
        """This rank's part of the checkpoint tensor loaded as parameter `target` (fused
        slice `idx`), e.g. "layers.3.self_attn.qkv_proj.weight" slice 1 (k_proj)."""
        module, _, kind = target.rpartition(".")
        name = module.rpartition(".")[2]
        try:
            if name in self.part_rows:
                rows = self.part_rows[name][idx or 0]
                return _rows(tensor, rows)
            if name in _ROW_PARALLEL:
                if kind == "bias":
                    return tensor if self.tp.rank == 0 else torch.zeros_like(_dense(tensor))
                start, stop = self.columns[name]
                return tensor[:, start:stop] if isinstance(tensor, torch.Tensor) else take_columns(tensor, start, stop)
            if name in ("embed_tokens", "lm_head"):
                return self._vocab_rows(_dense(tensor))
        except WeightFormatError as exc:
            raise ModelLoadError(f"{target} cannot be split over {self.tp.size} ranks: {exc}") from exc
        return tensor  # norms: replicated

    def _vocab_rows(self, table: torch.Tensor) -> torch.Tensor:
        start, stop = self.vocab
        part = table[start:stop]
        if part.shape[0] == self.vocab_part:
            return part
        padded = table.new_zeros((self.vocab_part, *table.shape[1:]))
        padded[:part.shape[0]] = part
        return padded


def _dense(tensor: torch.Tensor | Weight) -> torch.Tensor:
    return tensor if isinstance(tensor, torch.Tensor) else tensor.dequantize()


def _rows(tensor: torch.Tensor | Weight, rows: slice) -> torch.Tensor | Weight:
    if isinstance(tensor, torch.Tensor):
        return tensor[rows]
    return take_rows(tensor, torch.arange(rows.start, rows.stop))
