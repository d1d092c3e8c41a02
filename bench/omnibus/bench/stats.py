"""Serving metrics from per-request timings (definitions as in ../shared/CLAIMS.md).

All times are seconds on the client's monotonic clock, relative to the run's start.
A request's clock starts when the client sends it (for Poisson runs that is its
scheduled arrival, unless the client fell behind):

- TTFT: first token-bearing message received - sent.
- TPOT: (last token's message - first token's message) / (output tokens - 1); only
  requests with at least two output tokens have one.
- ITL: every gap between consecutive token-bearing messages (a message carrying k > 1
  tokens is one gap, as the client saw it).
- E2E: last message (the one with the finish reason) - sent.
- Throughput: completed requests, and output tokens of completed requests, per second
  of the run's duration (first send to last completion).
- Goodput: completed requests per second that met every stated SLO.

Percentiles interpolate linearly between order statistics (numpy's default): with
sorted values v and rank r = q/100 * (n - 1), p_q = v[floor r] + frac(r) * (v[ceil r] - v[floor r]).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """What the client saw of one request."""

    index: int
    prompt_tokens: int
    max_tokens: int
    adapter: str = ""
    priority: int = 0
    scheduled: float = 0.0  # planned send time
    sent: float = 0.0  # actual send time
    token_times: list[float] = field(default_factory=list)  # each token-bearing message
    token_counts: list[int] = field(default_factory=list)  # tokens in each of those messages
    end: float | None = None  # last message or error
    code: str = "OK"  # gRPC status name; "OK" when the stream ended normally
    error: str = ""
    finish_reason: str = ""
    cached_tokens: int = 0  # prompt tokens the engine served from its prefix cache (usage)
    deadline_s: float | None = None  # the deadline it was sent with
    queue_s: float | None = None  # seconds in the router's queue (the final message's timing)

    @property
    def ok(self) -> bool:
        """Completed: an ABORTED finish (a drain that ran out) ended the stream early."""
        return self.code == "OK" and self.finish_reason != "ABORTED"

    @property
    def failure(self) -> str:
        """Why it did not complete: its status code, or ABORTED."""
        return self.code if self.code != "OK" else self.finish_reason

    @property
    def output_tokens(self) -> int:
        return sum(self.token_counts)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.sent

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        if n < 2 or len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass(frozen=True)
class Slo:
    """Service-level objectives a request must meet to count toward goodput (None: no bound)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def met(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        checks = ((self.ttft_s, r.ttft), (self.tpot_s, r.tpot), (self.e2e_s, r.e2e))
        # A request with no TPOT (one output token) has nothing to violate a TPOT bound.
        return all(bound is None or value is None or value <= bound for bound, value in checks)

    def describe(self) -> str:
        parts = [
            f"{name} <= {v * 1e3:g} ms"
            for name, v in (("TTFT", self.ttft_s), ("TPOT", self.tpot_s), ("E2E", self.e2e_s))
            if v is not None
        ]
        return ", ".join(parts) or "none"


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) by linear interpolation; NaN when empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    v = sorted(values)
    rank = q / 100 * (len(v) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return v[lo] + (rank - lo) * (v[hi] - v[lo])


def distribution(values: list[float], scale: float = 1e3) -> dict[str, float]:
    """mean and percentiles of `values`, multiplied by `scale` (default: s -> ms)."""
    out = {"mean": sum(values) / len(values) * scale if values else math.nan}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q) * scale
    return out


def summarize(
    results: list[RequestResult], duration: float | None = None, slo: Slo = Slo()
) -> dict:
    """The run's metrics. `duration` defaults to first send -> last end."""
    if duration is None:
        ends = [r.end for r in results if r.end is not None]
        duration = (max(ends) - min(r.sent for r in results)) if ends else 0.0
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    good = [r for r in done if slo.met(r)]
    return {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "failures_by_code": dict(sorted(Counter(r.failure for r in results if not r.ok).items())),
        "duration_s": duration,
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": out_tokens,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(out_tokens + sum(r.prompt_tokens for r in done)),
        "ttft_ms": distribution([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": distribution([g for r in done for g in r.itls]),
        "e2e_ms": distribution([r.e2e for r in done if r.e2e is not None]),
        "slo": slo.describe(),
        "good_requests": len(good),
        "goodput": per_s(len(good)),
    }


def stored_token_seconds(results: list[RequestResult]) -> float:
    """∫ (KV tokens the client knows are stored) dt: a request holds prompt + k tokens
    from the message that brought its k-th token until the next message (or its end).
    A lower bound: the time between admission and the first token is not seen."""
    total = 0.0
    for r in results:
        if not r.token_times or r.end is None:
            continue
        held = r.prompt_tokens
        times = r.token_times + [r.end]
        for count, t0, t1 in zip(r.token_counts, times, times[1:]):
            held += count
            total += held * (t1 - t0)
    return total
