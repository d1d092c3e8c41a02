"""Turns a scheduler plan into one forward pass and a sampled token per finished chunk.

Owns the model weights, the paged KV pool (one K and one V tensor per layer) and the
sampler. It never decides anything: the plan says which tokens to compute.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F
from omnibus.common.sampling import SamplingParams, StructuredOutput
from omnibus.engine.config import DTYPE_NAMES, EngineConfig, ModelConfig
from omnibus.engine.core.scheduler import SchedulerOutput
from omnibus.engine.core.sequence import Sequence
from omnibus.engine.lora import LoraManager
from omnibus.engine.lora.slots import DeviceSlots
from omnibus.engine.model.cpu_linear import pack_linears
from omnibus.engine.model.llama import Attention, ForwardBatch
from omnibus.engine.model.loader import load_model, random_model
from omnibus.engine.model.null import NullModel
from omnibus.engine.parallel.group import SINGLE, TensorParallel
from omnibus.engine.parallel.ranks import Ranks, ShardedModel, host_batch
from omnibus.engine.parallel.shard import ShardPlan, check_divisible, local_kv_heads
from omnibus.engine.worker.cuda_graph import DecodeGraphs
from omnibus.engine.worker.grammar import GrammarMatcher, Grammars
from omnibus.engine.worker.kv_pool import copy_kv, host_caches, kv_caches, kv_marks
from omnibus.engine.worker.memory import MemoryUse, kv_cache_budget, lora_stack_bytes
from omnibus.engine.worker.sampling import (
    PromptRows, SampledBatch, Sampler, SamplerOutput, prompt_logprobs)
from omnibus.engine.worker.transfer import to_device

log = structlog.get_logger(__name__)

CPU_DEFAULT_KV_BYTES = 512 << 20
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # the dtypes EngineConfig names


def bind_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (Triton launches, graph capture
    and events use it; else cuda:0). No-op for the CPU and a bare "cuda" (the current one)."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


_KV_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
              "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def resolve_kv_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: --kv-cache-dtype, auto the model's."""
    return model_dtype if config.kv_cache_dtype == "auto" else _KV_DTYPES[config.kv_cache_dtype]


def resolve_dtype(config: EngineConfig, model_config: ModelConfig) -> torch.dtype:
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    dtype = DTYPES.get(model_config.torch_dtype, torch.float32)
    # Half precision matmuls on CPU are slow and lossy; "auto" means float32 there.
    return torch.float32 if config.device == "cpu" else dtype


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 adapters: LoraManager | None = None) -> None:
        self.config = config
        self.model_config = model_config
        self.device = config.torch_device
        self.dtype = resolve_dtype(config, model_config)
        self.kv_dtype = resolve_kv_dtype(config, self.dtype)
        self.block_size = config.block_size
        bind_device(self.device)
        self.adapters = adapters  # None when the engine serves no adapters
        self.sampler = Sampler(seed=config.seed)  # before sizing: the warm-up samples
        self.grammars: Grammars | None = None  # structured output: made by the first such request
        self.ranks: Ranks | None = None  # tensor parallelism: the other ranks (parallel/ranks.py)
        tp = SINGLE
        if config.tensor_parallel_size > 1:
            check_divisible(model_config, config.tensor_parallel_size)  # before any rank starts
            self.ranks = Ranks.start(config, model_config)
            tp = self.ranks.tp
            if adapters is not None:
                adapters.shard_over(ShardPlan(model_config, tp), self.ranks.send)
        self.tp = tp
        try:
            model, packed = build_model(config, model_config, self.dtype, self.device, tp)
            self.model = model if self.ranks is None else ShardedModel(model, self.ranks)
            self.num_blocks = self._num_kv_blocks()
            if self.ranks is not None:
                self.model.allocate_pool(self.num_blocks)
            self.kv_caches = self._kv_caches(self.num_blocks)
        except BaseException:
            if self.ranks is not None:  # no rank outlives a runner that failed to start
                self.ranks.kill()
            raise
        if self.ranks is not None:
            self.model.pool = self.kv_caches
        # the prefix cache's host tier (--kv-offload-bytes): as many blocks as the bytes hold
        self.num_host_blocks = config.kv_offload_bytes // self.kv_bytes_per_block
        self.host_caches = host_caches(self.kv_caches, self.num_host_blocks)
        if self.ranks is not None and self.num_host_blocks:
            self.ranks.send(("host_pool", self.num_host_blocks))
        self.graphs = None
        if self.graphs_wanted:
            shape = (min(config.max_num_seqs, 512), -(-model_config.max_model_len // self.block_size),
                     self.device.type == "cuda")
            if self.ranks is not None:  # every rank captures its shard's graphs, in step
                self.ranks.send(("graphs", *shape))
            self.graphs = DecodeGraphs(model, self.kv_caches, shape[0], shape[1], self.device, capture=shape[2])
        self.idle_meter = GpuIdleMeter() if self.device.type == "cuda" else None
        # The null model's simulated device (--null-step-ms): a step's picks are ready this
        # long after the device is free to run it; steps run on it one after another.
        self.null_step_s = config.null_step_ms / 1000
        self._device_free_at = 0.0
        log.info("model_loaded", model=config.model, dtype=str(self.dtype), kv_dtype=str(self.kv_dtype),
                 device=str(self.device), kv_blocks=self.num_blocks, block_size=self.block_size,
                 onednn_linears=packed)

    def _kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return kv_caches(self.model_config, self.tp, num_blocks, self.block_size, self.kv_dtype, self.device)

    @property
    def kv_bytes_per_block(self) -> int:
        """One block's bytes on this rank (its KV heads)."""
        mc = self.model_config
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * mc.num_layers * self.block_size * local_kv_heads(mc, self.tp) * mc.head_dim * elem

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            budget = CPU_DEFAULT_KV_BYTES
        blocks = budget // self.kv_bytes_per_block
        if blocks < 2:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds {blocks} blocks of {self.kv_bytes_per_block} bytes; "
                "at least 2 are needed (raise --kv-cache-memory or --gpu-memory-utilization)"
            )
        return int(blocks)

    @property
    def graphs_wanted(self) -> bool:
        cfg = self.config
        if cfg.load_format == "null":
            return False  # nothing to capture: the null forward launches no kernels worth it
        return cfg.decode_graphs if cfg.decode_graphs is not None else self.device.type == "cuda"

    def _cuda_kv_budget(self) -> int:
        """What is left of gpu_memory_utilization × device memory after the weights, the
        largest step's activations and sampling (a warm-up), the decode graphs' pool (a
        decode warm-up at the largest bucket) and adapter stacks not yet allocated."""
        step_peak = self._peak_bytes(lambda: self._warmup_forward(self.config.max_num_batched_tokens, num_blocks=1))
        graph_pool = self._peak_bytes(self._warmup_decode) if self.graphs_wanted else 0
        torch.cuda.empty_cache()  # cached but unused (loader transients, warm-ups) is not in use
        free, total = torch.cuda.mem_get_info(self.device)
        cfg = self.config
        pending_lora = 0
        if cfg.adapter_dir is not None and self.adapters is None:
            pending_lora = lora_stack_bytes(self.model_config, cfg.max_loras, cfg.max_lora_rank, self.dtype)
        use = MemoryUse(total, total - free, step_peak, graph_pool, pending_lora)
        budget = kv_cache_budget(use, cfg.gpu_memory_utilization)
        log.info("kv_cache_budget", budget=budget, **dataclasses.asdict(use))
        return budget

    def _peak_bytes(self, run) -> int:
        """Bytes `run()` allocates at its peak above what stays allocated after it."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        scratch = run()
        del scratch
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)

    def _warmup_decode(self) -> torch.Tensor:
        """A decode forward at the largest graph bucket with block tables as wide as
        max_model_len (what a captured graph holds), all reading the null block."""
        mc = self.model_config
        n, width, dev = min(self.config.max_num_seqs, 512), -(-mc.max_model_len // self.block_size), self.device
        caches = self._kv_caches(1)
        batch = ForwardBatch(
            input_ids=torch.zeros(n, dtype=torch.long, device=dev), positions=torch.zeros(n, dtype=torch.long, device=dev),
            slot_mapping=torch.zeros(n, dtype=torch.long, device=dev),
            block_tables=torch.zeros(n, width, dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.ones(n, dtype=torch.int32, device=dev), max_query_len=1,
            logits_indices=torch.zeros(0, dtype=torch.long, device=dev))
        return self.model(batch, caches)

    def _warmup_forward(self, num_tokens: int, num_blocks: int | None = None):
        """One forward over `num_tokens` tokens whose KV goes to the null block."""
        mc = self.model_config
        caches = self.kv_caches if num_blocks is None else self._kv_caches(num_blocks)
        n = min(num_tokens, mc.max_model_len)
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.zeros(n, dtype=torch.long, device=dev),
            positions=torch.arange(n, device=dev),
            slot_mapping=torch.zeros(n, dtype=torch.long, device=dev),
            block_tables=torch.zeros((1, -(-n // self.block_size)), dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev), max_query_len=n,
            # as many logits rows as a step can sample, so the sampler's peak is counted too
            logits_indices=torch.arange(min(n, self.config.max_num_seqs), device=dev),
        )
        hidden = self.model(batch, caches)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        rows = logits.shape[0]
        # Every sampling path at once (top-k, top-p, min-p, penalties, logprobs): its peak.
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                                frequency_penalty=0.5, logprobs=5)
        return self.sampler.sample(logits, [params] * rows, [[1]] * rows, [[2]] * rows, [None] * rows)

    def grammar(self, fmt: StructuredOutput, emitted: list[int] | tuple[int, ...] = ()) -> GrammarMatcher:
        """A matcher for a structured-output request (past `emitted`, a continuation's
        output so far); the format compiles now unless compile_format cached it. ValueError
        when the format does not compile."""
        return self._grammars().matcher(fmt, emitted)

    def compile_format(self, fmt: StructuredOutput) -> None:
        """Compiles `fmt` into the grammar cache, so that grammar() finds it there: what
        the step loop runs on its grammar thread (the compiler releases the GIL). The first
        call reads the tokenizer's vocabulary. ValueError when the format does not compile."""
        self._grammars().compile(fmt)

    def _grammars(self) -> Grammars:
        if self.grammars is None:
            mc = self.model_config
            self.grammars = Grammars(self.config.model, mc.vocab_size, mc.eos_token_ids,
                                     self.config.structured_max_whitespace)
        return self.grammars

    @staticmethod
    def _sampled_rows(plan: SchedulerOutput) -> tuple[list[Sequence], list[tuple[int, GrammarMatcher]]]:
        """The sequences that sample this step, and (logits row, matcher) of those with a
        grammar (never speculated: one row each; a speculated one has 1 + guesses rows)."""
        rows: list[Sequence] = []
        masked: list[tuple[int, GrammarMatcher]] = []
        row = 0
        for item in plan.scheduled:
            if item.samples:
                rows.append(item.seq)
                if item.seq.grammar is not None:
                    masked.append((row, item.seq.grammar))
                row += 1 + len(item.guess)
        return rows, masked

    # ---- one step ------------------------------------------------------------

    def prepare(self, plan: SchedulerOutput, prev: Step | None = None) -> ForwardBatch:
        """The step's inputs on the device. A sequence whose last input token is still
        pending (sampled by `prev`, not yet reported) reads it from prev's device tensor."""
        bs = self.block_size
        scheduled = plan.scheduled
        width = max(len(item.seq.block_table) for item in scheduled)
        pad = [0] * width  # block tables are padded to the widest with the null block
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[int] = []  # (rows, width), flat
        logits_indices: list[int] = []
        pending_dst: list[int] = []  # rows of input_ids filled from prev's picks
        pending_src: list[int] = []
        # rows whose logits score prompt tokens (prompt logprobs): the row, the token it
        # scores, and per sequence (seq, its first row's position, rows, top-n)
        score_rows: list[int] = []
        score_targets: list[int] = []
        score_spans: list[tuple[Sequence, int, int, int]] = []
        total = 0  # input tokens so far
        longest = 1  # the longest chunk
        for item in scheduled:
            seq, start, n = item.seq, item.start, item.num_tokens
            end = start + n
            table, tokens = seq.block_table, seq.token_ids
            if item.guess:  # a decode and its speculated tokens, each scored
                input_ids.append(tokens[start])
                input_ids += item.guess
                positions += range(start, end)
                slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
                longest = max(longest, n)
                logits_indices += range(total, total + n - 1)  # the last one's below
            elif n == 1:  # a decode (or a one-token chunk)
                if start < len(tokens):
                    input_ids.append(tokens[start])
                else:  # its input is prev's pick for this sequence
                    input_ids.append(0)
                    pending_dst.append(total)
                    pending_src.append(prev.rows[seq])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                known = tokens[start:end]
                input_ids += known
                if len(known) < n:  # the last input is prev's pick for this sequence
                    input_ids.append(0)
                    pending_dst.append(total + n - 1)
                    pending_src.append(prev.rows[seq])
                positions += range(start, end)
                slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
                longest = max(longest, n)
            total += n
            query_start.append(total)
            seq_lens.append(end)
            tables += table
            tables += pad[len(table):]
            if item.samples:
                logits_indices.append(total - 1)
            if item.prompt_rows is not None:
                rows, zero = item.prompt_rows, total - end  # zero: the step's row of position 0
                score_rows += range(zero + rows.start, zero + rows.stop)
                score_targets += tokens[rows.start + 1:rows.stop + 1]
                score_spans.append((seq, rows.start, len(rows), seq.params.prompt_logprobs))
        lora = None if self.adapters is None else self.adapters.batch_for(scheduled)
        dev = self.device
        ids = to_device(input_ids, torch.long, dev)
        if pending_dst:
            picks = prev.sampled.tokens.index_select(0, to_device(pending_src, torch.long, dev))
            ids.index_copy_(0, to_device(pending_dst, torch.long, dev), picks)
        return ForwardBatch(
            input_ids=ids,
            positions=to_device(positions, torch.long, dev),
            slot_mapping=to_device(slots, torch.long, dev),
            block_tables=to_device(tables, torch.int32, dev).view(len(scheduled), width),
            query_start_loc=to_device(query_start, torch.int32, dev),
            seq_lens=to_device(seq_lens, torch.int32, dev),
            max_query_len=longest,
            logits_indices=to_device(logits_indices, torch.long, dev),
            lora=lora,
            prompt_logprobs=None if not score_spans else PromptRows(
                to_device(score_rows, torch.long, dev), to_device(score_targets, torch.long, dev),
                score_spans),
            kv_marks=kv_marks(scheduled) if self.config.kv_transfer_overlap else None,
        )

    @torch.inference_mode()
    def embed(self, inputs: list[list[int]], pooling: str, normalize: bool) -> torch.Tensor:
        """(N, hidden) float32 embeddings: final hidden states (after the last norm), pooled."""
        lens = [len(x) for x in inputs]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor([t for x in inputs for t in x], dtype=torch.long, device=dev),
            positions=torch.tensor([p for n in lens for p in range(n)], dtype=torch.long, device=dev),
            slot_mapping=torch.empty(0, dtype=torch.long, device=dev),
            block_tables=torch.empty(0, 0, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            max_query_len=max(lens),
            logits_indices=torch.empty(0, dtype=torch.long, device=dev),
        )
        hidden = self.model(batch, None).float()  # (T, hidden)
        if pooling == "last":
            pooled = hidden[torch.tensor(starts[1:], device=dev) - 1]
        else:
            pooled = torch.stack([hidden[a:b].mean(0) for a, b in zip(starts, starts[1:])])
        return F.normalize(pooled, dim=-1) if normalize else pooled

    def launch(self, plan: SchedulerOutput, prev: Step | None = None) -> Step:
        """Queue the plan's forward pass and sampling on the device and start copying the
        picks back; returns without waiting for the device. `prev` is the step launched
        before, when its picks have not been reported yet (overlapped scheduling)."""
        return self.run(plan, self.prepare(plan, prev))

    def make_copies(self, copies) -> None:
        """The host tier's queued saves and loads (core/block_allocator.py KvCopy), in order,
        on every rank."""
        if copies:
            if self.ranks is not None:
                self.ranks.send(("kv_copies", copies))
            copy_kv(self.kv_caches, self.host_caches, copies)

    @torch.inference_mode()
    def run(self, plan: SchedulerOutput, batch: ForwardBatch) -> Step:
        """`launch` with the inputs already prepared."""
        if self.idle_meter is not None:
            self.idle_meter.step_started()
        self.make_copies(plan.kv_copies)  # the host tier's saves and loads, before this step's forward
        if self.graphs is not None and self.graphs.can_run(batch, len(plan.scheduled)):
            if self.ranks is not None:
                self.ranks.send(("graph", host_batch(batch)))
            hidden = self.graphs.run(batch)  # (n, hidden): decode-only, one token per sequence
        else:
            hidden = self.model(batch, self.kv_caches)  # (T, hidden)
        if batch.kv_marks is not None:
            batch.kv_marks.layer_done(None)  # (a model that marks no layer, a graph)
        rows, masked = self._sampled_rows(plan)
        penalties = False
        # host work while the forward runs
        masks = self.grammars.fill(len(batch.logits_indices), masked) if masked else None
        if rows:
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # (S, vocab)
            if masks is not None:
                masks.apply(logits)
            if len(rows) < len(batch.logits_indices):  # speculated rows
                sampled = self._verify(plan, logits)
            else:
                params = [s.params for s in rows]
                penalties = any(p.has_penalties for p in params)
                if penalties:  # token histories for the rows they read
                    prompts = [s.prompt_token_ids if s.params.has_penalties else () for s in rows]
                    outputs = [s.output_token_ids if s.params.has_penalties else () for s in rows]
                else:
                    prompts = outputs = [()] * len(rows)
                sampled = self.sampler.sample(logits, params, prompts, outputs, [s.generator for s in rows])
        else:
            sampled = SampledBatch(torch.empty(0, dtype=torch.long, device=self.device))
        if batch.prompt_logprobs is not None:
            # at most max_num_seqs rows of logits at once: what the warm-up's sampling held
            sampled.prompt = prompt_logprobs(self.model.compute_logits, hidden, batch.prompt_logprobs,
                                             self.config.max_num_seqs)
        if self.idle_meter is not None:
            self.idle_meter.step_ended()
        # Penalties read the tokens so far, and a grammar's next mask needs this step's pick:
        # either way the next step waits for this one's report.
        step = Step(plan, sampled, rows, penalties or masks is not None)
        if self.null_step_s:
            step.ready_at = self._device_free_at = (
                max(time.monotonic(), self._device_free_at) + self.null_step_s)
        return step

    def _verify(self, plan: SchedulerOutput, logits: torch.Tensor) -> SampledBatch:
        """Samples every row of a step with speculated tokens: a speculating sequence's
        row j is the target's pick after its input and its first j guesses, drawn as the
        non-speculative step at that position would (its penalties over the output plus
        those guesses; a seeded request's noise of that output position). The scheduler
        keeps the guesses these picks confirm (engine/omnibus/engine/spec)."""
        params: list[SamplingParams] = []
        prompts: list = []
        outputs: list = []
        generators: list = []
        for item in plan.scheduled:
            if not item.samples:
                continue
            seq = item.seq
            history = seq.params.has_penalties
            gen = seq.generator
            for j in range(len(item.guess) + 1):
                params.append(seq.params)
                prompts.append(seq.prompt_token_ids if history else ())
                outputs.append(seq.output_token_ids + item.guess[:j] if history else ())
                generators.append(None if gen is None else gen.at(gen.position + j))
        return self.sampler.sample(logits, params, prompts, outputs, generators)

    def execute(self, plan: SchedulerOutput) -> SamplerOutput:
        """Run one step to completion: launch it and wait for its picks."""
        return self.launch(plan).result()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any."""
        if self.ranks is not None:
            self.ranks.close()


def build_model(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                tp: TensorParallel = SINGLE) -> tuple[torch.nn.Module, int]:
    """The model (this rank's shard of it) as configured, and how many linear layers were
    packed for oneDNN."""
    if config.load_format == "null":
        model: torch.nn.Module = NullModel(model_config, device)
    elif config.load_format == "dummy":
        model = random_model(model_config, dtype, device, model_config.max_model_len, config.seed or 0,
                             config.quantization, tp=tp)
    else:
        model = load_model(model_config, config.model, dtype, device, model_config.max_model_len,
                           config.quantization, tp=tp)
    if resolve_kv_dtype(config, dtype) != torch.float8_e4m3fn:  # a checkpoint's KV scales serve an FP8 cache only
        for module in model.modules():
            if isinstance(module, Attention):
                module.k_scale = module.v_scale = 1.0
    packed = 0
    if device.type == "cpu" and config.cpu_matmul == "onednn":
        packed = pack_linears(model)
    return model, packed


class ShardRuntime:
    """What a tensor-parallel rank other than 0 holds (parallel/ranks.py serves rank 0's
    calls with it): its shard of the model and its heads' KV pool."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, tp: TensorParallel,
                 device: torch.device) -> None:
        bind_device(device)
        self.config, self.model_config, self.tp, self.device = config, model_config, tp, device
        self.dtype = resolve_dtype(config, model_config)
        self.kv_dtype = resolve_kv_dtype(config, self.dtype)
        self.model, _ = build_model(config, model_config, self.dtype, device, tp)
        self.pool: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.slots: DeviceSlots | None = None  # adapter slots, mirroring rank 0's
        if config.adapter_dir is not None:
            self.slots = DeviceSlots(config.max_loras, config.max_lora_rank, model_config, self.dtype, device)
            self.slots.shard_over(ShardPlan(model_config, tp))

    def allocate_pool(self, num_blocks: int) -> None:
        self.pool = self._caches(num_blocks)

    def allocate_host_pool(self, num_blocks: int) -> None:
        self.host = host_caches(self.pool, num_blocks)

    def build_graphs(self, max_batch: int, max_blocks: int, capture: bool) -> None:
        """The decode graphs over this rank's shard and pool, as rank 0 builds its own."""
        self.graphs = DecodeGraphs(self.model, self.pool, max_batch, max_blocks, self.device, capture=capture)

    def caches(self, which: object) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The caches a forward of rank 0 named: "pool", None, or n scratch blocks."""
        if which is None:
            return None
        if which == "pool":
            return self.pool
        return self._caches(int(which))  # type: ignore[call-overload]

    def _caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return kv_caches(self.model_config, self.tp, num_blocks, self.config.block_size, self.kv_dtype, self.device)


@dataclass
class Step:
    """A launched step: its plan and its picks, on the device and copying to the host."""

    plan: SchedulerOutput
    sampled: SampledBatch  # on the device; the next step's prepare() may read it
    samplers: list[Sequence]  # the sequences that sample, row by row
    # A sequence of this step samples with penalties, which read its tokens, or with a
    # grammar, whose next mask follows its pick: its next step must wait for this one's report.
    reads_history: bool = False
    host: SampledBatch | None = None
    ready_at: float = 0.0  # the null model's simulated device: monotonic time its picks are ready

    def __post_init__(self) -> None:
        self.host = self.sampled.to_host()  # the copy starts now and completes on its own

    @functools.cached_property
    def rows(self) -> dict[Sequence, int]:
        """Sampled row of each sequence that samples (only overlapped steps ask)."""
        return dict(zip(self.samplers, range(len(self.samplers))))

    def result(self) -> SamplerOutput:
        """The picks on the host (waits for the step to finish on the device)."""
        wait = self.ready_at - time.monotonic() if self.ready_at else 0.0
        if wait > 0:
            time.sleep(wait)
        return self.host.output()


class GpuIdleMeter:
    """Share of wall time the GPU spends waiting on Python between steps, from CUDA
    events at each step's first and last launch. Events are read once they have
    completed (`query`, never a sync), so overlapped steps are measured as they run."""

    def __init__(self) -> None:
        self.busy_ms = 0.0
        self.idle_ms = 0.0
        self._prev_end: torch.cuda.Event | None = None
        self._pending: collections.deque[tuple] = collections.deque()

    def reset(self) -> None:
        """Start counting afresh from the next step (the gap before it is not counted)."""
        self._drain()
        self.busy_ms = self.idle_ms = 0.0
        self._prev_end = None

    def step_started(self) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def step_ended(self) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((self._prev_end, self._start, end))
        self._prev_end = end
        self._drain()

    def _drain(self) -> None:
        while self._pending and self._pending[0][2].query():
            prev_end, start, stop = self._pending.popleft()
            if prev_end is not None:
                self.idle_ms += prev_end.elapsed_time(start)
            self.busy_ms += start.elapsed_time(stop)

    @property
    def idle_share(self) -> float:
        """Over the steps that have completed on the GPU so far."""
        self._drain()
        total = self.busy_ms + self.idle_ms
        return self.idle_ms / total if total else 0.0
