"""The draft-model proposer: a smaller checkpoint with the target's tokenizer, run by the
same engine on a paged KV cache of its own, guesses each sequence's next tokens greedily.

Each speculating sequence has a shadow `Sequence` in the draft's own block allocator: its
tokens mirror the real sequence's, its KV holds what the draft has computed of them. A
proposal first catches the draft up on the tokens it has not seen (the prompt after the
target's prefill, or the target's last pick and the guesses it kept), rolling back what
the target rejected, then runs k - 1 one-token steps; every step is one batched forward
of all speculating sequences through the worker's ModelRunner. The draft runs without
LoRA adapters: the target verifies with them.
"""

from __future__ import annotations

import dataclasses

import structlog

from omnibus.common.sampling import SamplingParams
from omnibus.engine.config import EngineConfig, ModelConfig
from omnibus.engine.core.block_allocator import BlockAllocator
from omnibus.engine.core.scheduler import ScheduledSeq, SchedulerOutput
from omnibus.engine.core.sequence import Sequence, SequenceStatus
from omnibus.engine.worker.model_runner import ModelRunner

log = structlog.get_logger(__name__)

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


class DraftProposer:
    name = "draft"

    def __init__(self, target: EngineConfig, target_model: ModelConfig, num_blocks: int) -> None:
        draft_dir = target.speculative_draft_model
        mc = ModelConfig.from_dir(draft_dir)
        if mc.vocab_size != target_model.vocab_size:
            raise ValueError(f"--speculative-draft-model {draft_dir}: its vocabulary has {mc.vocab_size} tokens, "
                             f"the served model's {target_model.vocab_size}; a draft model shares the tokenizer")
        # as long a context as the target's (its own permitting)
        self.model_config = dataclasses.replace(
            mc, max_position_embeddings=min(mc.max_position_embeddings, target_model.max_position_embeddings))
        config = dataclasses.replace(
            target, model=str(draft_dir), num_kv_blocks=num_blocks, adapter_dir=None, preload_adapters=(),
            decode_graphs=False, overlap_scheduling=False, speculative=None, speculative_draft_model=None,
            tensor_parallel_size=1,  # a draft is small: whole, on rank 0
            load_format="safetensors" if target.load_format == "null" else target.load_format)
        self.runner = ModelRunner(config, self.model_config)
        self.budget = target.max_num_batched_tokens  # tokens per draft forward at most
        self.allocator = BlockAllocator(self.runner.num_blocks, config.block_size, enable_prefix_caching=False)
        self._shadows: dict[str, tuple[Sequence, Sequence]] = {}  # request id -> (its sequence, shadow)
        log.info("draft_model_loaded", model=str(draft_dir), kv_blocks=self.runner.num_blocks)

    def propose(self, seqs: list[Sequence], k: list[int]) -> list[list[int]]:
        guesses: list[list[int]] = [[] for _ in seqs]
        shadows = [(i, self._shadow(seq), n) for i, (seq, n) in enumerate(zip(seqs, k)) if n > 0]
        for r in range(max((n for _, _, n in shadows), default=0)):
            plan = SchedulerOutput()
            rows = []
            budget = self.budget
            for i, shadow, n in shadows:
                if r >= n or (r and len(guesses[i]) < r) or budget == 0:
                    continue  # done, out of blocks or behind (catching up) earlier, or no budget
                start = shadow.num_computed_tokens
                count = min(shadow.num_tokens - start, budget)  # a long catch-up goes in chunks
                if not self.allocator.allocate_slots(shadow, start + count):
                    continue  # the draft's pool is full: fewer guesses for this one
                plan.scheduled.append(ScheduledSeq(shadow, start, count, start + count == shadow.num_tokens))
                rows.append(i)
                budget -= count
            if not plan.scheduled:
                break
            picks = iter(self.runner.launch(plan).result().token_ids)
            for item, i in zip(plan.scheduled, rows):
                item.seq.num_computed_tokens += item.num_tokens
                if item.samples:  # caught up: its next guess
                    token = next(picks)
                    item.seq.token_ids.append(token)
                    guesses[i].append(token)
        return guesses

    def _shadow(self, seq: Sequence) -> Sequence:
        """`seq`'s shadow, its KV kept for the tokens it shares with `seq` now."""
        entry = self._shadows.get(seq.request_id)
        if entry is None or entry[0] is not seq:
            if entry is not None:
                self.allocator.free(entry[1])
            shadow = Sequence(seq.request_id, seq.prompt_token_ids, _GREEDY)
            shadow.status = SequenceStatus.RUNNING
            self._shadows[seq.request_id] = (seq, shadow)
        else:
            shadow = entry[1]
        kept = 0
        limit = min(shadow.num_computed_tokens, seq.num_tokens - 1)  # the last token is always input
        old, new = shadow.token_ids, seq.token_ids
        while kept < limit and old[kept] == new[kept]:
            kept += 1
        shadow.num_computed_tokens = kept
        self.allocator.trim(shadow, kept)
        shadow.token_ids = list(new)
        return shadow

    def release(self, seq: Sequence) -> None:
        """`seq` left the running set: its draft KV is freed."""
        entry = self._shadows.get(seq.request_id)
        if entry is not None and entry[0] is seq:
            self.allocator.free(entry[1])
            del self._shadows[seq.request_id]

    def check_integrity(self) -> None:
        """The draft's KV pool: every block free or held by one live shadow."""
        self.allocator.check_integrity([shadow.block_table for _, shadow in self._shadows.values()])
