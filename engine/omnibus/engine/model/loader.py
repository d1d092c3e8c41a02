"""Load a Hugging Face safetensors checkpoint into `LlamaForCausalLM`.

Accepts `model.safetensors` or sharded `model-0000x-of-0000y.safetensors` with
`model.safetensors.index.json`. Pickle checkpoints (`*.bin`, `*.pt`) are refused:
unpickling runs arbitrary code.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import structlog
import torch
from safetensors import SafetensorError, safe_open

from omnibus.common.model_files import is_gguf, open_model
from omnibus.engine.config import ModelConfig, ModelLoadError
from omnibus.engine.model.linear import Linear
from omnibus.engine.model.llama import LlamaForCausalLM
from omnibus.engine.model.quant.weights import DenseWeight, Weight, WeightFormatError
from omnibus.engine.parallel.group import SINGLE, TensorParallel
from omnibus.engine.parallel.shard import ShardPlan

# checkpoint projection -> (fused parameter, index of the slice it fills); the projections
# not here (o_proj, down_proj) are single layers (row-parallel under tensor parallelism)
FUSED_PARTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A layer's FP8 KV cache scales (compressed-tensors' kv_cache_scheme, as vLLM reads them).
_KV_SCALES = (".self_attn.k_scale", ".self_attn.v_scale")

log = structlog.get_logger(__name__)


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, or a ModelLoadError saying why not.
    A model.safetensors is read even next to an index (transformers looks for it first)."""
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [path / name for name in names]
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from exc
        for name, f in zip(names, files):
            if Path(name).is_absolute() or ".." in Path(name).parts:  # never opened
                raise ModelLoadError(
                    f"shard {name!r} listed in {index.name} points outside the model directory {path}")
            if not f.is_file():
                raise ModelLoadError(f"shard {f.name} listed in {index.name} is missing from {path}")
        return files
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise ModelLoadError(
            f"{path} holds a pickle checkpoint (*.bin/*.pt), which is refused because loading it can "
            "run arbitrary code; convert it to safetensors (e.g. save_pretrained(safe_serialization=True))"
        )
    raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {path}")


@dataclass(frozen=True)
class WeightSource:
    """Where a model's weights come from: `tensors()` yields (Hugging Face name, tensor or
    decoded weight) pairs; `quantized` says the projections bring their own storage."""

    tensors: Callable[[], Iterator[tuple[str, torch.Tensor | Weight]]]
    quantized: bool
    head_quantized: bool = False  # the file stores the LM head (or the table a tied one is) quantized


def open_weights(path: Path, cfg: ModelConfig, quantization: str = "auto") -> WeightSource:
    """A GGUF file, or a safetensors directory (decoded as config.json's quantization_config
    says). `quantization` "none" asks for every weight dequantized."""
    if is_gguf(path):
        from omnibus.engine.model.formats.gguf import gguf_head_quantized, gguf_weights

        return WeightSource(lambda: gguf_weights(path, cfg, quantization == "none"), True,
                            gguf_head_quantized(path))
    files = checkpoint_files(path)
    plain = lambda: safetensors_tensors(files)  # noqa: E731
    qconfig = _quantization_config(path)
    if qconfig is None:
        return WeightSource(plain, False)
    from omnibus.engine.model.formats import decoder_for

    decode = decoder_for(qconfig, path)
    return WeightSource(lambda: decode(plain(), qconfig, cfg), True)


def _quantization_config(path: Path) -> dict | None:
    """config.json's quantization_config, read as ModelConfig.from_dir read the file."""
    qconfig = open_model(path).config().get("quantization_config")
    if qconfig is not None and not isinstance(qconfig, dict):
        raise ModelLoadError(f"{path / 'config.json'}: quantization_config must be an object")
    return qconfig


def safetensors_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as exc:  # truncated or corrupt: name the file
            raise ModelLoadError(f"{file} is not a readable safetensors file: {exc}") from exc


def _target(name: str) -> tuple[str, int | None]:
    """Map a checkpoint tensor name to our parameter name and fused slice index."""
    name = name.removeprefix("model.")
    parts = name.split(".")
    for proj, (fused, idx) in FUSED_PARTS.items():
        if proj in parts:
            return name.replace(proj, fused), idx
    return name, None


def _checkpoint_names(param: str, loaded: set[str]) -> list[str]:
    """The checkpoint's (Hugging Face) names of a parameter's tensors not loaded: a fused
    one's missing slices (q/k/v_proj, gate/up_proj), under the checkpoint's model. prefix."""
    prefix = "" if param.startswith("lm_head.") else "model."
    slices = [(proj, idx) for proj, (fused, idx) in FUSED_PARTS.items() if f".{fused}." in f".{param}"]
    if not slices:
        return [prefix + param]
    fused = FUSED_PARTS[slices[0][0]][0]
    return [prefix + param.replace(fused, proj) for proj, idx in slices if f"{param}#{idx}" not in loaded]


def _fused_slices(model: LlamaForCausalLM, module: str) -> list[int]:
    """The row bounds of a fused layer's parts (its q, k, v or gate, up), as this model
    (this rank's shard) holds them."""
    bounds = [0]
    for n in model.get_submodule(module).parts:
        bounds.append(bounds[-1] + n)
    return bounds


def empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_len: int,
                quantized: bool = False, tp: TensorParallel = SINGLE) -> LlamaForCausalLM:
    """The model (`tp`: this rank's shard of it) with uninitialized weights, allocated once
    on `device`. `quantized`: the checkpoint brings its projections' own (smaller)
    storage, so their dense weights are never allocated."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_len, tp)
    # The rope's float32 tables were computed at construction (on the CPU): kept out of the
    # dtype cast and the empty pass below, and moved once.
    rope = model.rope
    del model.rope
    # dtype first, on meta (free): materializing in float32 and converting after would
    # transiently hold the whole model in float32 on the device (32 GB at 8B).
    model = model.to(dtype)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if quantized:
        for layer in linears:
            if layer is not model.lm_head or not cfg.tie_word_embeddings:
                layer.defer()
    # to_empty, without its empty_like of each meta tensor: that goes through torch's Python
    # decompositions, whose first use imports them (0.75 s of an engine's start).
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.rope = rope.to(device)
    for layer in linears:
        layer.home = (dtype, device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def load_model(cfg: ModelConfig, path: str | Path, dtype: torch.dtype, device: torch.device,
               max_len: int, quantization: str = "auto", tp: TensorParallel = SINGLE) -> LlamaForCausalLM:
    """Build the model (`tp`: this rank's shard) on `device` in `dtype` and fill every
    parameter from the checkpoint: a safetensors directory (full precision, or quantized
    as its config.json's quantization_config says) or a GGUF file. `quantization`:
    EngineConfig.quantization."""
    path = Path(path)
    source = open_weights(path, cfg, quantization)
    model = empty_model(cfg, dtype, device, max_len, quantized=source.quantized, tp=tp)
    load_weights(model, source.tensors(), str(path))
    finish_linears(model, quantization, source.head_quantized)
    return model


def load_weights(model: LlamaForCausalLM, tensors: Iterable[tuple[str, torch.Tensor | Weight]],
                 source: str = "state dict") -> None:
    """Fill every parameter from (HF name, tensor) pairs; refuse unknown, misshapen or missing
    ones. A projection's weight may come decoded (`quant.weights`: a quantized format's
    reader decodes its packed tensors first); everything else is a plain tensor."""
    params = dict(model.named_parameters())
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    loaded: set[str] = set()
    head = None  # a tied model's stored lm_head.weight, settled once the embeddings are in
    plan = ShardPlan(model.cfg, model.tp) if model.tp.size > 1 else None
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name.endswith(_KV_SCALES):
            _kv_scale(model, name, tensor)
            continue
        target, idx = _target(name)
        if plan is not None:  # this rank's part of it
            tensor = plan.shard(target, idx, tensor)
        module, _, suffix = target.rpartition(".")
        if model.cfg.tie_word_embeddings and target == "lm_head.weight":
            head = tensor.dequantize() if not isinstance(tensor, torch.Tensor) else tensor
        elif suffix == "weight" and module in linears:
            _load_linear(linears[module], name, tensor, idx, loaded)
        else:
            _copy(model, params, name, _plain(name, tensor), loaded)
    if head is not None:
        _tie_or_untie(model, head, loaded, source)
    expected = {n for n in params if n.rpartition(".")[0] not in linears or not n.endswith(".weight")}
    tied = model.cfg.tie_word_embeddings
    expected |= {f"{name}.weight" for name in linears if not (tied and name == "lm_head")}
    missing = [hf for name in sorted(expected - loaded) for hf in _checkpoint_names(name, loaded)]
    if missing:
        raise ModelLoadError(f"checkpoint {source} lacks weights for: {', '.join(missing[:8])}"
                             + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def _kv_scale(model: LlamaForCausalLM, name: str, tensor: torch.Tensor | Weight) -> None:
    """A layer's KV cache scale: one positive finite number, used by an FP8 cache."""
    module, _, param = _target(name)[0].rpartition(".")
    try:
        attention = model.get_submodule(module)
    except AttributeError:
        raise ModelLoadError(f"unexpected tensor {name!r} (no such attention layer)") from None
    if not isinstance(tensor, torch.Tensor) or tensor.numel() != 1:
        raise ModelLoadError(f"{name} must be one number (a per-tensor KV cache scale)")
    value = float(tensor.float().item())
    if not math.isfinite(value) or value <= 0:
        raise ModelLoadError(f"{name} must be a positive finite KV cache scale, got {value}")
    setattr(attention, param, value)


def _plain(name: str, tensor: torch.Tensor | Weight) -> torch.Tensor:
    """A non-projection tensor: embeddings and norms are used as tensors (a quantized
    embedding table is dequantized)."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.dequantize()


def _load_linear(layer: Linear, name: str, tensor: torch.Tensor | Weight, idx: int | None,
                 loaded: set[str]) -> None:
    weight = DenseWeight(tensor) if isinstance(tensor, torch.Tensor) else tensor
    module = _target(name)[0].removesuffix(".weight")
    try:
        layer.load(weight, idx or 0)
    except WeightFormatError as exc:
        raise ModelLoadError(f"shape mismatch for {name}: {exc}") from exc
    if idx is None:
        loaded.add(f"{module}.weight")
        return
    loaded.add(f"{module}.weight#{idx}")
    if layer.complete:
        loaded.add(f"{module}.weight")


def finish_linears(model: torch.nn.Module, quantization: str, head_quantized: bool = False) -> None:
    """Settle every projection's kernel once loading is done (`Linear.finish`). The LM head
    keeps its loaded form under --quantization int8/fp8/int4 (as vLLM leaves it), and a
    tied one is the embedding table. A head the file stores quantized (a GGUF's Q8_0 or
    Q6_K output or token table) and dequantized at load multiplies through INT8 per
    channel under `auto` on a CPU (a tied head through an INT8 copy of the table; the
    lookups keep the table): the head is the largest matrix a small model reads each
    step, 113 of SmolLM2-135M's 170 MB in float32."""
    cfg = model.cfg
    dtype = model.embed_tokens.weight.dtype
    device = model.embed_tokens.weight.device
    for name, layer in model.named_modules():
        if not isinstance(layer, Linear):
            continue
        if name == "lm_head":
            if cfg.tie_word_embeddings:
                continue
            mode = quantization if quantization in ("auto", "none") else "auto"
        else:
            mode = quantization
        try:
            layer.finish(mode, dtype, device)
        except WeightFormatError as exc:
            raise ModelLoadError(f"cannot serve {name} with --quantization {quantization}: {exc}") from exc
    head = model.lm_head
    if head_quantized and quantization == "auto" and device.type == "cpu" and head.kernel is None:
        head.use_int8(keep_weight=cfg.tie_word_embeddings)


def _tie_or_untie(model: LlamaForCausalLM, head: torch.Tensor, loaded: set[str], source: str) -> None:
    """A tied model's checkpoint that stores lm_head.weight, as transformers loads it: with
    no embedding table stored the head is both; equal to the table, nothing changes;
    different, the two are untied and each is used as stored (config.json is wrong)."""
    embed = model.embed_tokens.weight
    if tuple(head.shape) != tuple(embed.shape):
        raise ModelLoadError(f"shape mismatch for lm_head.weight: checkpoint has {tuple(head.shape)}, "
                             f"config.json implies {tuple(embed.shape)}")
    head = head.to(embed.device, embed.dtype)
    if "embed_tokens.weight" not in loaded:
        embed.data.copy_(head)
        loaded.add("embed_tokens.weight")
    elif not torch.equal(embed.data, head):
        log.warning("tied_lm_head_differs", checkpoint=source,
                    detail="config.json sets tie_word_embeddings but the checkpoint stores an lm_head.weight "
                           "unlike the embeddings; serving both as stored, as transformers does (set "
                           "tie_word_embeddings to false to silence this)")
        model.lm_head.weight = torch.nn.Parameter(head)


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_len: int,
                 seed: int = 0, quantization: str = "auto", tp: TensorParallel = SINGLE) -> LlamaForCausalLM:
    """Random weights created on the device (benchmarks of large shapes, no checkpoint;
    under tensor parallelism each rank draws its own shard)."""
    model = empty_model(cfg, dtype, device, max_len, tp=tp)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    finish_linears(model, quantization)
    return model


def _copy(model: LlamaForCausalLM, params: dict[str, torch.nn.Parameter], name: str,
          tensor: torch.Tensor, loaded: set[str]) -> None:
    target, idx = _target(name)
    param = params.get(target)
    if param is None:
        hint = ""
        if name.endswith(".bias") and model.cfg.model_type == "llama":
            hint = "; config.json's attention_bias / mlp_bias say whether projections have biases"
        raise ModelLoadError(f"unexpected tensor {name!r} in checkpoint (not a {model.cfg.model_type} weight{hint})")
    dest = param.data
    if idx is not None:
        bounds = _fused_slices(model, target.rpartition(".")[0])
        dest = dest[bounds[idx]:bounds[idx + 1]]
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"shape mismatch for {name}: checkpoint has {tuple(tensor.shape)}, "
            f"config.json implies {tuple(dest.shape)}"
        )
    dest.copy_(tensor)
    # A fused parameter counts as loaded once all its slices are in.
    loaded.add(f"{target}#{idx}" if idx is not None else target)
    if idx is not None:
        n = len(_fused_slices(model, target.rpartition(".")[0])) - 1
        if all(f"{target}#{i}" in loaded for i in range(n)):
            loaded.add(target)
