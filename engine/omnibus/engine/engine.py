"""The in-process engine API: add requests, step, abort.

    engine = Engine(EngineConfig(model="models/demo"))
    engine.add_request("r1", prompt_token_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.new_token_ids, out.finish_reason)

A step is three lines: schedule, run, update. Tests, benchmarks and the gRPC
server all drive this object (the server through `AsyncEngine`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import structlog

from omnibus.engine.core.block_allocator import BlockAllocator, BlockCounts
from omnibus.engine.config import EngineConfig, ModelConfig
from omnibus.engine.request import EngineRequest, as_request
from omnibus.engine.lora import (
    AdapterError, AdapterInventory, LoraConfig, LoraManager, LoraStats, UnknownAdapterError)
from omnibus.engine.worker.model_runner import ModelRunner, Step, resolve_dtype
from omnibus.engine.core.policies import ContinuousPolicy, make_policy
from omnibus.common.prefix import check_cache_salt
from omnibus.common.sampling import SamplingParams, check_context, check_token_ids, kv_tokens
from omnibus.engine.worker.sampling import make_generator
from omnibus.engine.core.scheduler import Scheduler, SchedulerConfig
from omnibus.engine.core.study import StudyCounters
from omnibus.engine.kv_transfer.connector import KvTransferStats, make_connector
from omnibus.engine.core.sequence import RequestOutput, Sequence, SequenceStatus
from omnibus.engine.spec import SpecStats, Speculator
from omnibus.engine.spec.proposer import NgramProposer

_NO_STUDY = StudyCounters()  # what stats() reports without --study-counters (all zero)
PREFIX_KEYS_INTERVAL_S = 0.05  # the cached-block keys of load reports are this fresh at most

__all__ = ["AdapterError", "Engine", "EngineStats", "RequestOutput", "UnknownAdapterError"]

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_free_blocks: int  # free + evictable cached blocks
    num_total_blocks: int  # usable blocks, excluding the null block
    num_cached_blocks: int  # unreferenced blocks that still hold reusable prefix KV
    num_steps: int
    num_preemptions: int
    num_prefix_cache_hit_blocks: int
    num_host_cache_hit_blocks: int = 0  # prefix blocks loaded back from the host tier (--kv-offload-bytes)
    num_host_cache_blocks: int = 0  # blocks the host tier holds
    num_running_adapters: int = 0
    resident_adapters: tuple[str, ...] = ()  # adapters in device slots
    cached_adapters: tuple[str, ...] = ()  # adapters in host memory (resident ones included), sorted
    adapter_salts: tuple[tuple[str, str], ...] = ()  # (adapter, its prefix-cache salt), sorted
    adapter_pins: tuple[tuple[str, int], ...] = ()  # (adapter, running sequences pinning its slot), sorted
    waiting_adapters: tuple[str, ...] = ()  # adapters waiting requests need that are in no device slot, sorted
    adapter_loads: tuple[tuple[str, int], ...] = ()  # (adapter, reads from disk into host memory) since start
    # (adapter, tier "device" or "host", times evicted from it for another adapter) since start
    adapter_evictions: tuple[tuple[str, str, int], ...] = ()
    adapter_load_seconds: tuple[float, ...] = ()  # duration of each successful disk read
    # batching-study counters, cumulative over steps (core/study.py; 0 without --study-counters)
    slots_stepped: int = 0
    useful_tokens: int = 0
    kv_tokens_stored: int = 0
    kv_tokens_reserved: int = 0
    prefix_generation: int = 0  # changes with prefix_block_keys
    prefix_block_keys: tuple[int, ...] = ()  # their keys (common/prefix.py), newest first, bounded
    speculative: SpecStats | None = None  # the proposer's counters (engine/omnibus/engine/spec); None: no speculation
    kv_transfer: KvTransferStats | None = None  # KV moved between engines (--kv-transfer); None: off


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = ModelConfig.from_dir(config.model)
        max_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        if config.max_model_len and config.max_model_len > max_len:  # past the positions it was trained on
            log.warning("max_model_len_capped", requested=config.max_model_len, serving=max_len,
                        why="the model's context (max_position_embeddings, or its sliding window)")
        # model_config.max_model_len is the engine's context limit from here on.
        self.model_config = dataclasses.replace(mc, max_position_embeddings=max_len)
        self.adapters = None
        if config.adapter_dir is not None:
            self.adapters = LoraManager(
                LoraConfig(Path(config.adapter_dir), config.max_loras, config.max_cpu_loras, config.max_lora_rank),
                self.model_config, resolve_dtype(config, self.model_config), config.torch_device)
            for name in config.preload_adapters:
                self.adapters.prefetch(name)
        self.runner = ModelRunner(config, self.model_config, self.adapters)
        self.allocator = BlockAllocator(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                        host_blocks=self.runner.num_host_blocks)
        self.speculator = self._speculator(config)
        self.kv = None if config.kv_transfer == "none" else make_connector(config, self.runner.kv_caches,
                                                                                self.runner.ranks,
                                                                                self.model_config.num_kv_heads)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_len, config.waiting_order),
            self.allocator,
            make_policy(config.batching, config.max_batch_size, config.batch_window_ms),
            self.model_config.eos_token_ids,
            self.adapters,
            self.speculator,
            self.kv,
        )
        self._restart_study()
        self.num_steps = 0
        self._keys: tuple[int, ...] = ()  # the latest _prefix_keys
        self._keys_generation, self._keys_time = 0, 0.0
        self._generate_ids = itertools.count()
        overlap = config.overlap_scheduling
        self.overlap = self.runner.device.type == "cuda" if overlap is None else overlap
        self._in_flight: Step | None = None  # launched, picks not yet reported (overlap only)
        self._migrating = False  # migrate(): the next step ends every request for another engine

    # ---- requests ------------------------------------------------------------

    def add_request(self, request: EngineRequest | str, *fields: Any, **named: Any) -> None:
        """Queue `request`, or the EngineRequest of its loose fields (`add_request("r1",
        prompt_token_ids, params, adapter="a")`). Raises ValueError (bad input, AdapterError
        included) or UnknownAdapterError. The adapter's weights load in the background."""
        request = as_request(request, *fields, **named)
        self._validate(request)
        params = request.params
        grammar = None
        if params.structured_output is not None:  # compiled (or found in the cache) now
            offset, prompt = params.output_offset, request.prompt_token_ids
            grammar = self.runner.grammar(params.structured_output, prompt[len(prompt) - offset:] if offset else ())
        salt = None
        if request.adapter:
            if self.adapters is None:
                raise UnknownAdapterError(f"adapter {request.adapter!r} not found: this engine serves no adapters")
            salt = self.adapters.prefetch(request.adapter)
        seq = Sequence(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            params=params,
            priority=request.priority,
            adapter=request.adapter or None,
            adapter_salt=salt,
            cache_salt=request.cache_salt,
            tenant=request.tenant,
            weight=float(request.weight),
            deadline=request.deadline,
            generator=None if params.seed is None else make_generator(
                params.seed, self.runner.device, params.output_offset),
            grammar=grammar,
            kv_source=request.kv_source if self.kv is not None and params.prompt_logprobs == 0 else None,
            kv_hold=request.kv_hold and self.kv is not None,
        )
        if seq.kv_source is not None:
            self.kv.readable(seq)  # checked once: a handle this engine cannot read is dropped
        self.scheduler.add(seq)

    def _validate(self, request: EngineRequest) -> None:
        prompt, params, priority, weight = request.prompt_token_ids, request.params, request.priority, request.weight
        if not isinstance(request.request_id, str) or not request.request_id:
            raise ValueError("request_id must be a non-empty string")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        self._check_tokens(prompt, "the prompt")
        if params.logit_bias:
            self._check_tokens([token for token, _ in params.logit_bias], "logit_bias")
        check_context(len(prompt), params.max_tokens, self.model_config.max_model_len)
        if params.output_offset >= len(prompt):
            raise ValueError(
                f"output_offset ({params.output_offset}) must leave at least one prompt token "
                f"of the {len(prompt)} sent"
            )
        most = kv_tokens(self.allocator.num_usable_blocks, self.config.block_size)
        if len(prompt) + params.max_tokens > most:
            blocks = -(-(len(prompt) + params.max_tokens - 1) // self.config.block_size)
            # when max_tokens 1 does not fit either, only a shorter prompt helps
            advice = "lower max_tokens" if len(prompt) + 1 <= most else "shorten the prompt"
            raise ValueError(
                f"this request needs up to {blocks} KV blocks but the engine's pool has "
                f"{self.allocator.num_usable_blocks}; {advice} or give the engine more KV memory"
            )
        if not (isinstance(weight, (int, float)) and 0 < weight < float("inf")):
            raise ValueError(f"tenant weight must be > 0, got {weight!r}")
        check_cache_salt(request.cache_salt)

    def _check_tokens(self, ids: list[int] | tuple[int, ...], what: str) -> None:
        check_token_ids(ids, self.model_config.vocab_size, what)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is (waiting, mid-prefill, decoding); its blocks are
        free on return and the next step() reports it with finish_reason "abort"."""
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None or self._migrating

    def migrate(self) -> None:
        """A drain: the next step ends every request for another engine to go on with,
        after reporting the step in flight; running requests' computed KV is held for the
        engines that read it (their outputs carry the handles; needs --kv-transfer)."""
        self._migrating = True

    def holds_kv(self) -> bool:
        """KV is held for other engines: steps must go on to give it back when a lease ends."""
        return self.kv is not None and bool(self.kv.held)

    # ---- the step ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Plan a step, launch it and report what the device has finished. Without
        overlap that is this step; with it, the step launched by the previous call, whose
        picks were copying back while this one was planned and launched."""
        prev, self._in_flight = self._in_flight, None
        results: list[RequestOutput] = []
        # Penalties must see the pending tokens, and guesses follow the last token: both
        # need the step in flight reported first (speculation runs at small batches only).
        if prev is not None and (prev.reads_history or self._speculating() or self._migrating):
            results += self._report(prev)
            prev = None
        if self._migrating:
            log.info("engine_migrating", held=self.scheduler.migrate())
            self._migrating = False
        plan = self.scheduler.schedule()
        step = None
        if not plan.is_empty:
            plan.kv_copies = self.allocator.take_copies()  # queued since the last launch, if any
            step = self.runner.launch(plan, prev)
            self.num_steps += 1
        if self.kv is not None and self.kv.queued:
            # Reads from other engines start once the host tier's queued copies are made: a
            # block the tier saves may be one a read writes (the launch made them, else now).
            if plan.is_empty:
                self.runner.make_copies(self.allocator.take_copies())
            self.kv.launch_reads()
        if prev is not None:
            results += self._report(prev)
        if step is not None:
            if self.overlap and not (self.speculator is not None and any(item.guess for item in plan.scheduled)):
                self._in_flight = step
            else:
                results += self._report(step)
        return self.scheduler.take_aborted() + results

    def _report(self, step: Step) -> list[RequestOutput]:
        result = step.result()
        if self.kv is not None:  # early holds the forward did not mark: their chunks are computed now
            self.kv.advance(step.plan.scheduled)
        if self.speculator is None:
            return self.scheduler.update(step.plan, result)
        # A speculating request's seeded draws move on by the tokens it kept (its rows drew
        # at fixed positions: worker/model_runner.py's _verify).
        spec = [(item.seq, item.seq.num_tokens) for item in step.plan.scheduled
                if item.guess and item.seq.generator is not None]
        results = self.scheduler.update(step.plan, result)
        for seq, before in spec:
            seq.generator.position += seq.num_tokens - before
        return results

    def _speculator(self, config: EngineConfig) -> Speculator | None:
        spec = config.spec_config()
        if spec.method is None:
            return None
        if spec.method == "draft":
            from omnibus.engine.spec.draft import DraftProposer

            return Speculator(spec, DraftProposer(config, self.model_config, self.runner.num_blocks))
        return Speculator(spec, NgramProposer(spec.ngram_max, spec.ngram_min))

    def _speculating(self) -> bool:
        return self.speculator is not None and self.speculator.active(len(self.scheduler.running))

    def warmup(self) -> None:
        """One short request through the whole path (prefill, decode, sampling) before
        serving, whatever the batching policy: a static policy would otherwise wait for a
        full batch. The batching-study counters start from zero afterwards."""
        policy = self.scheduler.policy
        self.scheduler.policy = ContinuousPolicy()
        try:
            token = self.model_config.bos_token_id or 0
            # 4 prompt tokens and 2 outputs (a decode step), or what the context and the KV
            # pool allow (KV for every token but the last): at least 1 + 1.
            fit = min(self.model_config.max_model_len,
                      kv_tokens(self.allocator.num_usable_blocks, self.config.block_size))
            outputs = 2 if fit >= 3 else 1
            self.generate([[token] * min(4, fit - outputs)],
                          SamplingParams(max_tokens=outputs, temperature=0.0, ignore_eos=True))
        finally:
            self.scheduler.policy = policy
            self._restart_study()

    def _restart_study(self) -> None:
        """Fresh batching-study counters, when the engine collects them (--study-counters)."""
        self.study = StudyCounters() if self.config.study_counters else None
        self.scheduler.observer = self.study

    def close(self) -> None:
        """Release what outlives the object: the tensor-parallel ranks' processes, the KV
        transfer engine."""
        if self.kv is not None:
            self.kv.close()
        self.runner.close()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 priorities: list[int] | None = None) -> list[list[int]]:
        """Run prompts to completion (offline use); returns each prompt's output tokens."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{next(self._generate_ids)}" for _ in prompts]
        for i, (rid, prompt) in enumerate(zip(ids, prompts)):
            self.add_request(EngineRequest(rid, prompt, params_list[i], priorities[i] if priorities else 0))
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        self.scheduler.policy.close_arrivals()  # nothing else is coming: no batch waits for more
        try:
            while self.has_unfinished():
                for out in self.step():
                    results[out.request_id] += out.new_token_ids
        finally:
            self.scheduler.policy.close_arrivals(False)
        return [results[rid] for rid in ids]

    def embed(self, inputs: list[list[int]], pooling: str = "mean", normalize: bool = False) -> list[list[float]]:
        """Embeddings of token sequences from the base model's final hidden states.
        Runs outside the KV pool: cache-free forwards between generation steps, each of
        at most --max-num-batched-tokens tokens (the step size the device memory was sized
        for) or one input, when that is longer."""
        if pooling not in ("mean", "last"):
            raise ValueError(f"pooling must be 'mean' or 'last', got {pooling!r}")
        if not inputs:
            raise ValueError("no inputs to embed")
        for i, ids in enumerate(inputs):
            self._check_tokens(ids, f"input {i}")
            if len(ids) > self.model_config.max_model_len:
                raise ValueError(f"input {i} has {len(ids)} tokens, over the context limit of "
                                 f"{self.model_config.max_model_len}")
        vectors: list[list[float]] = []
        budget, start = self.config.max_num_batched_tokens, 0
        while start < len(inputs):
            end, tokens = start + 1, len(inputs[start])
            while end < len(inputs) and tokens + len(inputs[end]) <= budget:
                tokens += len(inputs[end])
                end += 1
            vectors += self.runner.embed(inputs[start:end], pooling, normalize).tolist()
            start = end
        return vectors

    # ---- introspection -------------------------------------------------------

    def check_integrity(self) -> BlockCounts:
        """Prove the KV pool's bookkeeping against every running sequence's block table."""
        if self.speculator is not None:
            self.speculator.proposer.check_integrity()  # a draft model's own KV pool
        return self.allocator.check_integrity(self.scheduler.block_tables())

    def stats(self) -> EngineStats:
        counts = self.allocator.counts()
        inventory = self.adapters.inventory() if self.adapters else AdapterInventory((), ())
        lora = self.adapters.stats() if self.adapters else LoraStats()
        c = self.study or _NO_STUDY
        return EngineStats(
            num_waiting=self.scheduler.num_waiting,
            num_running=len(self.scheduler.running),
            num_free_blocks=self.allocator.num_free_blocks,
            num_total_blocks=self.allocator.num_usable_blocks,
            num_cached_blocks=counts.cached,
            num_steps=self.num_steps,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefix_cache_hit_blocks=self.allocator.num_cache_hits,
            num_host_cache_hit_blocks=self.allocator.num_host_hits,
            num_host_cache_blocks=len(self.allocator.host),
            num_running_adapters=inventory.running,
            resident_adapters=inventory.resident,
            cached_adapters=inventory.cached,
            adapter_salts=inventory.salts,
            adapter_pins=inventory.pins,
            waiting_adapters=self._waiting_adapters(inventory.resident),
            adapter_loads=lora.adapter_loads,
            adapter_evictions=lora.adapter_evictions,
            adapter_load_seconds=lora.load_seconds,
            slots_stepped=c.slots_stepped,
            useful_tokens=c.useful_tokens,
            kv_tokens_stored=c.kv_tokens_stored,
            kv_tokens_reserved=c.kv_tokens_reserved,
            prefix_block_keys=self._prefix_keys(),
            prefix_generation=self._keys_generation,
            speculative=None if self.speculator is None else self.speculator.stats.snapshot(),
            kv_transfer=None if self.kv is None else self.kv.stats(),
        )

    def _waiting_adapters(self, resident: tuple[str, ...]) -> tuple[str, ...]:
        """The adapters that waiting requests wait for: in no device slot yet (O(requests),
        and only while requests wait)."""
        if self.adapters is None or not self.scheduler.num_waiting:
            return ()
        wanted = {s.adapter for s in self.scheduler.requests.values()
                  if s.adapter is not None and s.status is SequenceStatus.WAITING}
        return tuple(sorted(wanted.difference(resident)))

    def _prefix_keys(self) -> tuple[int, ...]:
        """The cached blocks' keys, recomputed only when the cache changed and at most
        every PREFIX_KEYS_INTERVAL_S (O(report_prefix_blocks))."""
        generation, now = self.allocator.cache_generation, time.monotonic()
        if generation != self._keys_generation and now - self._keys_time >= PREFIX_KEYS_INTERVAL_S:
            self._keys = tuple(self.allocator.cached_keys(self.config.report_prefix_blocks))
            self._keys_generation, self._keys_time = generation, now
        return self._keys
