"""A request's state inside the engine, and what a step reports back about it."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from omnibus.common.sampling import SamplingParams

if TYPE_CHECKING:
    from omnibus.engine.kv_transfer.handle import KvHandle

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    LOADING = "loading"  # seated with blocks, its KV arriving from another engine (kv_transfer)
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs for one generated token (of the penalized, pre-temperature distribution)."""

    token_id: int
    logprob: float  # of the sampled token
    top: tuple[tuple[int, float], ...]  # top-n (token_id, logprob), highest first


class TokenGrammar(Protocol):
    """A structured-output request's grammar state (worker/grammar.py's GrammarMatcher),
    as the scheduler sees it: it follows the request's emitted tokens."""

    def advance(self, token: int) -> bool:
        """Take one emitted token; True when the request must end with it (the grammar
        is complete, or it could not take the token)."""
        ...


@dataclass
class SamplerOutput:
    """What one Sampler call picked, row by row."""

    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # None for rows that asked for none
    # The step's prompt logprobs: per sequence with prompt rows in it, (the position of
    # its first row, the logprobs of prompt tokens position + 1, ...); None: no such rows.
    prompt_logprobs: dict[Sequence, tuple[int, list[TokenLogprobs]]] | None = None


@dataclass(eq=False)
class Sequence:
    """One request. The KV cache holds (or a launched step is writing) its first
    `num_computed_tokens` tokens; the scheduler brings that count up to `planned_len`
    (chunked prefill is just scheduling fewer tokens; after preemption it restarts from
    zero). With overlapped scheduling a step may be planned before the previous step's
    token is known: that token is pending, counted in `planned_len` but not yet in
    `token_ids`, and the model reads it from the previous step's output on the device."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    adapter: str | None = None  # LoRA adapter name; None = base model
    adapter_salt: str | None = None  # prefix-cache salt: the adapter's identity (name + file version)
    cache_salt: str = ""  # prefix-cache salt: the tenant's cache group (set by the router); "": none
    tenant: str = ""  # whose request (fair share between tenants); "" = one shared tenant
    weight: float = 1.0  # the tenant's share (its virtual token counter grows by tokens / weight)
    deadline: float | None = None  # monotonic seconds by which it should finish; None: none
    arrival_time: float = field(default_factory=time.monotonic)
    # Ties in priority are broken by this strictly increasing counter (FIFO).
    arrival_index: int = field(default_factory=lambda: next(_arrival_counter))
    # The request's noise source when params.seed is set (worker.sampling.SeededDraws;
    # typed loosely: core never imports the worker layer).
    generator: object | None = None
    # A structured-output request's grammar, advanced by every token it emits (so a
    # preemption, which recomputes tokens but emits none, leaves it as it is); None: free text.
    grammar: TokenGrammar | None = None
    # KV that moves (kv_transfer): where this request's first tokens' KV lies on another
    # engine (read instead of computed), and whether to keep its KV for another engine
    # when it ends by length (a prefill for a decode engine).
    kv_source: KvHandle | None = None
    kv_hold: bool = False

    token_ids: list[int] = field(init=False)  # prompt + outputs
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0  # advanced when a step is planned, not when it reports
    num_pending: int = 0  # tokens sampled by launched steps, not yet reported (0 or 1)
    # The most tokens ever computed for it: its tenant is charged (fair share) only past
    # this, so recomputing after a preemption costs the tenant nothing (core/waiting.py).
    num_charged_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    num_registered_blocks: int = 0  # leading blocks of block_table already in the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    first_scheduled: bool = False
    scheduled_step: int = -1  # the last step that scheduled it (scheduler bookkeeping)
    seated_step: int = -1  # the last step that seated it (started it running)
    evicted_step: int = -1  # the last step that preempted it
    queue_stamp: int = 0  # its live entry in the waiting queue (0: not queued)
    urgent_at: float | None = None  # when its deadline starts to count (core/order.py); set when queued
    lora_slot: int | None = None  # device adapter slot, pinned while running
    # The tokens that end it ("stop") and the length at which it ends ("length"): from its
    # params here; the scheduler adds the model's EOS ids and the context limit.
    stop_ids: frozenset[int] = field(init=False)
    max_len: int = field(init=False)
    # params.prompt_logprobs > 0: the logprobs of prompt tokens 1, 2, ... computed so far,
    # in order; None when it asked for none, and once they went out with its first token.
    prompt_logprobs: list[TokenLogprobs] | None = field(init=False)
    kv_handle: KvHandle | None = None  # its KV, held for another engine when it ended
    # Its early handle was its last output (kv_transfer/connector.py hold_early): what it
    # computes after is not sent, and it ends rather than waits again.
    handed_on: bool = False
    # That handle's progress words while its prefill runs, where the forward marks them
    # layer by layer (worker/kv_pool.py KvMarks); None otherwise.
    kv_progress: object | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.stop_ids = frozenset(self.params.stop_token_ids)
        self.max_len = self.num_prompt_tokens + self.params.max_tokens
        self.prompt_logprobs = [] if self.params.prompt_logprobs else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def planned_len(self) -> int:
        """Tokens once every launched step has reported."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: higher priority first, then earlier arrival."""
        return (-self.priority, self.arrival_index)


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # omnibus.common.finish_reasons.ENGINE_REASONS: stop | length | abort | deadline
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None  # why an "abort" happened, when the engine ended it itself
    # With the first token of a request that asked for them: the logprobs of its prompt
    # tokens after the first (entry i: token i + 1 given tokens 0..i).
    prompt_logprobs: list[TokenLogprobs] | None = None
    # When it ended for a transfer: where its KV is held for the engine that goes on with it.
    kv_handle: KvHandle | None = None
