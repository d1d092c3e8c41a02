"""The host tier: adapters read from disk on a private loader thread into an LRU of
`capacity` adapters in host memory, from which the manager fills device slots. The step
thread never waits on the disk: it only polls.

An adapter read for a waiting request is kept in host memory until it gets a slot, while
requests still ask for it (WANTED_S): with more adapters waiting than the tier holds,
reads wait for room instead of evicting each other's adapters before they are used
(which read the same files again and again).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import structlog

from omnibus.engine.lora.adapters import AdapterLoadError, AdapterSpec, AdapterWeights
from omnibus.engine.lora.slots import DeviceSlots

log = structlog.get_logger(__name__)

# A freshly read adapter is kept for its waiting requests while one asked for it this
# recently (a waiting request asks every step; a cancelled one stops asking).
WANTED_S = 2.0


class HostTier:
    """Adapter configs (and the salts they give), weights in host memory, reads under way
    and reads that failed. Step thread only, but for `_read` (the loader thread) and the
    counters, which `LoraManager.stats` copies whole."""

    def __init__(self, adapter_dir: Path, capacity: int, max_rank: int, slots: DeviceSlots,
                 read: Callable[[AdapterSpec], AdapterWeights]) -> None:
        self._adapter_dir, self._capacity, self._max_rank = adapter_dir, capacity, max_rank
        self._slots = slots  # read only: which adapters hold a device slot, and the pins
        self._load = read  # an adapter's weights from its files (the loader thread)
        self.weights: OrderedDict[str, AdapterWeights] = OrderedDict()  # the LRU tier
        self._specs: dict[str, AdapterSpec] = {}
        self._salts: tuple[tuple[str, str], ...] | None = ()  # of _specs; None: to rebuild
        self._loading: dict[str, Future[AdapterWeights]] = {}
        self._failed: dict[str, str] = {}  # name -> why its last read failed
        self._fresh: set[str] = set()  # in host memory, never in a slot since it was read
        self._wanted: dict[str, float] = {}  # name -> when a request last asked for it
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-loader")
        self._lock = threading.Lock()
        self.loads: dict[str, int] = {}  # adapter -> reads from disk into host memory
        self.evictions: dict[str, int] = {}  # adapter -> drops from host memory for another
        self.load_seconds: list[float] = []  # appended by the loader thread

    # ---- the manager's verbs ---------------------------------------------------

    def prefetch(self, name: str) -> str:
        """`LoraManager.prefetch`: the adapter's fingerprint; its read started unless it
        is in memory or loading."""
        with self._lock:
            in_memory = name in self.weights or name in self._loading
        if in_memory and name in self._specs:
            self._wanted[name] = time.monotonic()
            return self._specs[name].fingerprint
        spec = self._spec(name)
        self._wanted[name] = time.monotonic()
        self._load_async(name)
        return spec.fingerprint

    def load(self, name: str) -> bool:
        """`LoraManager.load`: True when its weights were in host memory already."""
        if name in self.weights:
            return True
        if name in self._loading:  # its spec is the one being read: keep its salt
            return False
        self._spec(name)  # the name and adapter_config.json, checked before any read
        self._load_async(name)
        return False

    def want(self, name: str) -> None:
        """A waiting request asks for `name` (see WANTED_S)."""
        self._wanted[name] = time.monotonic()

    def poll(self, name: str) -> str:
        """"ready" (in host memory, now its most recently used), "loading" (a read is
        started if none runs) or "failed" (`error` says why)."""
        if name in self.weights:
            self.weights.move_to_end(name)
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

    def error(self, name: str) -> AdapterLoadError:
        """Why the last read of `name` failed."""
        return AdapterLoadError(name, self._failed[name])

    def still_loading(self, name: str) -> bool:
        """Whether a read of `name` runs (one that ended is taken in)."""
        return name in self._loading and self._settle(name) == "loading"

    def settle_ended(self) -> None:
        """Takes in every read that ended, whether or not a request still waits for it."""
        for name in [n for n, fut in self._loading.items() if fut.done()]:
            self._settle(name)

    def placed(self, name: str) -> None:
        """`name` was filled into a device slot: no longer kept for its waiting requests."""
        self._fresh.discard(name)

    def drop(self, name: str) -> None:
        """Unloaded: out of host memory, its config and its failure forgotten."""
        self.weights.pop(name, None)
        self._fresh.discard(name)
        self._wanted.pop(name, None)
        if self._specs.pop(name, None) is not None:
            self._salts = None
        self._failed.pop(name, None)

    def forget_failure(self, name: str) -> None:
        self._failed.pop(name, None)

    def salts(self) -> tuple[tuple[str, str], ...]:
        """(name, fingerprint) of every adapter whose config was read, sorted."""
        if self._salts is None:
            self._salts = tuple(sorted((n, spec.fingerprint) for n, spec in self._specs.items()))
        return self._salts

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- reads -----------------------------------------------------------------

    def _spec(self, name: str) -> AdapterSpec:
        spec = AdapterSpec.read(self._adapter_dir, name, self._max_rank)
        old = self._specs.get(name)
        if old is None or old.fingerprint != spec.fingerprint:
            self._salts = None
        self._specs[name] = spec
        return spec

    def _load_async(self, name: str) -> None:
        """Start reading `name` from disk unless it is in memory or already loading, or
        the tier has no room: reads under way and the adapters it may not evict (running
        or kept for waiting requests) fill it (a later poll starts it)."""
        with self._lock:
            if name in self.weights or name in self._loading:
                return
            if len(self._loading) + self._held() >= self._capacity:
                return
            self._failed.pop(name, None)
            spec = self._specs.get(name) or self._spec(name)
            self._loading[name] = self._pool.submit(self._read, spec)

    def _read(self, spec: AdapterSpec) -> AdapterWeights:  # the loader thread
        t0 = time.perf_counter()
        weights = self._load(spec)
        self.load_seconds.append(time.perf_counter() - t0)
        return weights

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
        self._insert(name, fut.result())
        return "ready"

    # ---- room ------------------------------------------------------------------

    def _held(self) -> int:
        """Host adapters a read may not evict: those of running sequences (pinned slots)
        and fresh ones kept for their waiting requests."""
        pinned = {n for n, pins in zip(self._slots.names, self._slots.pins) if pins}
        return len(pinned) + sum(map(self._kept, self._fresh))

    def _kept(self, name: str) -> bool:
        """Whether a fresh adapter is kept for its waiting requests (see WANTED_S)."""
        return name in self._fresh and time.monotonic() - self._wanted.get(name, 0.0) < WANTED_S

    def _insert(self, name: str, weights: AdapterWeights) -> None:
        self.weights[name] = weights
        self._fresh.add(name)
        self.loads[name] = self.loads.get(name, 0) + 1
        while len(self.weights) > self._capacity:
            # least recently used first; never the newcomer, one in a device slot or one
            # kept for its waiting requests
            victim = next((n for n in self.weights if n != name and n not in self._slots.names
                           and not self._kept(n)), None)
            if victim is None:
                break  # keep them all: reads wait for room (_load_async)
            del self.weights[victim]
            self.evictions[victim] = self.evictions.get(victim, 0) + 1
            self._fresh.discard(victim)
            self._wanted.pop(victim, None)
