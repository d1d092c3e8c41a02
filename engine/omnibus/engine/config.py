"""Configuration: the model's architecture (read from config.json, or a GGUF file's
metadata) and the engine's knobs.

Both are frozen dataclasses validated at construction; bad values raise ValueError
with a message that names the field and what it accepts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from omnibus.common.checkpoint import architecture, context_length, field, max_positions
from omnibus.common.model_files import DirectoryFiles, open_model
from omnibus.engine.core.scheduler import SchedulerConfig
from omnibus.engine.spec.proposer import PROPOSERS, SpecConfig

if TYPE_CHECKING:
    import torch

# The choices of EngineConfig's fields (the command line offers the same).
LOAD_FORMATS = ("safetensors", "dummy", "null")
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # torch dtypes, by name
BATCHING_POLICIES = ("continuous", "dynamic", "static", "none")
WAITING_ORDERS = ("slo", "fifo")
CPU_MATMULS = ("onednn", "aten")
# How projections are held and multiplied (model/linear.py). auto: as the checkpoint stores
# them; none: every weight dequantized to the model dtype (the exact reference); int8, fp8,
# int4: a full-precision checkpoint quantized at load (weight-only INT8 per channel, FP8
# W8A8 per channel with per-token activations, INT4 in groups of 32).
QUANTIZATIONS = ("auto", "none", "int8", "fp8", "int4")
KV_TRANSFERS = ("none", "mooncake")  # --kv-transfer (kv_transfer/transport.py TRANSPORTS)
KV_STAGING_DEFAULT = 2 << 30  # --kv-transfer-staging-bytes 0 on a GPU: 2 GiB (8 prompts of 2,000 tokens of Llama-3-8B)
ROLES = ("both", "prefill", "decode")  # --role
# What the KV cache holds. auto: the model dtype; fp8 (= fp8_e4m3): float8_e4m3fn, each
# layer's keys and values divided by its scales (the checkpoint's self_attn.k_scale /
# v_scale, else 1.0) and saturated; attention multiplies them back.
KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "bf16", "fp8", "fp8_e4m3")
DEFAULT_MAX_BATCH_SIZE = 32  # static/dynamic batches, when max_num_seqs allows
_SCHEDULER = {f.name: f.default for f in fields(SchedulerConfig)}  # the scheduler's own defaults
_SPEC = {f.name: f.default for f in fields(SpecConfig)}
SPECULATIVE_METHODS = PROPOSERS
# transformers' num_key_value_heads when config.json has no such key (null: num_attention_heads)
_DEFAULT_KV_HEADS = {"mistral": 8, "qwen2": 32}
_T = TypeVar("_T")


class ModelLoadError(ValueError):
    """A checkpoint (directory or GGUF file) that cannot be served (missing file, bad
    shape, pickle...)."""


@dataclass(frozen=True)
class RopeScaling:
    """Rotary embedding variant. `kind` is "default", "linear", "llama3" or "freq_factors"
    (each frequency divided by its own factor: how llama.cpp's GGUF files store Llama 3.1's
    scaling, the rope_freqs tensor)."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only
    factors: tuple[float, ...] = ()  # freq_factors only: one per frequency (head_dim / 2)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family checkpoint, as read from its config.json."""

    model_type: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # < num_heads means grouped-query attention
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Biases, as transformers builds each architecture: Qwen2 on q/k/v; Llama on q/k/v and
    # o with attention_bias, on gate/up/down with mlp_bias; Mistral none.
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str  # the checkpoint's own dtype, used when the engine asks for "auto"

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        """The architecture of the model directory or GGUF file `path` (its config and
        generation config, omnibus.common.model_files). ModelLoadError naming the file
        and the reason when it cannot be served."""
        files = _read(lambda: open_model(path))
        raw = _read(files.config)
        try:
            cfg = cls.from_dict(raw)
        except ModelLoadError as exc:
            if isinstance(files, DirectoryFiles):
                raise
            # the rules speak of config.json: say which file's metadata it was made from
            raise ModelLoadError(f"{path} (its metadata read as config.json): {exc}") from exc
        generation = _read(files.generation_config)
        if generation is None:
            return cfg
        source = str(files.file_for("generation_config.json"))
        return replace(cfg, eos_token_ids=_eos_ids(generation.get("eos_token_id"), source))

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        try:
            model_type = architecture(raw)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # the MLP is SwiGLU (kernels.fused silu_and_mul)
            raise ModelLoadError(f"unsupported hidden_act {act!r}; supported: silu")
        try:
            num_heads = field(raw, "num_attention_heads", int)
            hidden = field(raw, "hidden_size", int)
            eos_ids = _eos_ids(raw.get("eos_token_id"), "config.json")
            rope_theta, rope_scaling = _parse_rope(raw, max_positions(raw))
            attention_bias = field(raw, "attention_bias", bool, False)
            cfg = cls(
                model_type=model_type,
                vocab_size=field(raw, "vocab_size", int),
                hidden_size=hidden,
                intermediate_size=field(raw, "intermediate_size", int),
                num_layers=field(raw, "num_hidden_layers", int),
                num_heads=num_heads,
                # Left out: the architecture's default; null: one per query head (as the configs' __init__).
                num_kv_heads=field(raw, "num_key_value_heads", int, num_heads if "num_key_value_heads" in raw
                                   else _DEFAULT_KV_HEADS.get(model_type, num_heads)),
                head_dim=field(raw, "head_dim", int, None) or hidden // num_heads,
                rms_norm_eps=field(raw, "rms_norm_eps", float, 1e-6),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=context_length(raw),
                tie_word_embeddings=field(raw, "tie_word_embeddings", bool, False),
                qkv_bias=model_type == "qwen2" or (model_type == "llama" and attention_bias),
                o_bias=model_type == "llama" and attention_bias,
                mlp_bias=model_type == "llama" and field(raw, "mlp_bias", bool, False),
                eos_token_ids=eos_ids,
                bos_token_id=raw.get("bos_token_id"),
                torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            )
        except ModelLoadError:
            raise
        except KeyError as exc:
            raise ModelLoadError(f"config.json lacks required field {exc.args[0]!r}") from exc
        except (TypeError, ValueError, ZeroDivisionError) as exc:
            if str(exc).startswith("config.json"):  # it names the field
                raise ModelLoadError(str(exc)) from exc
            raise ModelLoadError(f"config.json has a field of the wrong type or value: {exc}") from exc
        sizes = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                 "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
                 "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
                 "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings}
        bad = [f"{k}={v}" for k, v in sizes.items() if v < 1]
        if bad:
            raise ModelLoadError(f"config.json sizes must be positive: {', '.join(bad)}")
        if cfg.head_dim % 2:
            raise ModelLoadError(
                f"head_dim is {cfg.head_dim}: rotary embeddings rotate pairs of channels and need an even "
                "head_dim (hidden_size / num_attention_heads unless config.json sets head_dim)"
            )
        if cfg.num_heads % cfg.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({cfg.num_heads}) must be a multiple of "
                f"num_key_value_heads ({cfg.num_kv_heads})"
            )
        factors = len(cfg.rope_scaling.factors)
        if cfg.rope_scaling.kind == "freq_factors" and factors != cfg.head_dim // 2:
            raise ModelLoadError(f"the rope scaling has {factors} frequency factors where head_dim "
                                 f"{cfg.head_dim} has {cfg.head_dim // 2} frequencies")
        return cfg


def _read(step: Callable[[], _T]) -> _T:
    """`step`'s model-file read, its ValueError (which names the file) a ModelLoadError."""
    try:
        return step()
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc


def _eos_ids(value: object, source: str) -> tuple[int, ...]:
    """eos_token_id as config.json and generation_config.json hold it: an id, a list, or null."""
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelLoadError(f"{source}: eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(values)


def _parse_rope(raw: dict, max_positions: int) -> tuple[float, RopeScaling]:
    """rope_theta and the scaling variant, as transformers standardizes them: a legacy
    `rope_scaling` dict replaces `rope_parameters`; rope_theta is the dict's, else the
    top-level one, else 10000; llama3's original_max_position_embeddings is a top-level
    one when config.json has it (transformers gives that priority), else the dict's, else
    max_position_embeddings. Values that make the frequencies infinite or NaN are refused."""
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    theta = field(rope, "rope_theta", float, None)
    if theta is None:
        theta = field(raw, "rope_theta", float, 10000.0)
    if not theta > 0:
        raise ModelLoadError(f"config.json rope_theta must be positive, got {theta}")
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return theta, RopeScaling()
    if kind == "freq_factors":
        factors = rope.get("factors")
        if not isinstance(factors, list) or not factors or not all(
                isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f) and f > 0
                for f in factors):
            raise ModelLoadError("freq_factors rope scaling needs factors: a list of positive numbers")
        return theta, RopeScaling(kind="freq_factors", factors=tuple(float(f) for f in factors))
    if kind not in ("linear", "llama3"):
        raise ModelLoadError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")
    required = ("factor",) if kind == "linear" else ("factor", "low_freq_factor", "high_freq_factor")
    missing = [key for key in required if key not in rope]
    if missing:
        raise ModelLoadError(
            f"{kind} rope scaling needs {', '.join(missing)} in config.json's rope parameters")
    factor = field(rope, "factor", float)
    if not factor > 0:
        raise ModelLoadError(f"config.json rope scaling factor must be positive, got {factor}")
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=factor)
    original = field(raw, "original_max_position_embeddings", int, None)
    if original is None:
        original = field(rope, "original_max_position_embeddings", int, max_positions)
    return theta, RopeScaling(
        kind="llama3",
        factor=factor,
        low_freq_factor=field(rope, "low_freq_factor", float),
        high_freq_factor=field(rope, "high_freq_factor", float),
        original_max_position_embeddings=original,
    )


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine worker is started with."""

    model: str  # path of a Hugging Face checkpoint directory or a .gguf file
    device: str = "cpu"  # "cpu" or "cuda[:N]"
    dtype: str = "auto"  # "auto" (the checkpoint's) | "float32" | "bfloat16" | "float16"
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: int | None = None  # bytes for the KV pool; None: gpu_memory_utilization (CUDA) or 512 MiB (CPU)
    num_kv_blocks: int | None = None  # exact pool size (tests); overrides kv_cache_memory
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory the engine may use in all
    max_num_seqs: int = _SCHEDULER["max_num_seqs"]  # running sequences per step
    max_num_batched_tokens: int = _SCHEDULER["max_num_batched_tokens"]  # tokens (prefill + decode) per step
    max_model_len: int | None = None  # context limit; default and ceiling: the model's
    enable_prefix_caching: bool = True
    waiting_order: str = _SCHEDULER["waiting_order"]  # "slo": EDF + tenant fair share within a priority; "fifo" (core/waiting.py)
    report_prefix_blocks: int = 4096  # cached prefix-block keys per load report at most (prefix-aware routing)
    batching: str = "continuous"  # continuous | dynamic | static | none
    max_batch_size: int | None = None  # static/dynamic: requests per formed batch; None: min(DEFAULT_MAX_BATCH_SIZE, max_num_seqs)
    batch_window_ms: float | None = None  # dynamic: run a partial batch this long after its first request (default 10); static: optional timeout
    study_counters: bool = False  # collect the batching study's per-step counters (O(running) a step)
    seed: int | None = None  # shared generator of unseeded requests; None: from the OS (dummy weights: 0)
    adapter_dir: str | None = None  # root of the PEFT LoRA adapters (one directory each); None: base only
    max_loras: int = 4  # device adapter slots (distinct adapters in one step)
    max_cpu_loras: int = 16  # adapters kept in host memory (LRU)
    max_lora_rank: int = 16  # adapters of a higher rank are refused
    preload_adapters: tuple[str, ...] = ()  # loaded into host memory at start-up
    # "dummy": random weights from config.json alone (benchmarks); "null": no weights and a
    # near-free forward picking a fixed token pattern (model/null.py: host-path measurements)
    load_format: str = "safetensors"
    # "null" only: each step runs this long on a simulated device (its picks are ready that
    # long after the device is free; the host sleeps when it waits for them), so the host
    # path can be measured at a GPU's step rate and batch size, lockstep or overlapped
    # (0: no device time, as fast as the host goes)
    null_step_ms: float = 0.0
    decode_graphs: bool | None = None  # pad decode steps to bucket sizes (CUDA graphs); None: on for CUDA
    # Plan and launch step N+1 before reading step N's tokens back, so the GPU need not wait
    # on Python. Outputs then arrive one step later; on a CPU (no separate device to keep
    # busy) that is pure latency, so None means on for CUDA only.
    overlap_scheduling: bool | None = None
    # CPU float32 linear layers: "onednn" packs each weight once at load into oneDNN's
    # layout and multiplies with it (model/cpu_linear.py); "aten": torch's default linear
    cpu_matmul: str = "onednn"
    quantization: str = "auto"  # QUANTIZATIONS above
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES above
    # Speculative decoding (engine/omnibus/engine/spec): None never; "ngram" guesses each decode's next
    # tokens from earlier matches of its last tokens (prompt lookup), and the step scores
    # them all; kept only where the model itself picks them (the output is unchanged)
    speculative: str | None = None
    num_speculative_tokens: int = _SPEC["num_tokens"]  # guesses per sequence per step at most
    # above this many running sequences speculation turns itself off (the step is compute-bound)
    speculative_max_batch: int = _SPEC["max_batch"]
    speculative_draft_model: str | None = None  # "draft": the draft checkpoint (the same tokenizer)
    # Structured output: whitespace characters a JSON output may hold between two elements
    # at most (room to pretty-print a few levels deep; a bound on a model that would pad
    # with whitespace until max_tokens)
    structured_max_whitespace: int = 16
    # Tensor parallelism: ranks (one per device of the host, cuda:k..k+N-1; processes on the
    # CPU) that each hold 1/N of every layer (engine/omnibus/engine/parallel)
    tensor_parallel_size: int = 1
    # A host-memory tier for the prefix cache: blocks evicted from the device pool are kept
    # in this many bytes of (pinned) host memory and loaded back instead of recomputed; 0: none
    kv_offload_bytes: int = 0
    # KV that moves between engines (engine/omnibus/engine/kv_transfer): "none", or the
    # transfer engine ("mooncake") this engine reads others' KV with and offers its own
    # on; the address it is reached at (this host's, as peers see it); how long KV held
    # for a reader (a prefill for a decode engine, a drain's running requests) is kept
    kv_transfer: str = "none"
    kv_transfer_host: str = "127.0.0.1"
    kv_hold_seconds: float = 30.0
    # Host memory the transfers stage KV in (pinned): a pool the transport cannot read in
    # place (on a GPU) is copied out when held and in when read; 0: none for a host pool
    # (read in place), KV_STAGING_DEFAULT for a device pool
    kv_transfer_staging_bytes: int = 0
    # A prefill for another engine gives its handle out once seated, and readers read each
    # layer's blocks as the forward finalizes them (overlapped with the prefill), where the
    # pool is read in place by one rank; else (or off) the handle comes with its first token.
    # Off by default until it has run through the router's drain and bench-pd (docs/engine.md)
    kv_transfer_overlap: bool = False
    # What routers send it (the load report carries it): "both" whole requests; "prefill"
    # the prompt of a request a "decode" engine goes on with, reading the KV (--kv-transfer)
    role: str = "both"

    def __post_init__(self) -> None:
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", "a power of two from 1 to 128", self.block_size)
        _check(self.dtype in ("auto", *DTYPE_NAMES), "dtype", f"one of auto, {', '.join(DTYPE_NAMES)}", self.dtype)
        _check(re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None, "device", "cpu or cuda[:N]", self.device)
        _check(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1", self.max_num_batched_tokens)
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "in (0, 1]", self.gpu_memory_utilization)
        _check(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory", "> 0 bytes", self.kv_cache_memory)
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks", ">= 2", self.num_kv_blocks)
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
               ">= 2 (a prompt token and an output token)", self.max_model_len)
        _check(self.waiting_order in WAITING_ORDERS, "waiting_order", " or ".join(WAITING_ORDERS), self.waiting_order)
        _check(self.report_prefix_blocks >= 0, "report_prefix_blocks", ">= 0", self.report_prefix_blocks)
        _check(self.structured_max_whitespace >= 1, "structured_max_whitespace", ">= 1",
               self.structured_max_whitespace)
        _check(self.batching in BATCHING_POLICIES, "batching", " | ".join(BATCHING_POLICIES), self.batching)
        if self.max_batch_size is None:
            object.__setattr__(self, "max_batch_size", min(DEFAULT_MAX_BATCH_SIZE, self.max_num_seqs))
        # A formed batch runs all at once: a larger one could never start.
        _check(1 <= self.max_batch_size <= self.max_num_seqs, "max_batch_size",
               f"in [1, max_num_seqs ({self.max_num_seqs})]", self.max_batch_size)
        _check(self.load_format in LOAD_FORMATS, "load_format", " | ".join(LOAD_FORMATS), self.load_format)
        _check(self.null_step_ms >= 0, "null_step_ms", ">= 0", self.null_step_ms)
        _check(self.null_step_ms == 0 or self.load_format == "null", "null_step_ms",
               "0 unless load_format is null (a real model's steps take what they take)", self.null_step_ms)
        _check(self.max_loras >= 1, "max_loras", ">= 1", self.max_loras)
        _check(self.max_cpu_loras >= self.max_loras, "max_cpu_loras", f">= max_loras ({self.max_loras})", self.max_cpu_loras)
        _check(1 <= self.max_lora_rank <= 512, "max_lora_rank", "in [1, 512]", self.max_lora_rank)
        _check(self.cpu_matmul in CPU_MATMULS, "cpu_matmul", " or ".join(CPU_MATMULS), self.cpu_matmul)
        _check(self.quantization in QUANTIZATIONS, "quantization", " | ".join(QUANTIZATIONS), self.quantization)
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", " | ".join(KV_CACHE_DTYPES),
               self.kv_cache_dtype)
        self.spec_config()  # ValueError naming the flag
        _check(self.kv_offload_bytes >= 0, "kv_offload_bytes", ">= 0", self.kv_offload_bytes)
        _check(self.kv_transfer in KV_TRANSFERS, "kv_transfer", " | ".join(KV_TRANSFERS), self.kv_transfer)
        _check(self.kv_transfer_staging_bytes >= 0, "kv_transfer_staging_bytes", ">= 0",
               self.kv_transfer_staging_bytes)
        _check(0 < self.kv_hold_seconds < math.inf, "kv_hold_seconds", "> 0 and finite", self.kv_hold_seconds)
        _check(self.role in ROLES, "role", " | ".join(ROLES), self.role)
        _check(self.role == "both" or self.kv_transfer != "none", "role",
               "both unless --kv-transfer is set (a prefill or decode engine moves KV)", self.role)
        _check(1 <= self.tensor_parallel_size <= 64, "tensor_parallel_size", "in [1, 64]", self.tensor_parallel_size)
        _check(self.tensor_parallel_size == 1 or self.load_format != "null", "tensor_parallel_size",
               "1 with load_format null (the null model has no layers to split)", self.tensor_parallel_size)
        _check(self.batch_window_ms is None or 0 <= self.batch_window_ms < math.inf, "batch_window_ms",
               "finite and >= 0", self.batch_window_ms)
        # Named as the flags that set them, as the command line has always said them.
        if self.preload_adapters and self.adapter_dir is None:
            raise ValueError("--preload-adapters needs --adapter-dir")
        if len(set(self.preload_adapters)) > self.max_cpu_loras:
            raise ValueError(
                f"--preload-adapters lists {len(set(self.preload_adapters))} adapters but host "
                f"memory holds {self.max_cpu_loras} (--max-cpu-loras)"
            )

    def spec_config(self) -> SpecConfig:
        """How this engine speculates (method None: never); ValueError naming the flags."""
        try:
            return SpecConfig(self.speculative, self.num_speculative_tokens, self.speculative_max_batch,
                              draft_model=self.speculative_draft_model)
        except ValueError as exc:
            raise ValueError(f"--{exc}") from None

    @property
    def torch_device(self) -> torch.device:
        import torch  # here: the config itself is torch-free (the command line reads its defaults)

        return torch.device(self.device)


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
