"""The batching strategies study: one engine, one model, four policies, measured.

    omnibus-bench strategies --out docs/benchmarks/strategies.md

For each policy (continuous, dynamic, static, none) in turn it starts one engine worker
(`omnibus-engine serve --batching POLICY`) and one router on loopback, serving the
~20M-parameter checkpoint of bench/omnibus/bench/offline.py (built on first use, reused after) with
the same KV pool, sequence cap and token budget, and drives them with the load
generator (bench/omnibus/bench/serve.py) through the public API:

1. Throughput: the anyscale workload (scaled by --scale), all requests at once, at each
   of the benchmark's output caps (32, 128, 512, 1536, scaled) for continuous and
   static; at the largest cap only for dynamic and none.
2. Latency: Poisson arrivals at several rates (by default fractions of the continuous
   policy's measured capacity), prompts uniform over [1, input length], outputs
   Exp(mean) capped at the 512 cap (scaled), as the benchmark's latency runs were.

During every run it watches the engine (Stats and WatchLoad RPCs): the engine's
counters (slots stepped, useful tokens, KV tokens stored and reserved) and its load.
It writes a JSON file with every number, and from it the markdown report and PNG plots
(bench/omnibus/bench/strategies_report.py; `--report-only RESULTS_JSON` re-renders them alone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from omnibus.bench import processes, report
from omnibus.bench.strategies_report import POLICIES, plots_dir, write_report

ROOT = Path(__file__).resolve().parents[3]  # bench/omnibus/bench/strategies.py
START_TIMEOUT_S = 240.0  # a loaded 2-core machine importing torch twice
PROMPT_TOKEN_MIN = 3  # ids 0-2 are <unk>, <s>, </s> in the benchmark tokenizer


@dataclass(frozen=True)
class StudyConfig:
    out: Path  # the markdown report; plots and JSON go to out's stem directory
    model_dir: Path = ROOT / "models" / "bench-20m"
    scale: float = 0.125  # multiplies every length of the anyscale workload
    policies: tuple[str, ...] = POLICIES
    batch_size: int = 16  # max_num_seqs for every policy; static/dynamic max_batch_size
    window_ms: float = 50.0  # dynamic batching window
    engine_queue: int = 16  # requests the router may keep waiting in the engine beyond batch_size
    max_num_batched_tokens: int = 2048  # tokens per step (the engine's default)
    burst_requests: int = 128  # requests of each throughput run
    rate_requests: int = (
        48  # requests of each latency run (a multiple of batch_size: static batches fill)
    )
    rate_fractions: tuple[float, ...] = (0.2, 0.4, 0.7, 1.0)  # of continuous capacity
    rates: tuple[float, ...] | None = None  # explicit Poisson rates instead of fractions
    engine_threads: int = 1  # torch threads of the engine (OMP_NUM_THREADS)
    run_limit_s: float = 300.0  # a run is cut off after this long (reported, never silent)
    seed: int = 0
    progress: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.policies) - set(POLICIES)
        if unknown or not self.policies:
            raise ValueError(f"policies must be among {', '.join(POLICIES)}, got {self.policies}")
        if not 0 < self.scale <= 1:
            raise ValueError(f"scale must be in (0, 1], got {self.scale}")
        for name in ("batch_size", "burst_requests", "rate_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.rate_requests % self.batch_size:
            raise ValueError(
                "rate_requests must be a multiple of batch_size (a static batch "
                "without a timeout runs only when full)"
            )
        if self.burst_requests % self.batch_size:
            raise ValueError("burst_requests must be a multiple of batch_size")

    @property
    def plots_dir(self) -> Path:
        return plots_dir(self.out)

    @property
    def caps(self) -> list[int]:
        from omnibus.bench.workloads import ANYSCALE_CAPS

        return [max(1, round(c * self.scale)) for c in ANYSCALE_CAPS]

    @property
    def input_len(self) -> int:
        return max(1, round(512 * self.scale))

    @property
    def mean_output(self) -> float:
        return max(1.0, 128 * self.scale)

    @property
    def block_size(self) -> int:
        return 16

    @property
    def kv_blocks(self) -> int:
        """The pool every policy gets: room for a full batch of the longest requests
        (+1: the engine's reserved null block)."""
        per_seq = math.ceil((self.input_len + max(self.caps)) / self.block_size)
        return self.batch_size * per_seq + 1


# ---- the benchmark checkpoint ---------------------------------------------------------------


def prepare_model(path: Path) -> Path:
    """bench/omnibus/bench/offline.py's checkpoint, plus the tokenizer.json the router needs."""
    from omnibus.bench.offline import BENCH_MODEL, build_model

    build_model(path)
    if not (path / "tokenizer.json").is_file():
        write_tokenizer(path / "tokenizer.json", BENCH_MODEL["vocab_size"])
    return path


def write_tokenizer(file: Path, vocab_size: int) -> None:
    """A word-level tokenizer over names t3..t{vocab-1} (the benchmark sends token ids;
    the router only decodes them)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)} | {f"t{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    tmp = file.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(file)


# ---- processes ------------------------------------------------------------------------------


def engine_flags(cfg: StudyConfig, policy: str) -> list[str]:
    """`omnibus-engine serve` flags for `policy` (after --port and --model)."""
    flags = [
        "--dtype",
        "float32",
        "--batching",
        policy,
        "--max-num-seqs",
        str(cfg.batch_size),
        "--max-num-batched-tokens",
        str(cfg.max_num_batched_tokens),
        "--num-kv-blocks",
        str(cfg.kv_blocks),
        "--block-size",
        str(cfg.block_size),
        "--no-prefix-caching",
        "--study-counters",
        "--log-level",
        "warning",
        "--drain-seconds",
        "1",
    ]
    if policy in ("static", "dynamic"):
        flags += ["--max-batch-size", str(cfg.batch_size)]
    if policy == "dynamic":
        flags += ["--batch-window-ms", f"{cfg.window_ms:g}"]
    return flags


def router_flags(cfg: StudyConfig) -> list[str]:
    """`omnibus-router serve` flags (after --port, --model and --engine)."""
    return [
        "--max-inflight-per-engine",
        str(cfg.batch_size + cfg.engine_queue),
        "--max-queue-seconds",
        str(cfg.run_limit_s * 2),
        "--log-level",
        "warning",
        "--drain-seconds",
        "1",
    ]


def shown_commands(cfg: StudyConfig) -> dict[str, str]:
    """The engine and router command lines, with PORT, MODEL and POLICY for what varies."""
    engine = processes.engine_args("PORT", "MODEL", *engine_flags(cfg, "POLICY"))
    router = processes.router_args("PORT", "MODEL", ["127.0.0.1:PORT"], *router_flags(cfg))
    return {"engine": " ".join(["python", *engine]), "router": " ".join(["python", *router])}


def check_engine_flags(policies: tuple[str, ...]) -> None:
    """The batching flags this study passes must exist on `engine serve`."""
    out = subprocess.run(
        [sys.executable, "-m", "omnibus.engine", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    needed = ["--batching"] + (
        ["--max-batch-size", "--batch-window-ms"] if {"static", "dynamic"} & set(policies) else []
    )
    missing = [f for f in needed if f not in out]
    if missing:
        raise ValueError(f"`omnibus-engine serve` lacks {', '.join(missing)}; the study needs them")


@contextmanager
def serving(cfg: StudyConfig, policy: str, log_dir: Path) -> Iterator[tuple[str, str]]:
    """An engine with `policy` and a router in front; yields (router, engine) addresses."""
    threads = str(cfg.engine_threads)
    engine = processes.engine_process(
        cfg.model_dir,
        log_dir,
        f"engine-{policy}",
        *engine_flags(cfg, policy),
        env={"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads},
    )
    router = None
    try:
        router = processes.router_process(
            cfg.model_dir, [engine.address], log_dir, f"router-{policy}", *router_flags(cfg)
        )
        engine.wait_serving(START_TIMEOUT_S)
        router.wait_serving(START_TIMEOUT_S)  # SERVING once its engine reports load
        yield router.address, engine.address
    finally:
        for child in (router, engine):
            if child is not None:
                child.stop()


# ---- runs -----------------------------------------------------------------------------------


@dataclass
class Point:
    """One run: what was sent and what came back."""

    policy: str
    kind: str  # "burst" or "rate"
    cap: int
    rate: float | None
    summary: dict
    engine: dict
    wall_s: float


def run_point(
    cfg: StudyConfig,
    target: str,
    engine: str,
    policy: str,
    kind: str,
    cap: int,
    rate: float | None,
    vocab: int,
) -> Point:
    from omnibus.bench import serve, stats, workloads

    if kind == "burst":
        spec = workloads.AnyscaleSpec(cfg.input_len, cfg.mean_output, cap)
        n = cfg.burst_requests
    else:
        spec = workloads.AnyscaleSpec(cfg.input_len, cfg.mean_output, cap, input_len_min=1)
        n = cfg.rate_requests
    requests = workloads.build_requests(
        spec, n, vocab, seed=cfg.seed, min_token_id=PROMPT_TOKEN_MIN
    )
    config = serve.RunConfig(
        target=target,
        rate=rate,
        max_duration_s=cfg.run_limit_s,
        seed=cfg.seed,
        progress=cfg.progress,
        request_id_prefix=f"{policy}-{kind}-{cap}-{rate}",
    )
    t0 = time.monotonic()
    run = asyncio.run(
        serve.run_workload(requests, config, serve.EngineMonitor(engine, interval_ms=50))
    )
    point = Point(
        policy,
        kind,
        cap,
        rate,
        stats.summarize(run.results, run.duration),
        run.engine,
        time.monotonic() - t0,
    )
    _log(
        f"{policy:>10} {kind:>5} cap {cap:>3} rate {rate or 'all':>5}: "
        f"{point.summary['output_throughput']:.0f} tok/s, "
        f"{point.summary['request_throughput']:.2f} req/s, "
        f"TTFT p50 {point.summary['ttft_ms']['p50']:.0f} ms, {point.summary['failed']} failed, "
        f"{point.wall_s:.0f} s"
    )
    return point


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_study(cfg: StudyConfig) -> dict:
    from omnibus.bench import serve

    check_engine_flags(cfg.policies)
    prepare_model(cfg.model_dir)
    started = time.time()
    points: list[Point] = []
    rates = list(cfg.rates) if cfg.rates else None
    order = ["continuous"] + [p for p in cfg.policies if p != "continuous"]
    if "continuous" not in cfg.policies:
        if not rates:
            raise ValueError("without the continuous policy, give the rates explicitly (--rates)")
        order = list(cfg.policies)
    latency_cap = cfg.caps[2]  # the 512 cap, scaled
    log_dir = Path(tempfile.mkdtemp(prefix="omnibus-strategies-"))
    try:
        for policy in order:
            _log(f"--- {policy}: starting engine + router")
            with serving(cfg, policy, log_dir) as (router, engine):
                vocab = asyncio.run(serve.list_models(router)).base_model.vocab_size
                caps = cfg.caps if policy in ("continuous", "static") else [max(cfg.caps)]
                for cap in caps:
                    points.append(run_point(cfg, router, engine, policy, "burst", cap, None, vocab))
                if rates is None:
                    rates = _calibrated_rates(cfg, router, engine, vocab, latency_cap, points)
                for rate in rates:
                    points.append(
                        run_point(cfg, router, engine, policy, "rate", latency_cap, rate, vocab)
                    )
    except BaseException:
        _log(f"server logs kept in {log_dir}")
        raise
    shutil.rmtree(log_dir, ignore_errors=True)
    return {
        "config": _config_dict(cfg),
        "rates": rates,
        "latency_cap": latency_cap,
        "points": [asdict(p) for p in points],
        "commands": shown_commands(cfg),
        "started": started,
        "elapsed_s": time.time() - started,
        "machine": _machine(),
    }


def _calibrated_rates(
    cfg: StudyConfig, router: str, engine: str, vocab: int, cap: int, points: list[Point]
) -> list[float]:
    """Fractions of the continuous policy's capacity on the latency workload, measured
    by sending that workload all at once (the run is kept as a burst point)."""
    probe = run_point(cfg, router, engine, "continuous", "probe", cap, None, vocab)
    points.append(probe)
    capacity = probe.summary["request_throughput"]
    return [float(f"{capacity * f:.2g}") for f in cfg.rate_fractions]


def _config_dict(cfg: StudyConfig) -> dict:
    """The settings, with paths as the report shows them (inside the checkout: relative)."""
    d = asdict(cfg)
    d |= {
        "out": _rel(cfg.out),
        "model_dir": _rel(cfg.model_dir),
        "caps": cfg.caps,
        "input_len": cfg.input_len,
        "mean_output": cfg.mean_output,
        "kv_blocks": cfg.kv_blocks,
        "block_size": cfg.block_size,
    }
    return d


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _machine() -> dict:
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_at_end": load,
    }


RESULTS_KEYS = ("config", "rates", "latency_cap", "points", "commands", "started", "elapsed_s",
                "machine")  # fmt: skip


def load_results(path: Path) -> dict:
    """A results.json of this study; ValueError naming --report-only if it is not one."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"--report-only {path}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"--report-only {path}: not JSON ({exc})") from None
    missing = [k for k in RESULTS_KEYS if k not in data] if isinstance(data, dict) else RESULTS_KEYS
    if missing:
        raise ValueError(
            f"--report-only {path}: not a results.json of this study (no {', '.join(missing)})"
        )
    return data


def main(args: argparse.Namespace) -> None:
    cfg = None if args.report_only else _config(args)  # its ValueErrors before anything else
    _check_writable(plots_dir(args.out))
    if args.report_only:
        data = load_results(args.report_only)
        try:
            write_report(data, args.out)
        except (KeyError, TypeError, AttributeError, IndexError) as exc:
            raise ValueError(
                f"--report-only {args.report_only}: not a results.json of this study "
                f"({type(exc).__name__}: {exc})"
            ) from None
    else:
        data = run_study(cfg)
        report.write_json(plots_dir(args.out) / "results.json", data)
        write_report(data, args.out)
    _log(f"wrote {args.out} and {plots_dir(args.out)}/")


def _check_writable(directory: Path) -> None:
    """Create `directory` (the report's plots) before anything runs; ValueError naming --out
    if it cannot be, so a study does not end in a traceback that loses its results."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out: cannot create {directory}: {exc.strerror or exc}") from None
    if not os.access(directory, os.W_OK | os.X_OK) or not os.access(directory.parent, os.W_OK):
        raise ValueError(f"--out: {directory} is not writable")


def _config(args: argparse.Namespace) -> StudyConfig:
    return StudyConfig(
        out=args.out,
        model_dir=args.model_dir,
        scale=args.scale,
        policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
        batch_size=args.batch_size,
        window_ms=args.window_ms,
        engine_queue=args.engine_queue,
        burst_requests=args.burst_requests,
        rate_requests=args.rate_requests,
        rates=_rates(args.rates),
        engine_threads=args.engine_threads,
        seed=args.seed,
        progress=sys.stderr.isatty(),
    )


def _rates(text: str) -> tuple[float, ...] | None:
    if not text:
        return None
    try:
        rates = tuple(float(r) for r in text.split(","))
    except ValueError:
        raise ValueError(f"--rates must be numbers separated by commas, got {text!r}") from None
    if not all(r > 0 and math.isfinite(r) for r in rates):
        raise ValueError(f"--rates must be positive, finite requests/s, got {text!r}")
    return rates


def add_arguments(p: argparse.ArgumentParser) -> None:
    from omnibus.common.cli import count, positive

    d = StudyConfig(out=Path("."))
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "strategies.md")
    p.add_argument(
        "--model-dir",
        type=Path,
        default=d.model_dir,
        help="the benchmark checkpoint: built here on first use, reused after",
    )
    p.add_argument(
        "--scale",
        type=positive,
        default=d.scale,
        help="multiplies the anyscale lengths (512-token prompts, mean 128, caps 32-1536)",
    )
    p.add_argument("--policies", default=",".join(d.policies))
    p.add_argument(
        "--batch-size",
        type=count,
        default=d.batch_size,
        help="max running sequences (all policies) = static/dynamic batch size",
    )
    p.add_argument("--window-ms", type=float, default=d.window_ms, help="dynamic batching window")
    p.add_argument(
        "--engine-queue",
        type=int,
        default=d.engine_queue,
        help="requests the router may keep waiting in the engine beyond the batch",
    )
    p.add_argument("--burst-requests", type=count, default=d.burst_requests)
    p.add_argument("--rate-requests", type=count, default=d.rate_requests)
    p.add_argument(
        "--rates",
        default="",
        help="Poisson rates, req/s (default: fractions "
        f"{', '.join(map(str, d.rate_fractions))} of continuous capacity)",
    )
    p.add_argument("--engine-threads", type=count, default=d.engine_threads)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--report-only",
        "--from-json",
        type=Path,
        default=None,
        metavar="RESULTS_JSON",
        help="run nothing: write the report (--out) and its plots from a results.json, e.g. "
        "docs/benchmarks/strategies/results.json",
    )
