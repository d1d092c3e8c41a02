"""`omnibus-bench serve ...` (load generator) and `omnibus-bench strategies ...` (the
batching strategies study). `python -m omnibus.bench.offline` is the offline benchmark."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc

from omnibus.bench import workloads
from omnibus.common.cli import config_error, count, positive, seconds

SERVE_EPILOG = """\
workloads (every length is multiplied by --scale, rounded, at least 1):
  anyscale       prompts of --input-len tokens (uniform over [--input-len-min,
                 --input-len] when that is given); output lengths round(Exp(mean
                 --output-mean)) clamped to [1, --output-cap]. Defaults: 512, 128, 512
                 (the 2023 benchmark's caps were 32, 128, 512, 1536).
  sharegpt-like  prompt and output lengths log-normal: round(exp(N(ln median, sigma)))
                 clamped to [4, cap]. Defaults: prompts median 98, sigma 1.0, cap 1024;
                 outputs median 205, sigma 1.0, cap 1024 (means about 160 and 340,
                 as reported for ShareGPT).
Every request sends random token ids in [3, vocab_size) (vocab from ListModels),
max_tokens = its output length, temperature 0 and ignore_eos, so lengths are exact.

mixes:
  --adapters a,b,c      x-adapter-id round-robin; a:3,b:1 weighted at random; "base" = none
  --priorities 0:3,10:1 priority values, weighted

examples:
  omnibus-bench serve --target 127.0.0.1:50051 --workload anyscale --scale 0.125 \\
      --num-requests 64 --rate 2 --slo-ttft-ms 2000 --slo-tpot-ms 200 --out-dir runs/a
  omnibus-bench serve --target 127.0.0.1:50051 --workload sharegpt-like --concurrency 8
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnibus-bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "serve",
        help="load-test an omnibus.v1.Inference server",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _serve_arguments(p)
    from omnibus.bench import strategies

    s = sub.add_parser(
        "strategies",
        help="the batching strategies study (docs/benchmarks/strategies.md)",
        description=strategies.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    strategies.add_arguments(s)
    return parser


def _file_stem(text: str) -> str:
    """A file name without a directory part: the reports stay inside --out-dir."""
    if not text or text in (".", "..") or "/" in text or "\\" in text or "\0" in text:
        raise argparse.ArgumentTypeError(f"must be a file name without a directory part, got {text!r}")
    return text


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target", required=True, metavar="HOST:PORT", help="the router (Inference service)"
    )
    p.add_argument("--api-key", default=None, help="sent as 'authorization: Bearer KEY'")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=["anyscale", "sharegpt-like"], default="anyscale")
    w.add_argument("--num-requests", type=count, default=100)
    w.add_argument("--scale", type=positive, default=1.0, help="multiply every length by this")
    w.add_argument("--input-len", type=count, default=512, help="anyscale: prompt tokens")
    w.add_argument(
        "--input-len-min",
        type=count,
        default=None,
        help="anyscale: prompts uniform over [this, --input-len]",
    )
    w.add_argument("--output-mean", type=positive, default=128.0, help="anyscale: mean output tokens")
    w.add_argument(
        "--output-cap",
        type=count,
        default=None,
        help="largest output (anyscale default 512, sharegpt-like 1024)",
    )
    w.add_argument("--adapters", default="", help="x-adapter-id mix, e.g. a,b or a:3,b:1")
    w.add_argument("--priorities", default="", help="priority mix, e.g. 0:3,10:1")
    w.add_argument("--seed", type=int, default=0)
    a = p.add_argument_group("arrivals (default: all at once)").add_mutually_exclusive_group()
    a.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s")
    a.add_argument("--concurrency", type=count, default=None, help="requests kept in flight")
    a.add_argument("--burst", action="store_true", help="send everything at once (the default)")
    p.add_argument(
        "--max-duration",
        type=seconds,
        default=None,
        help="seconds; then cancel what is running and send nothing more",
    )
    p.add_argument("--timeout", type=seconds, default=None, help="per-request deadline, seconds")
    g = p.add_argument_group("goodput SLOs (a request counts when it meets every one given)")
    g.add_argument("--slo-ttft-ms", type=positive, default=None)
    g.add_argument("--slo-tpot-ms", type=positive, default=None)
    g.add_argument("--slo-e2e-ms", type=positive, default=None)
    p.add_argument(
        "--engine",
        default=None,
        metavar="HOST:PORT",
        help="also watch this engine worker (Stats, WatchLoad) during the run",
    )
    p.add_argument(
        "--out-dir", type=Path, default=None, help="write NAME.json, NAME.md and NAME.png here"
    )
    p.add_argument("--name", type=_file_stem, default="serve", help="file name stem for --out-dir")
    p.add_argument("--no-progress", action="store_true")


def workload_spec(args: argparse.Namespace) -> workloads.Spec:
    if args.workload == "anyscale":
        spec = workloads.AnyscaleSpec(
            args.input_len, args.output_mean, args.output_cap or 512, args.input_len_min
        )
    else:
        spec = workloads.ShareGptSpec()
        if args.output_cap:
            o = spec.output
            spec = workloads.ShareGptSpec(
                spec.prompt, workloads.LogNormal(o.median, o.sigma, o.low, args.output_cap)
            )
    return spec.scaled(args.scale) if args.scale != 1.0 else spec


_SECRET_NAME = re.compile(r"(key|token|secret|password|passwd|credentials?)$|^auth", re.I)


def redact_secrets(config: dict) -> dict:
    """`config` with every secret-like setting (api_key, *_token, *secret, password, ...)
    that is set replaced by "<redacted>", for files that are kept and shared."""
    return {
        k: "<redacted>" if v not in (None, "") and _SECRET_NAME.search(k) else v
        for k, v in config.items()
    }


async def serve_main(args: argparse.Namespace) -> dict:
    from omnibus.bench import report, serve, stats

    spec = workload_spec(args)
    models = await serve.list_models(args.target, args.api_key)
    requests = workloads.build_requests(
        spec,
        args.num_requests,
        models.base_model.vocab_size,
        seed=args.seed,
        adapters=args.adapters,
        priorities=args.priorities,
    )
    serve.check_fits(requests, models.base_model)
    config = serve.RunConfig(
        target=args.target,
        rate=args.rate,
        concurrency=args.concurrency,
        max_duration_s=args.max_duration,
        timeout_s=args.timeout,
        api_key=args.api_key,
        seed=args.seed,
        progress=not args.no_progress,
    )
    slo = stats.Slo(
        *(
            None if v is None else v / 1e3
            for v in (args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
        )
    )
    monitor = serve.EngineMonitor(args.engine) if args.engine else None
    run = await serve.run_workload(requests, config, monitor)
    summary = stats.summarize(run.results, run.duration, slo)
    setup = (
        f"Target {args.target} (model {models.base_model.id}); workload {args.workload} "
        f"{spec}; {args.num_requests} requests, {config.mode}."
    )
    payload = {
        "setup": setup,
        "config": redact_secrets(vars(args) | {"out_dir": str(args.out_dir)}),
        "summary": summary,
        "engine": run.engine,
    }
    text = report.summary_markdown(summary, setup=setup) + "\n" + report.engine_markdown(run.engine)
    print(text)
    if args.out_dir:
        report.write_json(
            args.out_dir / f"{args.name}.json",
            payload | {"results": report.results_payload(run.results)},
        )
        (args.out_dir / f"{args.name}.md").write_text(text)
        report.plot_run(
            run.results,
            args.out_dir / f"{args.name}.png",
            f"{args.workload} (scale {args.scale:g}), {args.num_requests} requests, {config.mode}",
        )
    return payload


# Config fields (as their ValueErrors name them) whose flag has another name.
_FLAGS = {
    "serve": {"n": "--num-requests", "mean_output": "--output-mean", "cap": "--output-cap",
              "timeout_s": "--timeout", "max_duration_s": "--max-duration",
              "input_len": "--input-len", "input_len_min": "--input-len-min"},
    "strategies": {"batch_size": "--batch-size", "rate_requests": "--rate-requests",
                   "burst_requests": "--burst-requests"},
}  # fmt: skip


def flag_error(exc: ValueError, parser: argparse.ArgumentParser, command: str) -> str:
    """A config's ValueError in terms of the flags: "<field> must ..." as "--flag must ...",
    and the other fields it names as their flags."""
    flags = _FLAGS.get(command, {})
    field, _, rest = str(exc).partition(" ")
    if field in flags and rest.startswith("must "):
        text = f"{flags[field]} {rest}"
    else:
        text = config_error(exc, parser)
    for name, flag in flags.items():
        if len(name) > 1:  # "n" would match words
            text = re.sub(rf"(?<![\w-]){name}\b", flag, text)
    return text


def _check_out_dir(path: Path, flag: str) -> None:
    """Create `path` now (ValueError if it cannot be, or cannot be written): the run must not
    end in a traceback that loses its results."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: not writable")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            if args.out_dir:
                _check_out_dir(args.out_dir, "--out-dir")
            summary = asyncio.run(serve_main(args))["summary"]
            if not summary["completed"]:  # the report says why; a script must not read success
                print(f"error: none of the {summary['requests']} requests completed "
                      f"({summary['failures_by_code']})", file=sys.stderr)
                return 1
        else:
            from omnibus.bench import strategies

            strategies.main(args)
    except ValueError as exc:
        print(f"error: {flag_error(exc, parser, args.command)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what was running is cancelled; no report
        print("error: interrupted; no report written", file=sys.stderr)
        return 130
    except grpc.RpcError as exc:  # the target could not be reached or refused ListModels
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
