"""Multi-LoRA lifecycle: the one owner of the engine's adapters.

- Tiers: adapters on disk (adapters.py) are read on a background thread into an LRU
  host tier of `max_cpu_loras` adapters (host.py), and filled from there into `max_loras`
  device slots (slots.py). The step loop never waits on the disk: it only polls.
- A slot is pinned while a running sequence uses its adapter, so it is never evicted
  under a running sequence; a request is admitted only when its adapter holds a slot
  (at most `max_loras` distinct adapters per step).
- An adapter read for a waiting request is kept in host memory until it gets a slot,
  while requests still ask for it (host.py, WANTED_S): with more adapters waiting than
  the host tier holds, reads wait for room instead of evicting each other's adapters
  before they are used (which read the same files again and again).
- Everyone else uses the verbs of `LoraManager` only: Engine (`prefetch`, `inventory`,
  `stats`), the scheduler (`gate` from core/admission.py, `release` from
  core/lifecycle.py), ModelRunner (`batch_for`), AsyncEngine (`load`, `place`, `unload`,
  `inventory`) and the gRPC server (`ready`, `available`, `stats`, `config`). Every verb
  runs on the step thread unless its docstring says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from omnibus.engine.config import ModelConfig
from omnibus.engine.lora.adapters import (
    AdapterStateError,
    UnknownAdapterError,
    list_adapter_names,
    load_adapter_weights,
    resolve_adapter_dir,
)
from omnibus.engine.lora.batch import LoraBatch
from omnibus.engine.lora.host import HostTier
from omnibus.engine.lora.slots import DeviceSlots

if TYPE_CHECKING:
    from omnibus.engine.core.plan import ScheduledSeq
    from omnibus.engine.parallel.shard import ShardPlan


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
    """Owns adapter names, the host tier (host.py), the device slots (slots.py), pins and
    the load/unload policy. Disk reads run on the host tier's loader thread; everything
    else on the step thread."""

    def __init__(self, config: LoraConfig, model_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config = config  # public, read-only: the tier sizes and rank limit
        self._slots = DeviceSlots(config.max_loras, config.max_lora_rank, model_config, dtype, device)
        # load_adapter_weights is looked up in this module at each read (the tests slow
        # reads down by patching it here)
        self._host = HostTier(config.adapter_dir, config.max_cpu_loras, config.max_lora_rank, self._slots,
                              lambda spec: load_adapter_weights(spec, model_config, dtype, device))

    def shard_over(self, plan: "ShardPlan", mirror: Callable[[tuple], None]) -> None:
        """Tensor parallelism (the model runner, before any adapter is placed): the device
        slots hold this rank's part of each adapter, and `mirror` fills the other ranks'."""
        self._slots.shard_over(plan, mirror)

    # ---- requests: Engine and Scheduler -------------------------------------

    def prefetch(self, name: str) -> str:
        """Check `name` and its adapter_config.json (no tensors are read) and start reading
        its weights in the background unless they are in memory or loading. Returns the
        adapter's fingerprint, which salts the prefix cache. Raises AdapterError,
        UnknownAdapterError, OSError.

        While the adapter is in memory (or loading) its fingerprint is the one of the files
        read: KV computed with those weights must be salted as theirs. Files rewritten on
        disk take effect once it is unloaded (or leaves host memory) and read again."""
        return self._host.prefetch(name)

    def gate(self, name: str) -> Gate:
        """Admission of a request for `name`: ready pins a device slot (filling it from
        host memory, evicting the least recently used unpinned one); `release` unpins it."""
        host = self._host
        host.want(name)
        state = host.poll(name)
        if state == "loading":
            return WAIT
        if state == "failed":
            return Gate(error=str(host.error(name)))
        slot = self._acquire(name)
        return WAIT if slot is None else Gate(slot=slot, salt=host.weights[name].spec.fingerprint)

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
        return self._host.load(name)

    def ready(self, name: str) -> bool:
        """Whether `name`'s weights are in host memory (a read is started if none is
        running). Raises AdapterLoadError when the read failed."""
        state = self._host.poll(name)
        if state == "failed":
            raise self._host.error(name)
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
        if self._host.still_loading(name):
            raise AdapterStateError(f"adapter {name!r} is still loading; unload it once the load has ended")
        slot = self._slots.slot_of(name)
        if slot is None and name not in self._host.weights:
            if not on_disk:
                raise UnknownAdapterError(
                    f"adapter {name!r} not found: it is neither loaded nor under the adapter root")
            self._host.forget_failure(name)
            return False
        if slot is not None:
            n = self._slots.pins[slot]
            if n:
                raise AdapterStateError(
                    f"adapter {name!r} is in use by {n} running sequence{'s' if n != 1 else ''}; "
                    "unload it when they have finished")
            self._slots.clear(slot)
        self._host.drop(name)
        return True

    # ---- introspection -------------------------------------------------------

    def inventory(self) -> AdapterInventory:
        """Which adapters are in device slots and in host memory now (reads that ended
        are taken in first, whether or not a request still waits for them)."""
        self._host.settle_ended()
        names = self._slots.names
        pins = tuple(sorted((n, p) for n, p in zip(names, self._slots.pins) if n is not None and p))
        return AdapterInventory(tuple(sorted(n for n in names if n is not None)),
                                tuple(sorted(self._host.weights)), len(pins), self._host.salts(), pins)

    def stats(self) -> LoraStats:
        """Load and eviction counters; safe from any thread (each dict is copied whole)."""
        host = self._host
        evicted = [(n, "device", k) for n, k in dict(self._slots.evicted).items()]
        evicted += [(n, "host", k) for n, k in host.evictions.copy().items()]
        return LoraStats(tuple(host.load_seconds), tuple(sorted(host.loads.copy().items())),
                         tuple(sorted(evicted)))

    def available(self) -> list[str]:
        """The adapter names under the adapter root. Only lists the root: safe from any thread."""
        return list_adapter_names(self.config.adapter_dir)

    def shutdown(self) -> None:
        self._host.shutdown()

    # ---- device slots --------------------------------------------------------

    def _acquire(self, name: str) -> int | None:
        """Pin a slot holding `name` (in host memory), filling one if needed; None when
        every slot is pinned."""
        slot = self._slots.slot_of(name)
        if slot is None:
            slot = self._slots.free_slot()
            if slot is None:
                return None
            self._slots.fill(slot, self._host.weights[name])
            self._host.placed(name)
        self._slots.pin(slot)
        return slot
