"""Multi-LoRA lifecycle: the one owner of the engine's adapters.

- Tiers: adapters on disk (adapters.py) are read on a background thread into an LRU
  host tier of `max_cpu_loras` adapters, and filled from there into `max_loras` device
  slots (slots.py). The step loop never waits on the disk: it only polls.
- A slot is pinned while a running sequence uses its adapter, so it is never evicted
  under a running sequence; a request is admitted only when its adapter holds a slot
  (at most `max_loras` distinct adapters per step).
- An adapter read for a waiting request is kept in host memory until it gets a slot,
  while requests still ask for it (WANTED_S): with more adapters waiting than the host
  tier holds, reads wait for room instead of evicting each other's adapters before they
  are used (which read the same files again and again).
- Everyone else uses the verbs of `LoraManager` only: Engine (`prefetch`, `inventory`,
  `stats`), Scheduler (`gate`, `release`), ModelRunner (`batch_for`), AsyncEngine
  (`load`, `place`, `unload`, `inventory`) and the gRPC server (`ready`, `available`,
  `stats`, `config`). Every verb runs on the step thread unless its docstring says so.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from omnibus.engine.config import ModelConfig
from omnibus.engine.lora.adapters import (
    AdapterLoadError,
    AdapterSpec,
    AdapterStateError,
    AdapterWeights,
    UnknownAdapterError,
    list_adapter_names,
    load_adapter_weights,
    resolve_adapter_dir,
)
from omnibus.engine.lora.batch import LoraBatch
from omnibus.engine.lora.slots import DeviceSlots

if TYPE_CHECKING:
    from omnibus.engine.core.scheduler import ScheduledSeq

log = structlog.get_logger(__name__)

# A freshly read adapter is kept for its waiting requests while one asked for it this
# recently (a waiting request asks every step; a cancelled one stops asking).
WANTED_S = 2.0


@dataclass(frozen=True)
class LoraConfig:
    """The adapter settings of an EngineConfig, which holds their defaults and checks."""

    adapter_dir: Path
    max_loras: int  # device slots
    max_cpu_loras: int  # host LRU tier
    max_lora_rank: int


@dataclass(frozen=True, slots=True)
class Gate:
    """The admission decision for a waiting request's adapter: ready (`slot` is pinned
    for the request until `release`), wait (still loading, or every slot pinned) or
    error (`error` says why the request must end). A ready gate's `salt` is the
    fingerprint of the weights in the slot: the request's prefix-cache salt from then on
    (it was salted when it arrived; the files may have been read again since)."""

    slot: int | None = None
    error: str | None = None
    salt: str | None = None

    @property
    def state(self) -> str:
        return "ready" if self.slot is not None else "wait" if self.error is None else "error"


WAIT = Gate()


@dataclass(frozen=True)
class AdapterInventory:
    """The adapters in memory, as the step thread sees them between two steps."""

    resident: tuple[str, ...]  # in device slots, sorted
    cached: tuple[str, ...]  # in host memory (resident ones included), sorted
    running: int = 0  # distinct adapters of the running sequences (pinned slots)
    # (name, prefix-cache salt) of every adapter whose config was read, sorted: the salt
    # `prefetch` returned for its latest request (the router hashes prompts with it)
    salts: tuple[tuple[str, str], ...] = ()
    # (name, running sequences pinning its device slot) of every pinned slot, sorted
    pins: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class LoraStats:
    """Counters since start, per adapter (sorted by name; adapters never counted are absent)."""

    load_seconds: tuple[float, ...] = ()  # duration of each successful disk read
    adapter_loads: tuple[tuple[str, int], ...] = ()  # (adapter, reads from disk into host memory)
    # (adapter, tier, times it was evicted from that tier to make room for another):
    # "device", its slot refilled; "host", dropped from host memory
    adapter_evictions: tuple[tuple[str, str, int], ...] = ()

    @property
    def loads(self) -> int:
        """Adapters read from disk into host memory."""
        return sum(n for _, n in self.adapter_loads)

    @property
    def evictions(self) -> int:
        """Device slots refilled with another adapter."""
        return sum(n for _, tier, n in self.adapter_evictions if tier == "device")


class LoraManager:
    """Owns adapter names, the host tier, the device slots, pins and the load/unload
    policy. Disk reads run on a private loader thread; everything else on the step thread."""

    def __init__(self, config: LoraConfig, model_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config = config  # public, read-only: the tier sizes and rank limit
        self._model_config = model_config
        self._dtype, self._device = dtype, device
        self._slots = DeviceSlots(config.max_loras, config.max_lora_rank, model_config, dtype, device)
        self._host: OrderedDict[str, AdapterWeights] = OrderedDict()  # LRU host tier
        self._specs: dict[str, AdapterSpec] = {}
        self._salts: tuple[tuple[str, str], ...] | None = ()  # of _specs; None: to rebuild
        self._loading: dict[str, Future] = {}
        self._failed: dict[str, str] = {}  # name -> why its last read failed
        self._fresh: set[str] = set()  # in host memory, never in a slot since it was read
        self._wanted: dict[str, float] = {}  # name -> when a request last asked for it
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-loader")
        self._lock = threading.Lock()
        self._loads: dict[str, int] = {}  # adapter -> reads from disk into host memory
        self._host_evictions: dict[str, int] = {}  # adapter -> drops from host memory for another
        self._load_seconds: list[float] = []  # appended by the loader thread

    # ---- requests: Engine and Scheduler -------------------------------------

    def prefetch(self, name: str) -> str:
        """Check `name` and its adapter_config.json (no tensors are read) and start reading
        its weights in the background unless they are in memory or loading. Returns the
        adapter's fingerprint, which salts the prefix cache. Raises AdapterError,
        UnknownAdapterError, OSError.

        While the adapter is in memory (or loading) its fingerprint is the one of the files
        read: KV computed with those weights must be salted as theirs. Files rewritten on
        disk take effect once it is unloaded (or leaves host memory) and read again."""
        with self._lock:
            in_memory = name in self._host or name in self._loading
        if in_memory and name in self._specs:
            self._wanted[name] = time.monotonic()
            return self._specs[name].fingerprint
        spec = self._spec(name)
        self._wanted[name] = time.monotonic()
        self._load_async(name)
        return spec.fingerprint

    def gate(self, name: str) -> Gate:
        """Admission of a request for `name`: ready pins a device slot (filling it from
        host memory, evicting the least recently used unpinned one); `release` unpins it."""
        self._wanted[name] = time.monotonic()
        state = self._poll(name)
        if state == "loading":
            return WAIT
        if state == "failed":
            return Gate(error=str(AdapterLoadError(name, self._failed[name])))
        slot = self._acquire(name)
        return WAIT if slot is None else Gate(slot=slot, salt=self._host[name].spec.fingerprint)

    def release(self, name: str) -> None:
        """Unpin the slot a ready `gate` pinned for one request."""
        slot = self._slots.slot_of(name)
        if slot is not None:
            self._slots.unpin(slot)

    def batch_for(self, plan_items: "list[ScheduledSeq]") -> LoraBatch | None:
        """The step's adapter segments for the scheduled items (in token order), or None
        when no item uses an adapter."""
        if all(item.seq.lora_slot is None for item in plan_items):
            return None
        return LoraBatch(self._slots, [(-1 if item.seq.lora_slot is None else item.seq.lora_slot,
                                        item.num_tokens) for item in plan_items])

    # ---- the adapter RPCs: AsyncEngine and the server -------------------------

    def load(self, name: str) -> bool:
        """Start bringing `name` into memory (finish with `place`); True when its weights
        were in host memory already. Raises AdapterError, UnknownAdapterError, OSError."""
        if name in self._host:
            return True
        if name in self._loading:  # its spec is the one being read: keep its salt
            return False
        self._spec(name)  # the name and adapter_config.json, checked before any read
        self._load_async(name)
        return False

    def ready(self, name: str) -> bool:
        """Whether `name`'s weights are in host memory (a read is started if none is
        running). Raises AdapterLoadError when the read failed."""
        state = self._poll(name)
        if state == "failed":
            raise AdapterLoadError(name, self._failed[name])
        return state == "ready"

    def place(self, name: str) -> bool | None:
        """After `load`: None while the read runs; then puts `name` in a device slot and
        returns whether it got one (False: every slot is pinned by running sequences).
        Raises AdapterLoadError when the read failed."""
        if not self.ready(name):
            return None
        slot = self._acquire(name)  # evicting the least recently used unpinned slot
        if slot is None:
            return False
        self._slots.unpin(slot)  # resident, but pinned by no sequence
        return True

    def unload(self, name: str) -> bool:
        """Drop `name` from the device slots and host memory; False when it was not
        loaded. Raises AdapterError (bad name), UnknownAdapterError (neither loaded nor
        on disk), AdapterStateError (still loading, or running sequences use it)."""
        try:
            resolve_adapter_dir(self.config.adapter_dir, name)  # the name check (AdapterError)
            on_disk = True
        except UnknownAdapterError:
            on_disk = False  # a loaded adapter whose directory went away can still be unloaded
        if name in self._loading and self._settle(name) == "loading":
            raise AdapterStateError(f"adapter {name!r} is still loading; unload it once the load has ended")
        slot = self._slots.slot_of(name)
        if slot is None and name not in self._host:
            if not on_disk:
                raise UnknownAdapterError(
                    f"adapter {name!r} not found: it is neither loaded nor under the adapter root")
            self._failed.pop(name, None)
            return False
        if slot is not None:
            n = self._slots.pins[slot]
            if n:
                raise AdapterStateError(
                    f"adapter {name!r} is in use by {n} running sequence{'s' if n != 1 else ''}; "
                    "unload it when they have finished")
            self._slots.clear(slot)
        self._host.pop(name, None)
        self._fresh.discard(name)
        self._wanted.pop(name, None)
        if self._specs.pop(name, None) is not None:
            self._salts = None
        self._failed.pop(name, None)
        return True

    # ---- introspection -------------------------------------------------------

    def inventory(self) -> AdapterInventory:
        """Which adapters are in device slots and in host memory now (reads that ended
        are taken in first, whether or not a request still waits for them)."""
        for name in [n for n, fut in self._loading.items() if fut.done()]:
            self._settle(name)
        names = self._slots.names
        if self._salts is None:
            self._salts = tuple(sorted((n, spec.fingerprint) for n, spec in self._specs.items()))
        pins = tuple(sorted((n, p) for n, p in zip(names, self._slots.pins) if n is not None and p))
        return AdapterInventory(tuple(sorted(n for n in names if n is not None)), tuple(sorted(self._host)),
                                len(pins), self._salts, pins)

    def stats(self) -> LoraStats:
        """Load and eviction counters; safe from any thread (each dict is copied whole)."""
        evicted = [(n, "device", k) for n, k in dict(self._slots.evicted).items()]
        evicted += [(n, "host", k) for n, k in self._host_evictions.copy().items()]
        return LoraStats(tuple(self._load_seconds), tuple(sorted(self._loads.copy().items())),
                         tuple(sorted(evicted)))

    def available(self) -> list[str]:
        """The adapter names under the adapter root. Only lists the root: safe from any thread."""
        return list_adapter_names(self.config.adapter_dir)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- host tier -----------------------------------------------------------

    def _spec(self, name: str) -> AdapterSpec:
        spec = AdapterSpec.read(self.config.adapter_dir, name, self.config.max_lora_rank)
        old = self._specs.get(name)
        if old is None or old.fingerprint != spec.fingerprint:
            self._salts = None
        self._specs[name] = spec
        return spec

    def _load_async(self, name: str) -> None:
        """Start reading `name` from disk unless it is in memory or already loading, or
        the host tier has no room: reads under way and the adapters it may not evict
        (running or kept for waiting requests) fill it (a later poll starts it)."""
        with self._lock:
            if name in self._host or name in self._loading:
                return
            if len(self._loading) + self._held() >= self.config.max_cpu_loras:
                return
            self._failed.pop(name, None)
            spec = self._specs.get(name) or self._spec(name)
            self._loading[name] = self._pool.submit(self._read, spec)

    def _read(self, spec: AdapterSpec) -> AdapterWeights:  # the loader thread
        t0 = time.perf_counter()
        weights = load_adapter_weights(spec, self._model_config, self._dtype, self._device)
        self._load_seconds.append(time.perf_counter() - t0)
        return weights

    def _poll(self, name: str) -> str:
        """"ready", "loading" or "failed" (the reason is in `_failed`)."""
        if name in self._host:
            self._host.move_to_end(name)
            return "ready"
        if name in self._failed:
            return "failed"
        if name not in self._loading:
            try:
                self._load_async(name)
            except Exception as exc:  # noqa: BLE001 (its files went away or changed since it was
                # checked, e.g. unloaded and deleted or rewritten: its requests fail, the engine goes on)
                self._failed[name] = str(exc)
                log.warning("adapter_load_failed", adapter=name, error=str(exc))
                return "failed"
            return "loading"
        return self._settle(name)

    def _settle(self, name: str) -> str:
        """A started read's state: "loading", or once it ended, "ready" (in host memory)
        or "failed"."""
        fut = self._loading[name]
        if not fut.done():
            return "loading"
        with self._lock:
            del self._loading[name]
        exc = fut.exception()
        if exc is not None:
            self._failed[name] = str(exc)
            log.warning("adapter_load_failed", adapter=name, error=str(exc))
            return "failed"
        self._admit_host(name, fut.result())
        return "ready"

    def _held(self) -> int:
        """Host adapters a read may not evict: those of running sequences (pinned slots)
        and fresh ones kept for their waiting requests."""
        pinned = {n for n, pins in zip(self._slots.names, self._slots.pins) if pins}
        return len(pinned) + sum(map(self._kept, self._fresh))

    def _kept(self, name: str) -> bool:
        """Whether a fresh adapter is kept for its waiting requests (see WANTED_S)."""
        return name in self._fresh and time.monotonic() - self._wanted.get(name, 0.0) < WANTED_S

    def _admit_host(self, name: str, weights: AdapterWeights) -> None:
        self._host[name] = weights
        self._fresh.add(name)
        self._loads[name] = self._loads.get(name, 0) + 1
        while len(self._host) > self.config.max_cpu_loras:
            # least recently used first; never the newcomer, one in a device slot or one
            # kept for its waiting requests
            victim = next((n for n in self._host if n != name and n not in self._slots.names
                           and not self._kept(n)), None)
            if victim is None:
                break  # keep them all: reads wait for room (_load_async)
            del self._host[victim]
            self._host_evictions[victim] = self._host_evictions.get(victim, 0) + 1
            self._fresh.discard(victim)
            self._wanted.pop(victim, None)

    # ---- device slots --------------------------------------------------------

    def _acquire(self, name: str) -> int | None:
        """Pin a slot holding `name` (in host memory), filling one if needed; None when
        every slot is pinned."""
        slot = self._slots.slot_of(name)
        if slot is None:
            slot = self._slots.free_slot()
            if slot is None:
                return None
            self._slots.fill(slot, self._host[name])
            self._fresh.discard(name)
        self._slots.pin(slot)
        return slot
