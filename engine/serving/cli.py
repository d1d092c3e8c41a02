"""`omnibus-engine serve ...` (or `python -m omnibus.engine serve ...`): one engine worker
process.

The parser imports nothing heavy, so `--help` (and tests that check command lines
against it) do not load torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from omnibus.common.adapters import adapter_name_error
from omnibus.common.cli import HelpFormatter, config_error, uint64

if TYPE_CHECKING:
    from omnibus.engine.config import EngineConfig
    from omnibus.engine.serving.server import ServerConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnibus-engine", description="Omnibus engine worker")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "serve",
        help="serve omnibus.v1.Engine for one model on one device",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all interfaces)"
    )
    p.add_argument("--port", type=int, default=50061, help="gRPC port")
    p.add_argument("--model", required=True, help="Hugging Face model directory (safetensors)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: the checkpoint's dtype on CUDA, float32 on a CPU")
    p.add_argument(
        "--load-format", default="safetensors", choices=["safetensors", "dummy", "null"],
        help="dummy: random weights from config.json; null: no weights and a near-free forward "
        "that picks a fixed token pattern (measures the host path: server, scheduler, KV "
        "allocator, sampler)",
    )
    p.add_argument(
        "--null-step-ms", type=float, default=0.0,
        help="with --load-format null: each step runs this long on a simulated device (its "
        "picks are ready that long after the device is free), so the host path is measured at "
        "a GPU's step rate and batch size, in lockstep or with --overlap-scheduling",
    )
    p.add_argument(
        "--cpu-matmul", default="onednn", choices=["onednn", "aten"],
        help="on a CPU, float32 linear layers: onednn multiplies with weights packed once at "
        "load into oneDNN's layout (1.3-6x faster than aten's per-call MKL product, most at "
        "decode batch sizes; a tied LM head keeps aten's); aten: torch's default linear "
        "(default: onednn)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        metavar="BYTES",
        help="bytes for the KV pool (default: --gpu-memory-utilization on CUDA, 512 MiB on CPU)",
    )
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="exact KV pool size; overrides the memory sizing",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on CUDA, the share of GPU memory weights, activations and the KV pool may use")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences running at once")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="tokens per step (chunked prefill)"
    )
    p.add_argument(
        "--max-model-len", type=int, default=None, help="context cap below the model's own"
    )
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse the KV of shared prompt prefixes")
    p.add_argument(
        "--waiting-order", default="slo", choices=["slo", "fifo"],
        help="order of waiting requests within a priority: slo = earliest deadline first, then "
        "the least-served tenant (preemption takes the most slack, the most-served tenant); "
        "fifo = arrival",
    )
    p.add_argument(
        "--report-prefix-blocks", type=int, default=4096,
        help="cached prefix-block keys a load report carries at most, for prefix-aware routing; 0: none",
    )
    p.add_argument(
        "--batching", default="continuous", choices=["continuous", "dynamic", "static", "none"],
        help="batching strategy: continuous joins and leaves every step; dynamic and static form "
        "batches that run until their last request ends; none runs one request at a time",
    )
    p.add_argument(
        "--max-batch-size", type=int, default=None,
        help="dynamic/static: requests per formed batch, at most --max-num-seqs (default: 32, or "
        "--max-num-seqs when lower)",
    )
    p.add_argument(
        "--batch-window-ms", type=float, default=None,
        help="dynamic: run a partial batch this long after its first request (default 10); "
        "static: optional timeout (default: wait for a full batch)",
    )
    p.add_argument(
        "--study-counters", action="store_true",
        help="count batch slots, useful tokens and KV use per step for the batching study "
        "(Stats RPC); costs O(running sequences) per step, so off when serving",
    )
    p.add_argument(
        "--seed", type=uint64, default=None,
        help="seed of the shared generator that requests without a seed draw from (default: from "
        "the OS, so replicas and restarts sample independently; set it to replay a run)"
    )
    p.add_argument(
        "--overlap-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="plan and launch step N+1 before reading step N's tokens back, so the GPU never "
        "waits on Python (default: on for CUDA, off for CPU, where it only adds a step of latency)",
    )
    p.add_argument(
        "--decode-graphs", action=argparse.BooleanOptionalAction, default=None,
        help="replay decode steps from CUDA graphs captured at bucketed batch sizes (default: on for CUDA)",
    )
    _adapter_flags(p)
    g = p.add_argument_group("Embed dynamic batching")
    g.add_argument("--embed-max-batch-size", type=int, default=32, help="inputs per embedding batch")
    g.add_argument("--embed-max-queue-delay-ms", type=float, default=5.0,
                   help="longest wait for a fuller batch after the oldest request arrived")
    g.add_argument("--embed-preferred-batch-sizes", default="",
                   help="comma-separated batch sizes sent as soon as the queue can fill one")
    g.add_argument("--embed-max-queue-size", type=int, default=1024,
                   help="queued Embed requests at most (more: RESOURCE_EXHAUSTED)")
    g.add_argument("--embed-queue-timeout-ms", type=float, default=None,
                   help="default queue timeout of an Embed request (DEADLINE_EXCEEDED after)")
    _security_flags(p)
    g = p.add_argument_group("watchdog (a stalled step: NOT_SERVING, then the process exits)")
    g.add_argument("--watchdog-step-seconds", type=float, default=120.0,
                   help="a step running longer turns health NOT_SERVING and load reports "
                   "UNAVAILABLE, so routers stop sending; 0: no watchdog")
    g.add_argument("--watchdog-first-step-seconds", type=float, default=900.0,
                   help="the limit of the first served step (kernel compiles, CUDA-graph capture)")
    g.add_argument("--watchdog-exit-seconds", type=float, default=60.0,
                   help="still stalled this long past the limit: the process exits (code 70) "
                   "so the orchestrator restarts it")
    p.add_argument(
        "--step-loop", default="auto", choices=["auto", "process", "thread"],
        help="where the step loop runs: process = a process of its own, so planning and "
        "launching steps never waits for the GIL held by the gRPC server (one more hop per "
        "message); thread = a thread of the server's process; auto = process, except for the "
        "null model on a CPU (its near-free forward leaves the hop most of what it measures)",
    )
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port; 0: off")
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM, how long in-flight streams may take to finish",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="JSON log lines on stderr at this level and above")
    return parser


def _security_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("authentication: TLS, mutual TLS, a shared token")
    g.add_argument("--tls-cert", default=None, metavar="PEM", help="serve TLS with this certificate")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="the key of --tls-cert")
    g.add_argument(
        "--tls-client-ca", default=None, metavar="PEM",
        help="mutual TLS: require a client certificate signed by this CA (the router's "
        "--engine-tls-cert)",
    )
    g.add_argument(
        "--token-file", default=None, metavar="FILE",
        help="every call but health must carry 'authorization: Bearer <the token in FILE>' "
        "(the router's --engine-token-file); UNAUTHENTICATED otherwise",
    )


def _adapter_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters")
    g.add_argument(
        "--adapter-dir",
        default=None,
        metavar="DIR",
        help="root of the PEFT LoRA adapters, one directory per adapter (adapter_config.json + "
        "adapter_model.safetensors), named by the directory; without it only the base model is "
        "served",
    )
    g.add_argument(
        "--max-loras", type=int, default=4, help="device adapter slots (distinct adapters per step)"
    )
    g.add_argument(
        "--max-cpu-loras", type=int, default=16, help="adapters kept in host memory (LRU)"
    )
    g.add_argument(
        "--max-lora-rank", type=int, default=16, help="adapters of a higher rank are refused"
    )
    g.add_argument(
        "--preload-adapters",
        default="",
        metavar="A,B,...",
        help="comma-separated adapters loaded into host memory before the worker reports SERVING",
    )


def preload_list(value: str) -> tuple[str, ...]:
    """The adapter names of --preload-adapters (blank entries dropped); ValueError naming
    the flag for one that is no adapter name."""
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    for name in names:
        error = adapter_name_error(name, " in --preload-adapters")
        if error is not None:
            raise ValueError(error)
    return names


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The engine's and the server's configs for parsed `serve` flags; ValueError if invalid."""
    from omnibus.engine.serving.batcher import BatcherConfig
    from omnibus.engine.config import EngineConfig
    from omnibus.common.security import ServerSecurity
    from omnibus.engine.serving.server import ServerConfig
    from omnibus.engine.serving.watchdog import WatchdogConfig

    try:
        preferred = tuple(int(x) for x in args.embed_preferred_batch_sizes.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--embed-preferred-batch-sizes must be integers, got "
                         f"{args.embed_preferred_batch_sizes!r}") from None
    try:
        embed_batching = BatcherConfig(
            max_batch_size=args.embed_max_batch_size,
            max_queue_delay_ms=args.embed_max_queue_delay_ms,
            preferred_batch_sizes=preferred,
            max_queue_size=args.embed_max_queue_size,
            default_timeout_ms=args.embed_queue_timeout_ms,
        )
    except ValueError as exc:  # named as the flags are: --embed-<field>
        def flag(field: str) -> str:
            return "--embed-" + {"default_timeout_ms": "queue_timeout_ms"}.get(field, field).replace("_", "-")

        fields = "|".join(f.name for f in dataclasses.fields(BatcherConfig))
        raise ValueError(re.sub(rf"\b({fields})\b", lambda m: flag(m.group()), str(exc))) from None
    server = ServerConfig(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        drain_seconds=args.drain_seconds,
        embed_batching=embed_batching,
        security=ServerSecurity.from_files(
            args.tls_cert, args.tls_key, args.tls_client_ca, args.token_file
        ),
        watchdog=WatchdogConfig(
            stall_seconds=args.watchdog_step_seconds,
            first_step_seconds=args.watchdog_first_step_seconds,
            exit_seconds=args.watchdog_exit_seconds,
        ),
    )
    engine = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        null_step_ms=args.null_step_ms,
        cpu_matmul=args.cpu_matmul,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        waiting_order=args.waiting_order,
        report_prefix_blocks=args.report_prefix_blocks,
        batching=args.batching,
        max_batch_size=args.max_batch_size,
        batch_window_ms=args.batch_window_ms,
        study_counters=args.study_counters,
        seed=args.seed,
        overlap_scheduling=args.overlap_scheduling,
        decode_graphs=args.decode_graphs,
        adapter_dir=args.adapter_dir,
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        max_lora_rank=args.max_lora_rank,
        preload_adapters=preload_list(args.preload_adapters),
    )
    if engine.preload_adapters and engine.adapter_dir is None:
        raise ValueError("--preload-adapters needs --adapter-dir")
    if len(set(engine.preload_adapters)) > engine.max_cpu_loras:
        raise ValueError(
            f"--preload-adapters lists {len(set(engine.preload_adapters))} adapters but host "
            f"memory holds {engine.max_cpu_loras} (--max-cpu-loras)"
        )
    return engine, server


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        import torch  # noqa: F401  (the torch-free install `pip install omnibus` has this script too)
    except ImportError:
        print("error: omnibus-engine needs torch, which this install lacks: pip install 'omnibus[engine]'",
              file=sys.stderr)
        return 1
    try:
        config, server_config = configs_from_args(args)
    except ValueError as exc:
        print(f"error: {config_error(exc, parser)}", file=sys.stderr)
        return 2
    from omnibus.common.logs import configure_logging, quiet_shutdown

    configure_logging(args.log_level)
    quiet_shutdown()
    if config.batching in ("continuous", "none"):
        ignored = [flag for flag, value in (("--max-batch-size", args.max_batch_size),
                                            ("--batch-window-ms", args.batch_window_ms)) if value is not None]
        if ignored:
            import structlog

            structlog.get_logger().warning("flags_ignored", flags=ignored, batching=config.batching,
                                           why="only dynamic and static batching form batches")
    return _serve(config, server_config, args.step_loop, args.log_level)


def _serve(config: EngineConfig, server_config: ServerConfig, step_loop: str, log_level: str) -> int:
    import uvloop

    from omnibus.engine.serving.core import EngineLoadError, ProcessCore, load_engine, resolve_step_loop
    from omnibus.engine.serving.server import serve

    try:
        step_loop = resolve_step_loop(step_loop, config)
        core = ProcessCore(config, log_level) if step_loop == "process" else load_engine(config)
    except EngineLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        uvloop.run(serve(core, server_config))
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
