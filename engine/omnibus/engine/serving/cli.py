"""`omnibus-engine serve ...` (or `python -m omnibus.engine serve ...`): one engine worker
process.

Each flag's default is its config field's (EngineConfig, ServerConfig, BatcherConfig,
WatchdogConfig), and the configs check what they are given, so code that builds them
directly gets the same rules. The parser and the configs are torch-free, so `--help`
(and tests that check command lines against it) never load torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Sequence
from typing import Any

from omnibus.common.adapters import adapter_name_error
from omnibus.common.cli import HelpFormatter, config_error, uint64
from omnibus.engine.config import (
    BATCHING_POLICIES, CPU_MATMULS, DEFAULT_MAX_BATCH_SIZE, DTYPE_NAMES, KV_CACHE_DTYPES, LOAD_FORMATS,
    KV_TRANSFERS,
    QUANTIZATIONS,
    ROLES,
    SPECULATIVE_METHODS,
    WAITING_ORDERS, EngineConfig)
from omnibus.engine.serving.batcher import BatcherConfig
from omnibus.engine.serving.config import ServerConfig
from omnibus.engine.serving.watchdog import WatchdogConfig


def _defaults(config: type) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(config)}


_ENGINE = _defaults(EngineConfig)
_SERVER = _defaults(ServerConfig)
_EMBED = _defaults(BatcherConfig)
_WATCHDOG = _defaults(WatchdogConfig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnibus-engine", description="Omnibus engine worker")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "serve",
        help="serve omnibus.v1.Engine for one model on one device",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--host", default=_SERVER["host"], help="address to listen on (0.0.0.0: all interfaces)"
    )
    p.add_argument("--port", type=int, default=_SERVER["port"], help="gRPC port")
    p.add_argument("--model", required=True,
                   help="Hugging Face model directory (safetensors) or .gguf file")
    p.add_argument("--device", default=_ENGINE["device"], help="cpu, cuda or cuda:N")
    p.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=_ENGINE["tensor_parallel_size"], metavar="N",
        help="split every layer over N ranks, one per device of this host (cuda:K..K+N-1 for "
        "--device cuda:K; N processes on a CPU): the engine serves a model N devices hold. Heads, "
        "KV heads and MLP channels must divide by N (KV heads are replicated when fewer than N)",
    )
    p.add_argument("--dtype", default=_ENGINE["dtype"], choices=["auto", *DTYPE_NAMES],
                   help="auto: the checkpoint's dtype on CUDA, float32 on a CPU")
    p.add_argument(
        "--load-format", default=_ENGINE["load_format"], choices=LOAD_FORMATS,
        help="dummy: random weights from config.json; null: no weights and a near-free forward "
        "that picks a fixed token pattern (measures the host path: server, scheduler, KV "
        "allocator, sampler)",
    )
    p.add_argument(
        "--null-step-ms", type=float, default=_ENGINE["null_step_ms"],
        help="with --load-format null: each step runs this long on a simulated device (its "
        "picks are ready that long after the device is free), so the host path is measured at "
        "a GPU's step rate and batch size, in lockstep or with --overlap-scheduling",
    )
    p.add_argument(
        "--cpu-matmul", default=_ENGINE["cpu_matmul"], choices=CPU_MATMULS,
        help="on a CPU, float32 linear layers: onednn multiplies with weights packed once at "
        "load into oneDNN's layout (1.3-6x faster than aten's per-call MKL product, most at "
        "decode batch sizes; a tied LM head keeps aten's); aten: torch's default linear "
        f"(default: {_ENGINE['cpu_matmul']})",
    )
    p.add_argument(
        "--quantization", default=_ENGINE["quantization"], choices=QUANTIZATIONS,
        help="how projections are held and multiplied. auto: as the checkpoint stores them (GGUF "
        "Q4_0/Q4_1/Q4_K, GPTQ, AWQ and compressed-tensors on INT4/INT8/FP8 kernels); none: every "
        "weight dequantized to --dtype (the exact reference); int8 (weight-only, per channel), "
        "fp8 (W8A8, per channel and per token) or int4 (weight-only, groups of 32): quantize a "
        "full-precision checkpoint at load. Embeddings and a tied LM head stay unquantized "
        f"(default: {_ENGINE['quantization']})",
    )
    p.add_argument(
        "--kv-cache-dtype", default=_ENGINE["kv_cache_dtype"], choices=KV_CACHE_DTYPES,
        help="what the KV cache holds. auto: the model dtype (--dtype); fp32, fp16, bf16; fp8 "
        "(= fp8_e4m3): float8 e4m3, half a 16-bit cache's bytes, each layer's keys and values "
        "divided by the checkpoint's k_scale / v_scale (1.0 where it has none) and saturated. "
        "Attention reads any of them, on CUDA (Triton) and on the CPU (in float32) "
        f"(default: {_ENGINE['kv_cache_dtype']})",
    )
    p.add_argument("--block-size", type=int, default=_ENGINE["block_size"], help="tokens per KV block")
    p.add_argument(
        "--kv-offload-bytes", type=int, default=_ENGINE["kv_offload_bytes"], metavar="BYTES",
        help="a host-memory tier for the prefix cache: blocks evicted from the device's KV pool "
        "are kept in this much (pinned) host memory, chained hashes as on the device, and loaded "
        "back instead of recomputed; load reports list them for prefix-aware routing (0: none)",
    )
    p.add_argument(
        "--kv-transfer", choices=KV_TRANSFERS, default=_ENGINE["kv_transfer"],
        help="KV that moves between engines: the transfer engine this engine reads other engines' "
        "KV with and offers its own on (mooncake: Mooncake's transfer engine over TCP). Needed by "
        "--role prefill|decode and by migration on drain, which moves running requests' KV to "
        "the engines that go on with them instead of recomputing it",
    )
    p.add_argument("--kv-transfer-host", default=_ENGINE["kv_transfer_host"], metavar="HOST",
                   help="the address other engines read this engine's KV at (its host as they see it); "
                   "auto: the address this host's name resolves to (a container's or pod's own IP)")
    p.add_argument(
        "--kv-transfer-staging-bytes", type=int, default=_ENGINE["kv_transfer_staging_bytes"], metavar="BYTES",
        help="pinned host memory KV is staged in on its way between engines: a KV pool on a GPU is "
        "copied out when held and in when read (0: none for a pool in host memory, which is read in "
        "place; 2 GiB for one on a GPU). A hold or read that finds no room is recomputed instead",
    )
    p.add_argument(
        "--kv-transfer-overlap", action=argparse.BooleanOptionalAction, default=_ENGINE["kv_transfer_overlap"],
        help="a prefill for a decode engine hands its KV on as soon as it is seated: the decode engine "
        "reads each layer's blocks as the prefill's forward finishes them (a staged or tensor-parallel "
        "pool's: each chunk's, at the end of its step), overlapping the transfer with the prefill, and "
        "computes the last prompt token itself (off by default: on a CPU it costs more than the read it "
        "hides, docs/benchmarks/pd.md)",
    )
    p.add_argument(
        "--kv-hold-seconds", type=float, default=_ENGINE["kv_hold_seconds"], metavar="S",
        help="KV held for another engine (a prefill's, a drained request's) is given back after "
        "this long if the reader's router has not released it",
    )
    p.add_argument(
        "--role", choices=ROLES, default=_ENGINE["role"],
        help="what routers send this engine: both (whole requests), prefill (prompts whose decode "
        "another engine does, reading the KV) or decode (requests whose prompt another engine "
        "prefilled); prefill and decode need --kv-transfer",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=_ENGINE["kv_cache_memory"],
        metavar="BYTES",
        help="bytes for the KV pool (default: --gpu-memory-utilization on CUDA, 512 MiB on CPU)",
    )
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=_ENGINE["num_kv_blocks"],
        help="exact KV pool size; overrides the memory sizing",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=_ENGINE["gpu_memory_utilization"],
                   help="on CUDA, the share of GPU memory weights, activations and the KV pool may use")
    p.add_argument("--max-num-seqs", type=int, default=_ENGINE["max_num_seqs"], help="sequences running at once")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=_ENGINE["max_num_batched_tokens"],
        help="tokens per step (chunked prefill)",
    )
    p.add_argument(
        "--max-model-len", type=int, default=_ENGINE["max_model_len"], help="context cap below the model's own"
    )
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse the KV of shared prompt prefixes")
    p.add_argument(
        "--waiting-order", default=_ENGINE["waiting_order"], choices=WAITING_ORDERS,
        help="order of waiting requests within a priority: slo = earliest deadline first, then "
        "the least-served tenant (preemption takes the most slack, the most-served tenant); "
        "fifo = arrival",
    )
    p.add_argument(
        "--report-prefix-blocks", type=int, default=_ENGINE["report_prefix_blocks"],
        help="cached prefix-block keys a load report carries at most, for prefix-aware routing; 0: none",
    )
    p.add_argument(
        "--batching", default=_ENGINE["batching"], choices=BATCHING_POLICIES,
        help="batching strategy: continuous joins and leaves every step; dynamic and static form "
        "batches that run until their last request ends; none runs one request at a time",
    )
    p.add_argument(
        "--max-batch-size", type=int, default=_ENGINE["max_batch_size"],
        help=f"dynamic/static: requests per formed batch, at most --max-num-seqs (default: "
        f"{DEFAULT_MAX_BATCH_SIZE}, or --max-num-seqs when lower)",
    )
    p.add_argument(
        "--batch-window-ms", type=float, default=_ENGINE["batch_window_ms"],
        help="dynamic: run a partial batch this long after its first request (default 10); "
        "static: optional timeout (default: wait for a full batch)",
    )
    p.add_argument(
        "--study-counters", action="store_true", default=_ENGINE["study_counters"],
        help="count batch slots, useful tokens and KV use per step for the batching study "
        "(Stats RPC); costs O(running sequences) per step, so off when serving",
    )
    p.add_argument(
        "--seed", type=uint64, default=_ENGINE["seed"],
        help="seed of the shared generator that requests without a seed draw from (default: from "
        "the OS, so replicas and restarts sample independently; set it to replay a run)"
    )
    p.add_argument(
        "--overlap-scheduling", action=argparse.BooleanOptionalAction, default=_ENGINE["overlap_scheduling"],
        help="plan and launch step N+1 before reading step N's tokens back, so the GPU never "
        "waits on Python (default: on for CUDA, off for CPU, where it only adds a step of latency)",
    )
    p.add_argument(
        "--speculative", default=_ENGINE["speculative"], choices=SPECULATIVE_METHODS,
        help="speculative decoding: ngram guesses each decode's next tokens from the latest earlier "
        "match of its last tokens (prompt lookup), draft from a smaller model (--speculative-draft-model); "
        "one step scores every guess and keeps those the model picks itself, so the output is "
        "unchanged (default: off)",
    )
    p.add_argument(
        "--speculative-draft-model", default=_ENGINE["speculative_draft_model"], metavar="DIR",
        help="--speculative draft: a Hugging Face checkpoint directory with the served model's tokenizer, "
        "run greedily on a KV pool of its own (as many blocks as the served model's)",
    )
    p.add_argument(
        "--num-speculative-tokens", type=int, default=_ENGINE["num_speculative_tokens"],
        help="guesses per sequence per step at most, in [1, 16]",
    )
    p.add_argument(
        "--speculative-max-batch", type=int, default=_ENGINE["speculative_max_batch"],
        help="speculation turns itself off above this many running sequences, where a step is "
        "compute-bound and guesses stop paying",
    )
    p.add_argument(
        "--structured-max-whitespace", type=int, default=_ENGINE["structured_max_whitespace"],
        help="structured output: whitespace characters a JSON output holds between two elements "
        "at most (room to pretty-print; a bound on a model that would pad until max_tokens)",
    )
    p.add_argument(
        "--decode-graphs", action=argparse.BooleanOptionalAction, default=_ENGINE["decode_graphs"],
        help="replay decode steps from CUDA graphs captured at bucketed batch sizes (default: on for CUDA)",
    )
    _adapter_flags(p)
    g = p.add_argument_group("Embed dynamic batching")
    g.add_argument("--embed-max-batch-size", type=int, default=_EMBED["max_batch_size"],
                   help="inputs per embedding batch")
    g.add_argument("--embed-max-queue-delay-ms", type=float, default=_EMBED["max_queue_delay_ms"],
                   help="longest wait for a fuller batch after the oldest request arrived")
    g.add_argument("--embed-preferred-batch-sizes", default=",".join(map(str, _EMBED["preferred_batch_sizes"])),
                   help="comma-separated batch sizes sent as soon as the queue can fill one")
    g.add_argument("--embed-max-queue-size", type=int, default=_EMBED["max_queue_size"],
                   help="queued Embed requests at most (more: RESOURCE_EXHAUSTED)")
    g.add_argument("--embed-queue-timeout-ms", type=float, default=_EMBED["default_timeout_ms"],
                   help="default queue timeout of an Embed request (DEADLINE_EXCEEDED after)")
    _security_flags(p)
    g = p.add_argument_group("watchdog (a stalled step: NOT_SERVING, then the process exits)")
    g.add_argument("--watchdog-step-seconds", type=float, default=_WATCHDOG["stall_seconds"],
                   help="a step running longer turns health NOT_SERVING and load reports "
                   "UNAVAILABLE, so routers stop sending; 0: no watchdog")
    g.add_argument("--watchdog-first-step-seconds", type=float, default=_WATCHDOG["first_step_seconds"],
                   help="the limit of the first served step (kernel compiles, CUDA-graph capture)")
    g.add_argument("--watchdog-exit-seconds", type=float, default=_WATCHDOG["exit_seconds"],
                   help="still stalled this long past the limit: the process exits (code 70) "
                   "so the orchestrator restarts it")
    p.add_argument(
        "--step-loop", default="auto", choices=["auto", "process", "thread"],
        help="where the step loop runs: process = a process of its own, so planning and "
        "launching steps never waits for the GIL held by the gRPC server (one more hop per "
        "message); thread = a thread of the server's process; auto = process, except for the "
        "null model on a CPU (its near-free forward leaves the hop most of what it measures)",
    )
    p.add_argument("--metrics-port", type=int, default=_SERVER["metrics_port"],
                   help="Prometheus /metrics port; 0: off")
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=_SERVER["drain_seconds"],
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
        default=_ENGINE["adapter_dir"],
        metavar="DIR",
        help="root of the PEFT LoRA adapters, one directory per adapter (adapter_config.json + "
        "adapter_model.safetensors), named by the directory; without it only the base model is "
        "served",
    )
    g.add_argument(
        "--max-loras", type=int, default=_ENGINE["max_loras"],
        help="device adapter slots (distinct adapters per step)",
    )
    g.add_argument(
        "--max-cpu-loras", type=int, default=_ENGINE["max_cpu_loras"], help="adapters kept in host memory (LRU)"
    )
    g.add_argument(
        "--max-lora-rank", type=int, default=_ENGINE["max_lora_rank"], help="adapters of a higher rank are refused"
    )
    g.add_argument(
        "--preload-adapters",
        default=",".join(_ENGINE["preload_adapters"]),
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
    """The engine's and the server's configs for parsed `serve` flags; ValueError if invalid.
    A flag whose name is a config field's sets that field."""
    from omnibus.common.security import ServerSecurity

    values = vars(args)
    try:
        preferred = tuple(int(x) for x in args.embed_preferred_batch_sizes.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--embed-preferred-batch-sizes must be integers, got "
                         f"{args.embed_preferred_batch_sizes!r}") from None
    try:
        embed_batching = BatcherConfig(**{
            name: values[_embed_dest(name)] for name in _EMBED if name != "preferred_batch_sizes"
        }, preferred_batch_sizes=preferred)
    except ValueError as exc:  # named as the flags are: --embed-<field>
        fields = "|".join(_EMBED)
        raise ValueError(re.sub(rf"\b({fields})\b", lambda m: "--" + _embed_dest(m.group()).replace("_", "-"),
                                str(exc))) from None
    server = ServerConfig(
        **_fields(ServerConfig, values),
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
    engine = EngineConfig(**_fields(EngineConfig, values, preload_adapters=preload_list(args.preload_adapters)))
    return engine, server


def _fields(config: type, values: dict[str, Any], **given: Any) -> dict[str, Any]:
    """The fields of `config` that have a flag of their name, as parsed, and `given`."""
    names = {f.name for f in dataclasses.fields(config)}
    return {name: value for name, value in values.items() if name in names} | given


def _embed_dest(field: str) -> str:
    """The dest of the flag that sets BatcherConfig's `field`: embed_<field>."""
    return "embed_" + {"default_timeout_ms": "queue_timeout_ms"}.get(field, field)


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

    from omnibus.engine.serving.loading import EngineLoadError, load_engine
    from omnibus.engine.serving.server import serve
    from omnibus.engine.serving.step_loop_runners import StepLoopProcess, resolve_step_loop

    try:
        step_loop = resolve_step_loop(step_loop, config)
        served = StepLoopProcess(config, log_level) if step_loop == "process" else load_engine(config)
    except EngineLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        uvloop.run(serve(served, server_config))
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
