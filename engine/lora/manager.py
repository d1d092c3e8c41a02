"""Multi-LoRA: PEFT adapters from a confined root, two LRU tiers, batched application.

- Names and paths: an adapter is a directory directly under the adapter root, named
  by `^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`. Symlinks are resolved and must stay inside
  the root; nothing outside it is ever opened.
- Tiers: `max_loras` device slots (stacked, zero-padded A/B tensors per layer and
  projection, preallocated) and an LRU cache of `max_cpu_loras` adapters in host
  memory. Disk loads run on a background thread; the step loop only polls.
- A slot is pinned while a running sequence uses its adapter, so it is never evicted
  under a running sequence; the scheduler admits a request only when its adapter can
  get a slot (at most `max_loras` distinct adapters per step).
- `LoraBatch` groups a step's tokens into segments by slot and adds
  `scale · (x Aᵀ) Bᵀ` per segment to each targeted projection (kernels/lora.py).
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from omnibus.common.adapters import ADAPTER_NAME_RE
from omnibus.engine.config import ModelConfig
from omnibus.engine.worker.transfer import to_device
from omnibus.kernels import lora_expand, lora_shrink

log = structlog.get_logger(__name__)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# fused module of the model -> the projections it holds, in output order
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
         "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


class AdapterError(ValueError):
    """An adapter name or adapter directory that cannot be served (INVALID_ARGUMENT)."""


class UnknownAdapterError(LookupError):
    """No adapter of that name under the adapter root (NOT_FOUND)."""


def proj_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every LoRA-targetable projection."""
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def resolve_adapter_dir(root: Path, name: str) -> Path:
    """The adapter's directory, proven to lie inside `root` (symlinks resolved)."""
    if not isinstance(name, str) or not ADAPTER_NAME_RE.fullmatch(name):
        shown = name[:40] + "..." if isinstance(name, str) and len(name) > 40 else name
        raise AdapterError(
            f"invalid adapter name {shown!r}: use 1-128 ASCII letters, digits, '.', '_' or '-', "
            "starting with a letter or digit")
    root = root.resolve()
    path = (root / name).resolve()
    if path.parent != root:
        raise UnknownAdapterError(f"adapter {name!r} not found")  # a symlink leading out of the root
    if not path.is_dir():
        raise UnknownAdapterError(f"adapter {name!r} not found under the adapter root")
    return path


def _confined_file(root: Path, adapter_dir: Path, filename: str) -> Path | None:
    f = adapter_dir / filename
    if not f.exists():
        return None
    real = f.resolve()
    if real.parent != adapter_dir or not real.is_relative_to(root.resolve()):
        raise AdapterError(f"{filename} of adapter {adapter_dir.name!r} points outside the adapter root")
    return real


@dataclass(frozen=True)
class AdapterSpec:
    """What adapter_config.json promises; checked before any tensor is read."""

    name: str
    path: Path  # adapter_model.safetensors
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    targets: frozenset[str]
    fingerprint: str  # changes when the file does: salts the prefix cache

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
        return cls._from_config(name, weights, raw, max_rank)

    @classmethod
    def _from_config(cls, name: str, weights: Path, raw: dict, max_rank: int) -> "AdapterSpec":
        if raw.get("peft_type", "LORA") != "LORA":
            raise AdapterError(f"adapter {name!r} is {raw.get('peft_type')!r}, only LORA is supported")
        for unsupported in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "lora_bias"):
            if raw.get(unsupported):
                raise AdapterError(f"adapter {name!r} uses {unsupported}, which is not supported")
        rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise AdapterError(f"adapter {name!r} has an invalid rank r={rank!r}")
        if rank > max_rank:
            raise AdapterError(f"adapter {name!r} has rank {rank}, over this engine's --max-lora-rank {max_rank}")
        targets = raw.get("target_modules") or []
        if isinstance(targets, str):
            targets = [targets]
        bad = sorted(set(targets) - set(PROJECTIONS))
        if bad:
            raise AdapterError(f"adapter {name!r} targets {bad}; supported: {', '.join(PROJECTIONS)}")
        scale = float(alpha) / (math.sqrt(rank) if raw.get("use_rslora") else rank)
        st = weights.stat()
        return cls(name, weights, rank, scale, frozenset(targets), f"{name}@{st.st_size}:{st.st_mtime_ns}")


@dataclass
class AdapterWeights:
    spec: AdapterSpec
    # (layer, projection) -> (A (r, in), B (out, r)), on the host
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


_KEY_RE = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


def load_adapter_weights(spec: AdapterSpec, cfg: ModelConfig, dtype: torch.dtype) -> AdapterWeights:
    """Read and check every tensor of an adapter (runs on the loader thread)."""
    dims = proj_dims(cfg)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(spec.path), framework="pt", device="cpu") as f:
        for key in f.keys():
            m = _KEY_RE.fullmatch(key)
            if m is None or m.group(2) not in PROJECTIONS:
                raise AdapterError(f"adapter {spec.name!r}: unexpected tensor {key!r}")
            layer, proj, ab = int(m.group(1)), m.group(2), m.group(3)
            if layer >= cfg.num_layers:
                raise AdapterError(f"adapter {spec.name!r} has layer {layer}, the base model has {cfg.num_layers}")
            parts.setdefault((layer, proj), {})[ab] = f.get_tensor(key)
    tensors = {}
    for (layer, proj), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {spec.name!r}: layer {layer} {proj} lacks lora_{'A' if 'A' not in ab else 'B'}")
        a, b = ab["A"], ab["B"]
        in_f, out_f = dims[proj]
        if tuple(a.shape) != (spec.rank, in_f) or tuple(b.shape) != (out_f, spec.rank):
            raise AdapterError(
                f"adapter {spec.name!r} does not fit this base model: layer {layer} {proj} has A{tuple(a.shape)} "
                f"B{tuple(b.shape)}, expected A{(spec.rank, in_f)} B{(out_f, spec.rank)}")
        tensors[(layer, proj)] = (a.to(dtype), b.to(dtype))
    if not tensors:
        raise AdapterError(f"adapter {spec.name!r} holds no LoRA weights")
    return AdapterWeights(spec, tensors)


@dataclass(frozen=True)
class LoraConfig:
    adapter_dir: Path
    max_loras: int = 4  # device slots
    max_cpu_loras: int = 16  # host LRU tier
    max_lora_rank: int = 16


class LoraManager:
    """Owns the adapter tiers and the stacked device tensors. Used by the step thread,
    except `load_async`, whose disk reads run on a private loader thread."""

    def __init__(self, config: LoraConfig, model_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config = config
        self.model_config = model_config
        self.dtype, self.device = dtype, device
        dims = proj_dims(model_config)
        n, r = config.max_loras, config.max_lora_rank
        # stacked[layer][proj] = (A (slots, r, in), B (slots, out, r)); zeros where unused
        self.stacked = [
            {p: (torch.zeros(n, r, dims[p][0], dtype=dtype, device=device),
                 torch.zeros(n, dims[p][1], r, dtype=dtype, device=device)) for p in PROJECTIONS}
            for _ in range(model_config.num_layers)
        ]
        self.scales = torch.zeros(n, dtype=torch.float32, device=device)
        # fused module -> (projection, first column, end column) inside its output
        self.columns: dict[str, list[tuple[str, int, int]]] = {}
        for fused, projs in FUSED.items():
            lo, cols = 0, []
            for p in projs:
                cols.append((p, lo, lo + dims[p][1]))
                lo += dims[p][1]
            self.columns[fused] = cols
        self.slot_names: list[str | None] = [None] * n
        self.slot_targets: list[frozenset[str]] = [frozenset()] * n  # projections each slot's adapter adapts
        self.slot_lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(n))
        self.pins = [0] * n  # running sequences using each slot
        self.host: OrderedDict[str, AdapterWeights] = OrderedDict()  # LRU host tier
        self.specs: dict[str, AdapterSpec] = {}
        self._loading: dict[str, Future] = {}
        self.failed: dict[str, str] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-loader")
        self._lock = threading.Lock()
        self.stats = {"loads": 0, "evictions": 0, "load_seconds": []}

    # ---- names ---------------------------------------------------------------

    def spec(self, name: str) -> AdapterSpec:
        """Validate a name and its adapter_config.json (cheap; no tensors are read)."""
        spec = AdapterSpec.read(self.config.adapter_dir, name, self.config.max_lora_rank)
        self.specs[name] = spec
        return spec

    def available(self) -> list[str]:
        root = self.config.adapter_dir
        if not root.is_dir():
            return []
        return sorted(p.name for p in root.iterdir()
                      if ADAPTER_NAME_RE.fullmatch(p.name) and p.resolve().parent == root.resolve() and p.is_dir())

    def resident(self) -> list[str]:
        return [n for n in self.slot_names if n is not None]

    # ---- host tier -----------------------------------------------------------

    def load_async(self, name: str) -> None:
        """Start reading `name` from disk unless it is in memory or already loading."""
        with self._lock:
            if name in self.host or name in self._loading:
                return
            self.failed.pop(name, None)
            spec = self.specs.get(name) or self.spec(name)
            self._loading[name] = self._pool.submit(self._load, spec)

    def _load(self, spec: AdapterSpec) -> AdapterWeights:
        t0 = time.perf_counter()
        weights = load_adapter_weights(spec, self.model_config, self.dtype)
        self.stats["load_seconds"].append(time.perf_counter() - t0)
        return weights

    def is_loading(self, name: str) -> bool:
        return name in self._loading

    def poll(self, name: str) -> str:
        """"ready", "loading" or "failed" (the reason is in `failed`). Step thread only."""
        if name in self.host:
            self.host.move_to_end(name)
            return "ready"
        if name in self.failed:
            return "failed"
        fut = self._loading.get(name)
        if fut is None:
            self.load_async(name)
            return "loading"
        if not fut.done():
            return "loading"
        with self._lock:
            del self._loading[name]
        exc = fut.exception()
        if exc is not None:
            self.failed[name] = str(exc)
            log.warning("adapter_load_failed", adapter=name, error=str(exc))
            return "failed"
        self._admit_host(name, fut.result())
        return "ready"

    def _admit_host(self, name: str, weights: AdapterWeights) -> None:
        self.host[name] = weights
        self.stats["loads"] += 1
        while len(self.host) > self.config.max_cpu_loras:
            # least recently used first; never the newcomer, never one in a device slot
            victim = next((n for n in self.host if n != name and n not in self.slot_names), None)
            if victim is None:
                break  # every host adapter is on the device; keep them
            del self.host[victim]

    # ---- device slots --------------------------------------------------------

    def slot_of(self, name: str) -> int | None:
        try:
            return self.slot_names.index(name)
        except ValueError:
            return None

    def acquire(self, name: str) -> int | None:
        """Pin a device slot holding `name` (loading it from the host tier, evicting the
        least recently used unpinned slot). None when every slot is pinned."""
        slot = self.slot_of(name)
        if slot is None:
            free = [s for s in self.slot_lru if self.pins[s] == 0]
            # an empty slot first, else the least recently used unpinned one
            slot = next((s for s in free if self.slot_names[s] is None), free[0] if free else None)
            if slot is None:
                return None
            self._fill_slot(slot, self.host[name])
        self.pins[slot] += 1
        self.slot_lru.move_to_end(slot)
        return slot

    def release(self, name: str) -> None:
        slot = self.slot_of(name)
        if slot is not None and self.pins[slot] > 0:
            self.pins[slot] -= 1

    def _fill_slot(self, slot: int, weights: AdapterWeights) -> None:
        if self.slot_names[slot] is not None:
            self.stats["evictions"] += 1
        for layer in self.stacked:
            for a, b in layer.values():
                a[slot].zero_()
                b[slot].zero_()
        for (layer, proj), (a, b) in weights.tensors.items():
            sa, sb = self.stacked[layer][proj]
            sa[slot, : a.shape[0]].copy_(a)
            sb[slot, :, : b.shape[1]].copy_(b)
        self.scales[slot] = weights.spec.scale
        self.slot_names[slot] = weights.spec.name
        self.slot_targets[slot] = weights.spec.targets

    def unload(self, name: str) -> bool:
        """Drop `name` from both tiers unless a running sequence uses it."""
        slot = self.slot_of(name)
        if slot is not None:
            if self.pins[slot]:
                return False
            self.slot_names[slot] = None
            self.slot_targets[slot] = frozenset()
            self.scales[slot] = 0.0
        self.host.pop(name, None)
        self.specs.pop(name, None)
        return True

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class LoraBatch:
    """A step's adapter segments: tokens [starts[s], starts[s+1]) use slot slots[s]
    (-1: base model only)."""

    def __init__(self, manager: LoraManager, runs: list[tuple[int, int]]) -> None:
        """`runs`: (slot, number of tokens) of each scheduled sequence, in token order."""
        self.manager = manager
        starts, slots = [0], []
        for slot, n in runs:
            if slots and slot == slots[-1]:
                starts[-1] += n  # same adapter as the previous sequence: one segment
            else:
                slots.append(slot)
                starts.append(starts[-1] + n)
        dev = manager.device
        self.seg_starts = to_device(starts, torch.int32, dev)
        self.seg_slots = to_device(slots, torch.int32, dev)
        # Only projections some adapter in this batch targets cost anything.
        active = frozenset().union(*(manager.slot_targets[s] for s in set(slots) if s >= 0))
        self.columns = {fused: [c for c in cols if c[0] in active] for fused, cols in manager.columns.items()}

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, fused: str) -> None:
        """out (T, out_fused) += LoRA delta of every projection in `fused`, per segment."""
        stacked = self.manager.stacked[layer]
        for proj, lo, hi in self.columns[fused]:
            a, b = stacked[proj]
            y = lora_shrink(x, a, self.seg_starts, self.seg_slots)  # (T, r) float32
            lora_expand(y, b, self.seg_starts, self.seg_slots, self.manager.scales, out[:, lo:hi])
