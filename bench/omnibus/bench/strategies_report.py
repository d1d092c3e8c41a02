"""The batching strategies report, written from the study's results.json alone:

    omnibus-bench strategies --report-only docs/benchmarks/strategies/results.json

renders docs/benchmarks/strategies.md and its plots without running anything. The prose
is fixed text (DOCUMENT, TRIGGERS, VERDICTS) with the measured numbers filled in; the
code below only computes those numbers and the tables.

results.json (bench/omnibus/bench/strategies.py writes it): `config` (the study's settings and derived
lengths), `rates` (the Poisson rates run), `latency_cap`, `points` (one per run: policy,
kind, cap, rate, the load generator's summary, the engine's counters and load),
`commands` (the engine and router command lines), `machine`, `started`, `elapsed_s`;
`static_timeout_ms` only in results of runs that gave static batching a start-up timeout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from omnibus.bench.workloads import ANYSCALE_CAPS

POLICIES = ("continuous", "dynamic", "static", "none")  # the order of every table
PLOTS = {
    "ratio": "ratio_by_cap.png",
    "by_cap": "throughput_by_cap.png",
    "rate": "latency_vs_rate.png",
    "tput": "latency_vs_throughput.png",
}

DOCUMENT = """\
# Batching strategies, measured

Produced by `make bench-strategies` (`omnibus-bench strategies --out {out}`) on {date}: \
{cores} CPU cores ({cpu}), torch {torch}, {minutes:.1f} minutes. One engine worker per policy, \
the same checkpoint (bench/omnibus/bench/offline.py's ~20M-parameter Llama, random weights, float32), the same \
KV pool ({blocks} blocks × {block_size} = {kv_tokens} tokens), the same cap of {batch_size} \
running sequences and the same workloads, driven through the router by `omnibus-bench serve`'s \
load generator. Everything is scaled by {scale:g} to fit a CPU: {input_len}-token prompts, \
outputs Exp(mean {mean_output:g}) capped at {caps} tokens (the 2023 benchmark's 512 / 128 / \
32–1536). Exact commands and settings are at the end; every number is in \
[{plots}/results.json]({plots}/results.json).

## The published comparison, with measured numbers

{comparison}
What is usually published, for comparison (../shared/CLAIMS.md):

| published | static | dynamic | continuous |
|---|---|---|---|
| device utilization | 60–80% | 70–85% | 90–99% |
| latency | high | medium | low |
| throughput | medium | medium-high | very high (up to 23×) |
| KV memory efficiency | low (pre-allocated) | low-medium | high (paged) |

¹ From the engine's Stats counters over the throughput run: `slots_stepped` counts, at every \
step, the batch slots the policy holds (a formed batch keeps a finished request's slot until the \
whole batch is done); a slot-step is useful when it produces a token for its sequence (its \
prefill step or a decode step), so the numerator is the output tokens received. The engine's own \
`useful_tokens ÷ slots_stepped` counts every prompt token as useful, so it is not a share \
({raw_utilization}).

² `kv_tokens_stored ÷ kv_tokens_reserved`: KV entries holding computed tokens ÷ KV slots in the \
blocks held by running sequences, both summed over steps (throughput run).

³ From the engine's load reports (WatchLoad, 50 ms) during the Poisson runs: the share of the \
run with no sequence running and at least one waiting in the engine.

## Continuous ÷ static throughput at each output cap

{burst_requests} requests sent at once; prompts {input_len} tokens; outputs Exp(mean \
{mean_output:g}) capped; output tokens/s.

| cap (scaled from) | continuous tok/s | static tok/s | continuous ÷ static |
|---|---:|---:|---:|
{ratio_rows}

![continuous ÷ static]({plots}/{plot_ratio})

![throughput by cap]({plots}/{plot_by_cap})

## Throughput vs latency over Poisson arrival rates

{rate_requests} requests per rate, Poisson arrivals; prompts uniform over [1, {input_len}] \
tokens, outputs Exp(mean {mean_output:g}) capped at {latency_cap}. Rates: {rates} req/s \
(fractions {fractions} of the continuous policy's capacity on this workload, measured first, \
unless --rates was given). Latencies in ms.

| policy | offered req/s | achieved req/s | output tok/s | TTFT p50 | TTFT p90 | TTFT p99 \
| TPOT p50 | ITL p99 | E2E p50 | E2E p99 | failed |
|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|
{rate_rows}

![latency vs arrival rate]({plots}/{plot_rate})

![latency vs throughput]({plots}/{plot_tput})

## Where the measurement disagrees with the published claims

{verdicts}

## What exactly was run

- Command: `omnibus-bench strategies --out {out}` (the make target adds nothing). It builds \
the checkpoint into `{model_dir}` on first use (with a word-level tokenizer.json for the router) \
and reuses it after.
- Engine, per policy: `{engine_command}` with `--max-batch-size {batch_size}` for static and \
dynamic and `--batch-window-ms {window_ms:g}` for dynamic, and OMP_NUM_THREADS={engine_threads} \
(one core for the engine; the router and the load generator share the other).
- Static batch size: {batch_size}, the same as every policy's cap on running sequences, so a \
static batch is exactly the batch the engine can hold. {static_note} The KV pool fits \
{batch_size} of the longest requests, so no policy is refused for memory ({preemptions}); the \
policies differ only in when requests join and leave.
- Router: `{router_command}`: it keeps up to {engine_queue} requests waiting in the engine \
beyond the running batch, so every policy decides from a queue of its own (with the router's \
default, max_num_seqs, a finished request's slot waits for the router to hear of the end and \
dispatch the next, and a formed batch cannot start until the router has refilled the queue).
- Throughput runs: `omnibus-bench serve`'s generator, {burst_requests} anyscale requests at \
once per cap (seed {seed}); latency runs: {rate_requests} requests per rate. A run is cut off \
after {run_limit_s:g} s (failures are counted in the tables).
- Load average (1, 5, 15 min) at the end: {load} (other work shared the machine; timings carry \
that noise).
"""

TRIGGERS = {  # when each policy starts a batch
    "continuous": "every step: finished leave, waiting join (up to {batch_size} running)",
    "dynamic": "{batch_size} waiting, or {window_ms:g} ms after the first",
    "static": "{batch_size} waiting (no timeout)",
    "static-timeout": "{batch_size} waiting (start-up timeout {timeout_s:.0f} s, see below)",
    "none": "engine idle: 1 request",
}

STATIC_NOTE = {
    "no-timeout": "It runs only when full (no timeout).",
    "timeout": "It is started with `--batch-window-ms {timeout_ms:.0f}` (a timeout) only because "
    "the engine's start-up warm-up is one request, which a static batch without a timeout never "
    "runs (the engine would hang at start-up); {check}.",
    "full": "every measured static batch was full (mean batch per step {mean:.2f}), so the "
    "timeout never fired in a measurement",
    "not-full": "the mean static batch per step was {mean}, so some measured batches did not fill "
    "before the timeout",
}

# One bullet per claim, each written when its numbers were measured.
VERDICTS = {
    "ratio": "- **Continuous ÷ static at the largest cap: claimed ≥ 8× (23× with paged KV on a "
    "GPU); measured {ratio:.2f}× at cap {cap}** ({holds}). Across caps: {by_cap}.",
    "ttft": "- **Continuous has lower TTFT than dynamic at every rate: {holds}** (p50 continuous "
    "/ dynamic: {pairs}).",
    "utilization": "- **Utilization (published static 60–80%, dynamic 70–85%, continuous "
    "90–99%)**: measured {measured} of held batch slots produced a token (no batching holds one "
    "slot, always busy: its waste is the batch of one). This is slot occupancy, not device "
    "utilization: this engine drops a finished sequence from the computed batch (no padding), so "
    "a held but empty slot costs no compute; it costs the throughput a waiting request could have "
    "added in it.",
    "kv": "- **KV memory efficiency (published: static low, continuous high, paged waste < 4%)**: "
    "measured {measured}. {paged_note} Static, dynamic and none reserve prompt + max_tokens at "
    "admission; here the client sets max_tokens to the exact output length (as the 2023 "
    "benchmark forced lengths), the most favourable case for reservation. A client that sends a "
    "bound instead (e.g. the cap) would see efficiency fall toward (prompt + mean output) ÷ "
    "(prompt + cap) for those policies and not for continuous.",
    "paged_note": "Continuous batching's {waste} waste is mostly the partly filled last block of "
    "each sequence ({block_size}-token blocks against sequences of {input_len} prompt + about "
    "{mean_output:g} output tokens); the published < 4% is for sequences hundreds of tokens long.",
    "dynamic_vs_none": "- **Dynamic ÷ no batching (Triton's vision example: about 3.7×)**: "
    "measured {ratio:.2f}× output throughput with everything sent at once.",
    "none_idles": "- **No batching: “the device mostly idles”**: the engine was busy "
    "{low}–{high} of each Poisson run; what it lacks is batch size, not work: one sequence per "
    "step.",
    "latency": "- **Latency (published: static high, dynamic medium, continuous low)**: {holds}; "
    "TTFT p50 in ms, lowest first: {ranks}. The mechanisms: at low rates a static batch's first "
    "request waits for the batch to fill, which shortens as the rate rises; dynamic and no "
    "batching queue behind a running batch or request, which lengthens as it rises.",
    "small_gap": "- **Why the continuous ÷ static gap is small here**: {reasons}.",
    "scale": "- **Scale**: these are a 20M-parameter model on a shared 2-core CPU at 1/8 of the "
    "benchmark's lengths, not OPT-13B on an A100; absolute tokens/s are not comparable with the "
    "published ones.",
}

GAP_REASONS = {  # the parts of VERDICTS["small_gap"]
    "prompt_share": "{share:.0f}% of the tokens the engine computed in the throughput run were "
    "prompt tokens, the same work under every policy (the benchmark's 512-token prompts against a "
    "mean of 128 output tokens)",
    "step_cost": "a step's cost grows with its batch on a CPU (mean step {t1:.0f} ms at batch 1, "
    "{tc:.0f} ms at a mean batch of {bc:.1f}, prefills included), so the steps a static batch runs "
    "while it drains to a few sequences are cheap; on a GPU a decode step costs about the same at "
    "batch 1 as at 16, and draining is pure loss",
    "no_padding": "this engine computes no padding: a finished sequence leaves the computed batch "
    "even under static batching (Hugging Face pipelines, the published baseline, pad every "
    "sequence to the longest)",
    "pool": "the KV pool fits a full batch of {batch_size} of the longest requests, so paged "
    "allocation lets continuous batching run no more sequences than static; the published 23× "
    "also came from larger batches that paged memory made room for",
}


def plots_dir(out: Path) -> Path:
    """Where the plots and results.json of the report `out` go: out's stem, beside it."""
    return out.parent / out.stem


def write_report(data: dict, out: Path) -> None:
    """The markdown report `out` and its plots, from a results.json's `data`."""
    plots_dir(out).mkdir(parents=True, exist_ok=True)
    _plots(plots_dir(out), data)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(data))


def render(data: dict) -> str:
    """The markdown report (the plots it links to are written by write_report)."""
    c = data["config"]
    policies = [p for p in POLICIES if p in c["policies"]]
    m = {p: _measured(data, p) for p in policies}
    ratios = _cap_ratios(data)
    mach = data["machine"]
    fields = (
        c
        | {
            "date": time.strftime("%Y-%m-%d", time.gmtime(data["started"])),
            "cores": mach["cores"],
            "cpu": mach["cpu"],
            "torch": mach["torch"],
            "minutes": data["elapsed_s"] / 60,
            "blocks": c["kv_blocks"] - 1,  # less the engine's null block
            "kv_tokens": (c["kv_blocks"] - 1) * c["block_size"],
            "caps": ", ".join(map(str, c["caps"])),
            "plots": Path(c["out"]).stem,
            "comparison": _comparison(data, policies, m),
            "raw_utilization": ", ".join(
                f"{p} {_f(m[p].engine('compute_utilization'), 2)}" for p in policies
            ),
            "ratio_rows": _ratio_rows(ratios),
            "latency_cap": data["latency_cap"],
            "rates": ", ".join(f"{r:g}" for r in data["rates"] or []),
            "fractions": ", ".join(map(str, c["rate_fractions"])),
            "rate_rows": _rate_rows(data, policies),
            "verdicts": "\n".join(_verdicts(data, policies, m, ratios)),
            "engine_command": data["commands"]["engine"],
            "router_command": data["commands"]["router"],
            "static_note": _static_note(data),
            "preemptions": _preemptions(data),
            "load": _load(data),
        }
        | {f"plot_{key}": name for key, name in PLOTS.items()}
    )
    return DOCUMENT.format(**fields)


# ---- the numbers --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Measured:
    """The numbers one policy contributes to the comparison table."""

    burst: dict | None  # the throughput run at the largest cap
    rates: list[dict]  # latency runs, by rate

    @property
    def burst_summary(self) -> dict:
        return self.burst["summary"] if self.burst else {}

    def slot_utilization(self) -> float | None:
        """Token-producing slot-steps ÷ slots stepped: each step that samples a token for a
        sequence (its prefill chunk or a decode) is one useful slot-step."""
        slots = (self.burst or {}).get("engine", {}).get("counters", {}).get("slots_stepped")
        return self.burst_summary["output_tokens"] / slots if slots else None

    def engine(self, key: str) -> float | None:
        return (self.burst or {}).get("engine", {}).get(key)

    def rate_point(self, rate: float | None) -> dict | None:
        return next((p for p in self.rates if p["rate"] == rate), None)


def _points(data: dict, policy: str, kind: str) -> list[dict]:
    return [p for p in data["points"] if p["policy"] == policy and p["kind"] == kind]


def _measured(data: dict, policy: str) -> _Measured:
    caps = data["config"]["caps"]
    burst = [p for p in _points(data, policy, "burst") if p["cap"] == max(caps)]
    rates = sorted(_points(data, policy, "rate"), key=lambda p: p["rate"])
    return _Measured(burst[0] if burst else None, rates)


def _cap_ratios(data: dict) -> list[tuple[int, float | None, float | None]]:
    """(cap, continuous tok/s, static tok/s) of the throughput runs, by cap."""
    out = []
    for cap in data["config"]["caps"]:
        tps = {}
        for policy in ("continuous", "static"):
            pts = [p for p in _points(data, policy, "burst") if p["cap"] == cap]
            tps[policy] = pts[0]["summary"]["output_throughput"] if pts else None
        out.append((cap, tps["continuous"], tps["static"]))
    return out


def _batch_per_step(point: dict | None) -> float | None:
    """Mean batch slots per step (engine counters), else mean running sequences while
    busy (load reports)."""
    if not point:
        return None
    e = point["engine"]
    c = e.get("counters", {})
    if c.get("slots_stepped") and c.get("num_steps"):
        return c["slots_stepped"] / c["num_steps"]
    if not e.get("busy_fraction"):
        return None
    return e["mean_running"] / e["busy_fraction"]


def _step_ms(point: dict | None) -> float | None:
    """Mean engine step time in the run: busy time (load reports) ÷ steps (counters)."""
    if not point:
        return None
    e = point["engine"]
    steps = e.get("counters", {}).get("num_steps")
    busy = e.get("busy_fraction")
    if not steps or busy is None:
        return None
    return 1e3 * point["summary"]["duration_s"] * busy / steps


def _static_mean_batch(data: dict) -> float | None:
    slots = steps = 0
    for p in data["points"]:
        if p["policy"] == "static":
            c = p["engine"].get("counters", {})
            slots, steps = slots + c.get("slots_stepped", 0), steps + c.get("num_steps", 0)
    return slots / steps if steps else None


# ---- formatting ---------------------------------------------------------------------------


def _f(value, digits: int = 0, unit: str = "") -> str:
    from omnibus.bench.report import fmt

    text = fmt(value, digits)
    return text if text == "–" else text + unit


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if not a or not b else f"{a / b:.2f}×"


def _holds(holds: bool, suffix: str = "") -> str:
    return ("holds" if holds else "does not hold") + suffix


# ---- tables -------------------------------------------------------------------------------


def _trigger(data: dict, policy: str) -> str:
    c = data["config"]
    timeout = data.get("static_timeout_ms")
    if policy == "static" and timeout is not None:
        return TRIGGERS["static-timeout"].format(**c, timeout_s=timeout / 1000)
    return TRIGGERS[policy].format(**c)


def _comparison(data: dict, policies: list[str], m: dict[str, _Measured]) -> str:
    c = data["config"]
    cap = max(c["caps"])
    rates = data["rates"] or []
    lo, hi = (rates[0], rates[-1]) if rates else (None, None)
    static_tps = m["static"].burst_summary.get("output_throughput") if "static" in m else None

    def at_rate(pm: _Measured, rate: float | None, metric: str, q: str = "p50") -> str:
        p = pm.rate_point(rate)
        return "–" if p is None else _f(p["summary"][metric][q], 0)

    def idle(pm: _Measured) -> str:
        vals = [p["engine"].get("idle_with_work_fraction") for p in pm.rates]
        vals = [v for v in vals if v is not None]
        return _pct(sum(vals) / len(vals)) if vals else "–"

    def waste(pm: _Measured) -> str:
        util = pm.slot_utilization()
        return _pct(None if util is None else 1 - util)

    rows = [
        ("a batch starts when", lambda p, pm: _trigger(data, p)),
        (
            f"output throughput, {c['burst_requests']} requests at once, cap {cap} (tok/s)",
            lambda p, pm: _f(pm.burst_summary.get("output_throughput"), 0),
        ),
        (
            "… relative to static",
            lambda p, pm: _ratio(pm.burst_summary.get("output_throughput"), static_tps),
        ),
        (
            f"TTFT p50 at {lo:g} / {hi:g} req/s (ms)" if rates else "TTFT p50 (ms)",
            lambda p, pm: f"{at_rate(pm, lo, 'ttft_ms')} / {at_rate(pm, hi, 'ttft_ms')}",
        ),
        (
            f"TTFT p99 at {hi:g} req/s (ms)" if rates else "TTFT p99 (ms)",
            lambda p, pm: at_rate(pm, hi, "ttft_ms", "p99"),
        ),
        (
            f"E2E latency p50 at {lo:g} / {hi:g} req/s (ms)" if rates else "E2E p50 (ms)",
            lambda p, pm: f"{at_rate(pm, lo, 'e2e_ms')} / {at_rate(pm, hi, 'e2e_ms')}",
        ),
        (
            "compute utilization: token-producing slot-steps ÷ batch slots stepped¹",
            lambda p, pm: _pct(pm.slot_utilization()),
        ),
        (
            "KV memory efficiency: tokens stored ÷ KV reserved, per step²",
            lambda p, pm: _pct(pm.engine("kv_efficiency")),
        ),
        (
            "padding waste: held slots that computed nothing (1 − utilization)",
            lambda p, pm: waste(pm),
        ),
        (
            "idle waste: time the engine ran nothing while requests waited (mean over rates)³",
            lambda p, pm: idle(pm),
        ),
        (
            "mean batch size per step (slots stepped ÷ steps), throughput run",
            lambda p, pm: _f(_batch_per_step(pm.burst), 1),
        ),
        (
            "mean step time, throughput run (ms; busy time ÷ steps)",
            lambda p, pm: _f(_step_ms(pm.burst), 0),
        ),
    ]
    head = "| measured | " + " | ".join(policies) + " |\n|---|" + "---:|" * len(policies) + "\n"
    return head + "".join(
        f"| {name} | " + " | ".join(fn(p, m[p]) for p in policies) + " |\n" for name, fn in rows
    )


def _ratio_rows(ratios: list) -> str:
    return "\n".join(
        f"| {cap} ({orig}) | {_f(cont, 0)} | {_f(stat, 0)} | {_ratio(cont, stat)} |"
        for (cap, cont, stat), orig in zip(ratios, ANYSCALE_CAPS)
    )


def _rate_rows(data: dict, policies: list[str]) -> str:
    rows = []
    for policy in policies:
        for p in sorted(_points(data, policy, "rate"), key=lambda p: p["rate"]):
            s = p["summary"]
            cells = [
                policy,
                f"{p['rate']:g}",
                _f(s["request_throughput"], 2),
                _f(s["output_throughput"], 0),
                *(_f(s["ttft_ms"][q]) for q in ("p50", "p90", "p99")),
                _f(s["tpot_ms"]["p50"]),
                _f(s["itl_ms"]["p99"]),
                _f(s["e2e_ms"]["p50"]),
                _f(s["e2e_ms"]["p99"]),
                str(s["failed"]),
            ]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


# ---- the verdicts -------------------------------------------------------------------------


def _verdicts(data: dict, policies: list[str], m: dict[str, _Measured], ratios: list) -> list[str]:
    """The VERDICTS bullets whose numbers were measured, in order."""
    c = data["config"]
    out = []
    cap, cont, stat = ratios[-1]
    if cont and stat:
        by_cap = ", ".join(f"{cp}: {_ratio(a, b)}" for cp, a, b in ratios)
        ratio = cont / stat
        out.append(
            VERDICTS["ratio"].format(ratio=ratio, cap=cap, holds=_holds(ratio >= 8), by_cap=by_cap)
        )
    if "continuous" in m and "dynamic" in m:
        pairs = [
            (p["rate"], p["summary"]["ttft_ms"]["p50"], q["summary"]["ttft_ms"]["p50"])
            for p, q in zip(m["continuous"].rates, m["dynamic"].rates)
        ]
        lower = all(a < b for _, a, b in pairs) and pairs
        text = ", ".join(f"{r:g}/s: {a:.0f} / {b:.0f} ms" for r, a, b in pairs)
        out.append(VERDICTS["ttft"].format(holds=_holds(bool(lower)), pairs=text))
    utils = {p: m[p].slot_utilization() for p in policies}
    if all(v is not None for v in utils.values()):
        measured = ", ".join(f"{p} {_pct(v)}" for p, v in utils.items())
        out.append(VERDICTS["utilization"].format(measured=measured))
    kv = {p: m[p].engine("kv_efficiency") for p in policies}
    if all(v is not None for v in kv.values()):
        paged = (
            ""
            if kv.get("continuous") is None
            else VERDICTS["paged_note"].format(**c, waste=_pct(1 - kv["continuous"]))
        )
        measured = ", ".join(f"{p} {_pct(v)}" for p, v in kv.items())
        out.append(VERDICTS["kv"].format(measured=measured, paged_note=paged))
    if "none" in m and "dynamic" in m:
        a = m["dynamic"].burst_summary.get("output_throughput")
        b = m["none"].burst_summary.get("output_throughput")
        if a and b:
            out.append(VERDICTS["dynamic_vs_none"].format(ratio=a / b))
    if "none" in m:
        busy = [p["engine"].get("busy_fraction") for p in m["none"].rates]
        busy = [b for b in busy if b is not None]
        if busy:
            out.append(VERDICTS["none_idles"].format(low=_pct(min(busy)), high=_pct(max(busy))))
    out.append(_latency_order(data, policies, m))
    out.append(VERDICTS["small_gap"].format(reasons="; ".join(_gap_reasons(data, m))))
    out.append(VERDICTS["scale"])
    return out


def _latency_order(data: dict, policies: list[str], m: dict[str, _Measured]) -> str:
    """The policies ranked by TTFT p50 at each rate, and whether static > dynamic > continuous."""
    ranks, as_published = [], True
    for i, rate in enumerate(data["rates"] or []):
        ttft = {
            p: m[p].rates[i]["summary"]["ttft_ms"]["p50"] for p in policies if len(m[p].rates) > i
        }
        ranks.append(
            f"{rate:g}/s: " + " < ".join(f"{p} {ttft[p]:.0f}" for p in sorted(ttft, key=ttft.get))
        )
        if {"static", "dynamic", "continuous"} <= set(ttft):
            as_published &= ttft["continuous"] < ttft["dynamic"] < ttft["static"]
    holds = _holds(as_published, " at every rate")
    return VERDICTS["latency"].format(holds=holds, ranks="; ".join(ranks))


def _gap_reasons(data: dict, m: dict[str, _Measured]) -> list[str]:
    """Why continuous gains less over static here than in the published benchmark."""
    reasons = []
    cont = m.get("continuous")
    if cont and cont.burst:
        useful = cont.burst["engine"].get("counters", {}).get("useful_tokens")
        if useful:
            share = 100 * cont.burst_summary["prompt_tokens"] / useful
            reasons.append(GAP_REASONS["prompt_share"].format(share=share))
    steps = {
        p: (_step_ms(m[p].burst), _batch_per_step(m[p].burst))
        for p in ("none", "continuous", "static")
        if p in m
    }
    if all(v[0] and v[1] for v in steps.values()) and "none" in steps and "continuous" in steps:
        (t1, _), (tc, bc) = steps["none"], steps["continuous"]
        reasons.append(GAP_REASONS["step_cost"].format(t1=t1, tc=tc, bc=bc))
    reasons.append(GAP_REASONS["no_padding"])
    reasons.append(GAP_REASONS["pool"].format(**data["config"]))
    return reasons


# ---- the setup ----------------------------------------------------------------------------


def _static_note(data: dict) -> str:
    timeout = data.get("static_timeout_ms")
    if timeout is None:
        return STATIC_NOTE["no-timeout"]
    mean = _static_mean_batch(data)
    if mean is not None and abs(mean - data["config"]["batch_size"]) < 1e-9:
        check = STATIC_NOTE["full"].format(mean=mean)
    else:
        check = STATIC_NOTE["not-full"].format(mean=_f(mean, 2))
    return STATIC_NOTE["timeout"].format(timeout_ms=timeout, check=check)


def _preemptions(data: dict) -> str:
    counts = [p["engine"].get("counters", {}).get("num_preemptions") for p in data["points"]]
    if any(n is None for n in counts):
        return "preemptions not counted by this engine build"
    return f"{sum(counts)} preemptions in all the runs"


def _load(data: dict) -> str:
    load = data["machine"].get("load_average_at_end")
    return "unknown" if not load else ", ".join(f"{x:.1f}" for x in load)


# ---- the plots ----------------------------------------------------------------------------


def _plots(d: Path, data: dict) -> None:
    from omnibus.bench import report

    policies = [p for p in POLICIES if p in data["config"]["policies"]]
    ratios = _cap_ratios(data)
    labels = [str(cap) for cap, _, _ in ratios]
    values = [cont / stat if cont and stat else 0.0 for _, cont, stat in ratios]
    report.plot_bars(
        labels,
        values,
        d / PLOTS["ratio"],
        ylabel="continuous ÷ static (output tok/s)",
        title="Continuous ÷ static throughput by output cap (scaled)",
        reference=1.0,
    )
    by_cap = {
        p: [
            (pt["cap"], pt["summary"]["output_throughput"])
            for pt in sorted(_points(data, p, "burst"), key=lambda x: x["cap"])
        ]
        for p in policies
    }
    report.plot_lines(
        by_cap,
        d / PLOTS["by_cap"],
        xlabel="output cap (tokens, log scale)",
        ylabel="output tokens/s",
        title="Throughput, all requests at once",
        logx=True,
    )
    rate_pts = {p: sorted(_points(data, p, "rate"), key=lambda x: x["rate"]) for p in policies}
    notes = {p: [f"{pt['rate']:g}/s" for pt in pts] for p, pts in rate_pts.items()}
    for key, x_of, xlabel in (
        ("rate", lambda pt: pt["rate"], "offered rate (requests/s, Poisson)"),
        ("tput", lambda pt: pt["summary"]["output_throughput"], "achieved output tokens/s"),
    ):
        panels = [
            report.Panel(
                {
                    p: [(x_of(pt), pt["summary"][metric]["p50"]) for pt in pts]
                    for p, pts in rate_pts.items()
                },
                xlabel,
                f"{label} p50 (ms, log scale)",
                f"{label} p50",
                logy=True,
                annotate=notes if key == "tput" else None,
            )
            for metric, label in (("ttft_ms", "TTFT"), ("e2e_ms", "E2E latency"))
        ]
        report.plot_panels(panels, d / PLOTS[key])
