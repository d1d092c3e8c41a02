"""Adapters on disk: names, the confined adapter root, adapter_config.json, weights.

An adapter is a PEFT directory directly under the adapter root, named by
`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`. Symlinks are resolved and must stay inside the
root; nothing outside it is ever opened, nor anything but regular files. Pickle weights
are refused, and so is every adapter_config.json with which PEFT computes something other
than base + scale * B @ A on every token of the selected modules.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from omnibus.common.adapters import adapter_name_error, is_adapter_name
from omnibus.engine.config import ModelConfig
from omnibus.engine.worker.transfer import pinned

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# fused module of the model -> the projections it holds, in output order
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
         "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


class AdapterError(ValueError):
    """An adapter name or adapter directory that cannot be served (INVALID_ARGUMENT)."""


class UnknownAdapterError(LookupError):
    """No adapter of that name under the adapter root (NOT_FOUND)."""


class AdapterStateError(RuntimeError):
    """An adapter cannot be loaded or unloaded in the engine's current state: its weights
    failed to load, running sequences use it, it is still loading, or the engine serves
    no adapters (FAILED_PRECONDITION)."""


class AdapterLoadError(AdapterStateError):
    """The adapter's weights failed to load; `reason` says why."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"adapter {name!r} failed to load: {reason}")
        self.name, self.reason = name, reason

    def __reduce__(self) -> tuple:  # it crosses to the server from a step-loop process
        return type(self), (self.name, self.reason)


def proj_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every LoRA-targetable projection."""
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def _real(path: Path) -> Path | None:
    """`path` with its symlinks resolved; None for a symlink loop (Python 3.11 raises
    RuntimeError on one, later versions OSError)."""
    try:
        return path.resolve()
    except (RuntimeError, OSError):
        return None


def resolve_adapter_dir(root: Path, name: str) -> Path:
    """The adapter's directory, proven to lie inside `root` (symlinks resolved)."""
    error = adapter_name_error(name)
    if error is not None:
        raise AdapterError(error)
    root, path = _real(root), _real(root / name)
    if root is None or path is None:
        raise UnknownAdapterError(f"adapter {name!r} not found (a symlink loop)")
    if path.parent != root:
        raise UnknownAdapterError(f"adapter {name!r} not found")  # a symlink leading out of the root
    if not path.is_dir():
        raise UnknownAdapterError(f"adapter {name!r} not found under the adapter root")
    return path


def _confined_file(root: Path, adapter_dir: Path, filename: str) -> Path | None:
    """The file, proven to be a regular file in the adapter's own directory (a FIFO or a
    device would block the read that follows, and with it the engine)."""
    f = adapter_dir / filename
    if not f.exists():
        return None
    real, real_root = _real(f), _real(root)
    if real is None or real_root is None:
        raise AdapterError(f"{filename} of adapter {adapter_dir.name!r} is a symlink loop")
    if real.parent != adapter_dir or not real.is_relative_to(real_root):
        raise AdapterError(f"{filename} of adapter {adapter_dir.name!r} is a link to a file outside the "
                           "adapter's own directory, which is refused")
    if not real.is_file():
        raise AdapterError(f"{filename} of adapter {adapter_dir.name!r} is not a regular file")
    return real


@dataclass(frozen=True)
class AdapterSpec:
    """What adapter_config.json promises; checked before any tensor is read."""

    name: str
    path: Path  # adapter_model.safetensors
    rank: int  # the largest of any module (r, or a larger rank_pattern value)
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    fingerprint: str  # changes when the weights or adapter_config.json do: salts the prefix cache
    # PEFT's per-module overrides: (pattern, rank) and (pattern, alpha), in file order
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    default_rank: int = 0  # r; 0: `rank`
    default_alpha: float = 0.0
    rslora: bool = False
    # which modules adapter_config.json selects (PEFT's check_target_module_exists); its
    # tensors must lie within them
    selection: "_Selection | None" = None

    def selects(self, layer: int, proj: str) -> bool:
        return self.selection is None or self.selection.selects(_module_path(layer, proj))

    def module_rank_scale(self, layer: int, proj: str) -> tuple[int, float]:
        """The rank and scale of one module, as PEFT gives them: the first rank_pattern
        (alpha_pattern) key that matches the end of the module's path, else r (lora_alpha)."""
        if not self.rank_pattern and not self.alpha_pattern:
            return self.rank, self.scale
        path = _module_path(layer, proj)
        rank = _pattern_value(self.rank_pattern, path, self.default_rank)
        alpha = _pattern_value(self.alpha_pattern, path, self.default_alpha)
        return rank, float(alpha) / (math.sqrt(rank) if self.rslora else rank)

    @classmethod
    def read(cls, root: Path, name: str, max_rank: int) -> "AdapterSpec":
        adir = resolve_adapter_dir(root, name)
        cfg_file = _confined_file(root, adir, "adapter_config.json")
        weights = _confined_file(root, adir, "adapter_model.safetensors")
        if weights is None:
            if any((adir / f).exists() for f in ("adapter_model.bin", "adapter_model.pt")):
                raise AdapterError(f"adapter {name!r} is a pickle file (adapter_model.bin), which is refused "
                                   "because loading it can run arbitrary code; save it with safetensors")
            raise AdapterError(f"adapter {name!r} has no adapter_model.safetensors")
        if cfg_file is None:
            raise AdapterError(f"adapter {name!r} has no adapter_config.json")
        try:
            raw = json.loads(cfg_file.read_text())
        except OSError as exc:
            raise AdapterError(f"adapter_config.json of {name!r} cannot be read: {exc.strerror}") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise AdapterError(f"adapter_config.json of {name!r} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise AdapterError(f"adapter_config.json of {name!r} is not a JSON object")
        cfg = cfg_file.stat()
        return cls._from_config(name, weights, raw, max_rank, f"{cfg.st_size}:{cfg.st_mtime_ns}")

    @classmethod
    def _from_config(cls, name: str, weights: Path, raw: dict, max_rank: int, cfg_version: str) -> "AdapterSpec":
        if raw.get("peft_type", "LORA") != "LORA":
            raise AdapterError(f"adapter {name!r} is {raw.get('peft_type')!r}, only LORA is supported")
        for unsupported, what in _UNSUPPORTED.items():
            if raw.get(unsupported):
                raise AdapterError(f"adapter {name!r} uses {unsupported} ({what}), which Omnibus does not serve")
        init = raw.get("init_lora_weights")
        if isinstance(init, str) and init.lower().startswith(_INITS_THAT_CHANGE_THE_BASE):
            raise AdapterError(
                f"adapter {name!r} has init_lora_weights={init!r}: loading it changes the base model's "
                "weights, which a shared base cannot do; convert it to a plain LoRA first (PEFT: "
                "save_pretrained(..., path_initial_model_for_weight_conversion=...))")
        # PEFT's defaults when the keys are absent (LoraConfig: r=8, lora_alpha=8)
        rank, alpha = raw.get("r", _PEFT_DEFAULT_R), raw.get("lora_alpha", _PEFT_DEFAULT_ALPHA)
        if not _is_rank(rank):
            raise AdapterError(f"adapter {name!r} has an invalid rank r={rank!r}")
        if not _is_alpha(alpha):
            raise AdapterError(f"adapter {name!r} has an invalid lora_alpha {alpha!r}")
        ranks = _patterns(name, raw, "rank_pattern", _is_rank, "a rank (an integer >= 1)")
        alphas = _patterns(name, raw, "alpha_pattern", _is_alpha, "an alpha (a number)")
        largest = max([rank, *(r for _, r in ranks)])
        if largest > max_rank:
            raise AdapterError(f"adapter {name!r} has rank {largest}, over this engine's --max-lora-rank {max_rank}")
        _check_targets(name, raw.get("target_modules"))
        rslora = bool(raw.get("use_rslora"))
        scale = float(alpha) / (math.sqrt(rank) if rslora else rank)
        st = weights.stat()
        fingerprint = f"{name}@{st.st_size}:{st.st_mtime_ns}+{cfg_version}"
        return cls(name, weights, largest, scale, fingerprint,
                   ranks, alphas, rank, float(alpha), rslora, _Selection.read(name, raw))


_PEFT_DEFAULT_R = _PEFT_DEFAULT_ALPHA = 8
# adapter_config.json fields that change what the adapter computes in ways this engine does not
_UNSUPPORTED = {
    "use_dora": "weight-decomposed LoRA", "modules_to_save": "fully trained copies of modules",
    "lora_bias": "a bias on lora_B", "alora_invocation_tokens": "activated LoRA, applied from its "
    "invocation tokens on", "layer_replication": "a re-ordered or repeated stack of base layers",
    "use_bdlora": "block-diagonal LoRA", "trainable_token_indices": "trained token embeddings",
    "kasa_config": "KaSA", "velora_config": "VeLoRA", "monteclora_config": "MonteCLoRA",
    "arrow_config": "Arrow routing among adapters",
}
# init_lora_weights values with which PEFT rewrites the base model's weights on load
_INITS_THAT_CHANGE_THE_BASE = ("pissa", "olora", "corda", "loftq")


def _module_path(layer: int, proj: str) -> str:
    return f"model.layers.{layer}.{'self_attn' if proj in FUSED['qkv'] + FUSED['o'] else 'mlp'}.{proj}"


@dataclass(frozen=True)
class _Selection:
    """target_modules, exclude_modules, layers_to_transform and layers_pattern, matched
    against a module path as PEFT matches them (peft.tuners.tuners_utils.
    check_target_module_exists)."""

    targets: str | tuple[str, ...]
    exclude: str | tuple[str, ...] = ()
    layers: int | tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] = ()

    @classmethod
    def read(cls, name: str, raw: dict) -> "_Selection | None":
        """None when the tensors cannot be checked against the config: no target_modules,
        or target_parameters (which adapts parameters, not modules)."""
        targets = raw.get("target_modules")
        if targets is None or raw.get("target_parameters"):
            return None
        if isinstance(targets, str) and targets.lower() == "all-linear":
            targets = PROJECTIONS
        exclude = raw.get("exclude_modules") or []
        if not isinstance(exclude, str):
            if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
                raise AdapterError(f"adapter {name!r}: exclude_modules must be a list of module names or a regex")
            exclude = tuple(exclude)
        else:
            _regex(name, "exclude_modules", exclude)
        layers = raw.get("layers_to_transform")
        if isinstance(layers, list) and all(_is_index(i) for i in layers):
            layers = tuple(layers) or None
        elif layers is not None and not _is_index(layers):
            raise AdapterError(f"adapter {name!r}: layers_to_transform must be a layer index or a list of them")
        pattern = raw.get("layers_pattern") or ()
        pattern = (pattern,) if isinstance(pattern, str) else pattern
        if not isinstance(pattern, (list, tuple)) or not all(isinstance(p, str) for p in pattern):
            raise AdapterError(f"adapter {name!r}: layers_pattern must be a name or a list of them")
        for p in pattern:
            _regex(name, "layers_pattern", p)
        # as PEFT's LoraConfig refuses them
        if isinstance(targets, str) and (raw.get("layers_to_transform") is not None or raw.get("layers_pattern") is not None):
            raise AdapterError(f"adapter {name!r}: layers_to_transform and layers_pattern cannot be used "
                               "with a target_modules regex string")
        if pattern and raw.get("layers_to_transform") is None:
            raise AdapterError(f"adapter {name!r}: layers_pattern needs layers_to_transform")
        return cls(targets if isinstance(targets, str) else tuple(targets), exclude, layers, tuple(pattern))

    def selects(self, path: str) -> bool:
        if isinstance(self.exclude, str):
            if re.fullmatch(self.exclude, path):
                return False
        elif path in self.exclude or any(path.endswith(f".{e}") for e in self.exclude):
            return False
        if isinstance(self.targets, str):
            return re.fullmatch(self.targets, path) is not None
        if path in self.targets:
            return True
        if not any(path.endswith(f".{t}") for t in self.targets):
            return False
        if self.layers is None:
            return True
        match = None
        if not self.layers_pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", path)
        for pattern in self.layers_pattern:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", path)
            if match is not None:
                break
        if match is None:
            return False
        index = int(match.group("idx"))
        return index == self.layers if isinstance(self.layers, int) else index in self.layers


def _is_index(i: object) -> bool:
    return isinstance(i, int) and not isinstance(i, bool) and i >= 0


def _regex(name: str, field: str, pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise AdapterError(f"adapter {name!r}: {field} {pattern!r} is not a valid regex: {exc}") from None


def _is_rank(r: object) -> bool:
    return isinstance(r, int) and not isinstance(r, bool) and r >= 1


def _is_alpha(a: object) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a)


def _patterns(name: str, raw: dict, field: str, valid, what: str) -> tuple[tuple[str, object], ...]:
    """rank_pattern / alpha_pattern: {module path pattern: value}, each key a regex that
    PEFT matches against the end of a module's path."""
    table = raw.get(field) or {}
    if not isinstance(table, dict):
        raise AdapterError(f"adapter {name!r}: {field} must be an object of module pattern -> value")
    for key, value in table.items():
        _regex(name, f"{field} key", key)
        if not valid(value):
            raise AdapterError(f"adapter {name!r}: {field}[{key!r}] = {value!r} is not {what}")
    return tuple(table.items())


def _pattern_value(patterns: tuple[tuple[str, object], ...], path: str, default):
    """PEFT's get_pattern_key: the first key matching a dot-separated tail of `path`."""
    for key, value in patterns:
        if re.match(rf"(.*\.)?({key})$", path):
            return value
    return default


def _check_targets(name: str, targets: object) -> None:
    """Refuses target_modules naming a module other than the 7 projections, in any form
    PEFT saves: a list of names or of module paths ("all-linear" is saved as the paths it
    found), or a regex string. Which projections of which layers an adapter adapts is read
    from its tensors, which must lie within what the config selects (_Selection)."""
    if targets is None:
        return
    if isinstance(targets, str):  # "all-linear", one name, or a regex: all compile
        _regex(name, "target_modules", targets)
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"adapter {name!r}: target_modules must be a list of module names or a regex")
    bad = sorted({t for t in targets if t.rsplit(".", 1)[-1] not in PROJECTIONS})
    if bad:
        raise AdapterError(f"adapter {name!r} targets {bad[:8]}; supported: {', '.join(PROJECTIONS)}")


@dataclass
class AdapterWeights:
    spec: AdapterSpec
    # (layer, projection) -> (A (r, in), B (out, r)), on the host (pinned when bound for CUDA);
    # r is the module's own rank (rank_pattern may give modules different ones)
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # (num_layers, len(PROJECTIONS)) float32 scale of every module (0 where none), pinned for CUDA
    scales: torch.Tensor

    @property
    def targets(self) -> frozenset[str]:
        """The projections it adapts in some layer."""
        return frozenset(proj for _, proj in self.tensors)


_KEY_RE = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


def load_adapter_weights(spec: AdapterSpec, cfg: ModelConfig, dtype: torch.dtype,
                         device: torch.device) -> AdapterWeights:
    """Read and check every tensor of an adapter (runs on the loader thread). The host
    copies are staged for `device` (pinned for CUDA), so filling a slot never blocks."""
    dims = proj_dims(cfg)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(spec.path), framework="pt", device="cpu") as f:
        for key in f.keys():
            m = _KEY_RE.fullmatch(key)
            if m is None or m.group(2) not in PROJECTIONS:
                raise AdapterError(_unexpected(spec.name, key))
            layer, proj, ab = int(m.group(1)), m.group(2), m.group(3)
            if layer >= cfg.num_layers:
                raise AdapterError(f"adapter {spec.name!r} has layer {layer}, the base model has {cfg.num_layers}")
            if not spec.selects(layer, proj):
                raise AdapterError(
                    f"adapter {spec.name!r} holds weights for {_module_path(layer, proj)}, a module its "
                    "adapter_config.json does not select (target_modules, exclude_modules, "
                    "layers_to_transform); PEFT would ignore them: remove them or correct the config")
            parts.setdefault((layer, proj), {})[ab] = f.get_tensor(key)
    tensors = {}
    scales = torch.zeros(cfg.num_layers, len(PROJECTIONS), dtype=torch.float32)
    for (layer, proj), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {spec.name!r}: layer {layer} {proj} lacks lora_{'A' if 'A' not in ab else 'B'}")
        a, b = ab["A"], ab["B"]
        in_f, out_f = dims[proj]
        rank, scales[layer, PROJECTIONS.index(proj)] = spec.module_rank_scale(layer, proj)
        if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
            raise AdapterError(
                f"adapter {spec.name!r} does not fit this base model: layer {layer} {proj} has A{tuple(a.shape)} "
                f"B{tuple(b.shape)}, expected A{(rank, in_f)} B{(out_f, rank)}")
        tensors[(layer, proj)] = (pinned(a.to(dtype), device), pinned(b.to(dtype), device))
    if not tensors:
        raise AdapterError(f"adapter {spec.name!r} holds no LoRA weights")
    return AdapterWeights(spec, tensors, pinned(scales, device))


def _unexpected(name: str, key: str) -> str:
    if key.endswith(".bias") and ".lora_" not in key:
        return (f"adapter {name!r} holds a trained base-model bias ({key!r}; bias='all' or 'lora_only' "
                "in adapter_config.json), which Omnibus does not serve: only LoRA's A and B weights")
    return (f"adapter {name!r}: unexpected tensor {key!r}; Omnibus serves plain LoRA, the lora_A and "
            f"lora_B weights of {', '.join(PROJECTIONS)}")


def list_adapter_names(root: Path) -> list[str]:
    """The adapter directories directly under `root`, sorted (lists the root only)."""
    real = _real(root)
    if real is None or not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if is_adapter_name(p.name) and (q := _real(p)) is not None and q.parent == real and p.is_dir())
