"""Decode steps on static, bucketed buffers, replayed from CUDA graphs on a GPU.

A decode-only step (every sequence computes one token, no LoRA) is padded to the
next bucket size; padding rows write their KV to the null block (which the KV store
skips) and attend to one null-block position, so they cannot disturb real rows.
On CUDA each bucket's forward is captured once (largest first, one shared memory
pool) and replayed; on the CPU the same padded buffers run eagerly, which is how
the tests prove the padding leaves outputs token-exact.
"""

from __future__ import annotations

import structlog
import torch

from omnibus.engine.model.llama import ForwardBatch, LlamaForCausalLM

log = structlog.get_logger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list, max_batch: int, max_blocks: int,
                 device: torch.device, capture: bool) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.device = device
        n = max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.num_runs = 0  # decode steps served from the static buffers
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    def _batch(self, size: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            max_query_len=1, logits_indices=self.positions[:0],
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for size in reversed(self.buckets):  # largest first: later graphs fit in its pool
            batch = self._batch(size)
            for _ in range(2):  # warm up: Triton compiles, allocator settles
                self.model(batch, self.kv_caches)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(batch, self.kv_caches)
            pool = graph.pool()
            self.graphs[size] = graph
        log.info("decode_graphs_captured", buckets=self.buckets)

    def can_run(self, batch: ForwardBatch, num_seqs: int) -> bool:
        return (batch.lora is None and batch.max_query_len == 1 and num_seqs <= self.max_batch
                and batch.block_tables.shape[1] <= self.max_blocks)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states (n, hidden) of a decode-only batch of n sequences."""
        n = batch.input_ids.shape[0]
        size = next(b for b in self.buckets if b >= n)
        self.num_runs += 1
        width = batch.block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.block_tables[:size].zero_()
        self.block_tables[:n, :width].copy_(batch.block_tables)
        self.seq_lens[:n].copy_(batch.seq_lens)
        if size > n:  # padding rows: token 0 at position 0, KV to (and from) the null block
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].zero_()
            self.seq_lens[n:size].fill_(1)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self.model(self._batch(size), self.kv_caches)[:n]
