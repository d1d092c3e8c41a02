"""Workloads for the serving benchmark: what each request asks for, and when it is sent.

A workload is a list of `BenchRequest`s (prompt token ids, an exact output length, an
adapter and a priority) plus an arrival schedule. Prompts are random token ids drawn
from the served vocabulary, so prompt lengths are exact; output lengths are exact too,
because every request sets `max_tokens` to its drawn length with `ignore_eos`.

Presets (every distribution is seeded; the same arguments give the same requests):

anyscale
    The 2023 continuous-batching benchmark (see ../shared/CLAIMS.md): every prompt has
    `input_len` tokens (default 512; with `input_len_min` set, uniform over
    [input_len_min, input_len] instead, as its latency runs used), output lengths are
    round(Exp(mean)) clamped to [1, cap] (defaults: mean 128, cap 512; the benchmark
    used caps 32, 128, 512 and 1536). Greedy (temperature 0), ignore_eos.
sharegpt-like
    Conversation-shaped lengths without the data set: prompt and output lengths are
    log-normal, round(exp(N(ln median, sigma))) clamped to [min, cap]. Defaults chosen
    so the means (about 160 prompt and 340 output tokens before clamping) match those
    reported for ShareGPT: prompts median 98, sigma 1.0, in [4, 1024]; outputs median
    205, sigma 1.0, in [4, 1024]. Greedy, ignore_eos.

`scale` multiplies every length parameter (lengths, means, medians, caps; rounded, at
least 1), so a CPU can run the same shape of workload smaller.

Mixes: `adapters` gives the x-adapter-id of each request, round-robin over the names,
or weighted at random when weights are given ("a:3,b:1"); "" or "base" is the base
model. `priorities` is a weighted mix of priority values ("0:3,10:1").
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

ANYSCALE_CAPS = (32, 128, 512, 1536)  # the output caps of the 2023 benchmark
BASE_MODEL_NAMES = ("", "base")  # adapter names meaning "no adapter"


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload."""

    prompt_ids: tuple[int, ...]
    max_tokens: int  # exact output length (ignore_eos)
    adapter: str = ""  # x-adapter-id; "" is the base model
    priority: int = 0
    deadline_s: float | None = None  # the request's gRPC deadline; None: RunConfig.timeout_s


@dataclass(frozen=True)
class AnyscaleSpec:
    """Fixed (or uniform) prompt length, Exp(mean) output lengths capped at `cap`."""

    input_len: int = 512
    mean_output: float = 128.0
    cap: int = 512
    input_len_min: int | None = None  # set: prompt lengths uniform over [input_len_min, input_len]

    def __post_init__(self) -> None:
        _positive("input_len", self.input_len)
        _positive("cap", self.cap)
        if not self.mean_output > 0:
            raise ValueError(f"mean_output must be > 0, got {self.mean_output!r}")
        if self.input_len_min is not None and not 1 <= self.input_len_min <= self.input_len:
            raise ValueError(
                f"input_len_min must be in [1, input_len={self.input_len}], got "
                f"{self.input_len_min}"
            )

    def scaled(self, scale: float) -> AnyscaleSpec:
        return AnyscaleSpec(
            input_len=_scale(self.input_len, scale),
            mean_output=max(1.0, self.mean_output * scale),
            cap=_scale(self.cap, scale),
            input_len_min=None if self.input_len_min is None else _scale(self.input_len_min, scale),
        )

    def lengths(self, n: int, rng: random.Random) -> list[tuple[int, int]]:
        out = []
        for _ in range(n):
            lo = self.input_len if self.input_len_min is None else self.input_len_min
            prompt = rng.randint(lo, self.input_len)
            output = min(self.cap, max(1, round(rng.expovariate(1.0 / self.mean_output))))
            out.append((prompt, output))
        return out


@dataclass(frozen=True)
class LogNormal:
    """round(exp(N(ln median, sigma))) clamped to [low, cap]."""

    median: float
    sigma: float
    low: int
    cap: int

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.sigma >= 0 and 1 <= self.low <= self.cap):
            raise ValueError(f"bad log-normal {self}: need median > 0, sigma >= 0, 1 <= low <= cap")

    def draw(self, rng: random.Random) -> int:
        return min(
            self.cap, max(self.low, round(rng.lognormvariate(math.log(self.median), self.sigma)))
        )

    def scaled(self, scale: float) -> LogNormal:
        return LogNormal(
            max(1.0, self.median * scale),
            self.sigma,
            _scale(self.low, scale),
            _scale(self.cap, scale),
        )


@dataclass(frozen=True)
class ShareGptSpec:
    """Log-normal prompt and output lengths (ShareGPT-like means, no data set)."""

    prompt: LogNormal = field(default_factory=lambda: LogNormal(98.0, 1.0, 4, 1024))
    output: LogNormal = field(default_factory=lambda: LogNormal(205.0, 1.0, 4, 1024))

    def scaled(self, scale: float) -> ShareGptSpec:
        return ShareGptSpec(self.prompt.scaled(scale), self.output.scaled(scale))

    def lengths(self, n: int, rng: random.Random) -> list[tuple[int, int]]:
        return [(self.prompt.draw(rng), self.output.draw(rng)) for _ in range(n)]


Spec = AnyscaleSpec | ShareGptSpec


def parse_mix(text: str, kind: type = str) -> list[tuple[object, float]]:
    """ "a,b:3,c" -> [(a, 1), (b, 3), (c, 1)]; values parsed with `kind`."""
    mix = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        name, sep, weight = item.rpartition(":")
        if not sep:
            name, weight = item, "1"
        try:
            value, w = kind(name), float(weight)
        except ValueError as exc:
            raise ValueError(f"bad mix entry {item!r}: {exc}") from exc
        if not w > 0:
            raise ValueError(f"bad mix entry {item!r}: the weight must be > 0")
        mix.append((value, w))
    return mix


def _pick(mix: list[tuple[object, float]], i: int, rng: random.Random, default: object) -> object:
    if not mix:
        return default
    if all(w == mix[0][1] for _, w in mix):  # equal weights: round-robin, exact shares
        return mix[i % len(mix)][0]
    return rng.choices([v for v, _ in mix], weights=[w for _, w in mix])[0]


def build_requests(
    spec: Spec,
    n: int,
    vocab_size: int,
    *,
    seed: int = 0,
    adapters: str = "",
    priorities: str = "",
    min_token_id: int = 3,
) -> list[BenchRequest]:
    """`n` requests of `spec` with prompts of random ids in [min_token_id, vocab_size)
    (the low ids are usually special tokens)."""
    _positive("n", n)
    if not 0 <= min_token_id < vocab_size:
        raise ValueError(
            f"min_token_id must be in [0, vocab_size={vocab_size}), got {min_token_id}"
        )
    rng = random.Random(seed)
    lengths = spec.lengths(n, rng)
    adapter_mix = [("" if a in BASE_MODEL_NAMES else a, w) for a, w in parse_mix(adapters)]
    priority_mix = parse_mix(priorities, int)
    mix_rng = random.Random(seed + 1)  # mixes never shift the lengths or prompts drawn
    out = []
    for i, (prompt_len, output_len) in enumerate(lengths):
        prompt = tuple(rng.randrange(min_token_id, vocab_size) for _ in range(prompt_len))
        out.append(
            BenchRequest(
                prompt,
                output_len,
                str(_pick(adapter_mix, i, mix_rng, "")),
                int(_pick(priority_mix, i, mix_rng, 0)),
            )
        )
    return out


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of `n` Poisson arrivals at `rate` per second;
    the first is at 0. rate = inf: all at 0."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate!r}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 2)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _scale(value: int, scale: float) -> int:
    return max(1, round(value * scale))


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
