"""The KV connector: what the scheduler asks of KV that lives on another engine.

Modelled on vLLM's KVConnector v1 (a scheduler side and a worker side) and SGLang's
disaggregation managers, for one process: the step loop's.

Scheduler side (core/lifecycle.py and core/admission.py call these, never a transport):

- `readable(seq)` (once, when the request arrives): whether the KV its `kv_source` handle
  names can be read into this engine (same pool layout; the handle's digest equals the
  request's own tokens, adapter salt and cache salt); if so admission reserves blocks for
  it and seats it LOADING;
- `start_load(seq, first_block)` / `finished()`: read the blocks past the local prefix
  hit on a worker thread (overlapped with the steps of everyone else; the transport
  releases the GIL) and report each load done or failed. A failed load is recomputed
  from the local prefix, never used. Reads are queued and begin at `launch_reads`, which
  the engine calls once the step's host-tier copies are made: a fresh block may be one
  whose old KV the tier is about to save;
- `hold(seq)`: a request that ends for a transfer (a prefill for another engine, or a
  running request of a draining engine) keeps its computed blocks, referenced, under a
  lease; its output carries the `KvHandle`;
- `release(request_id)` (the reader's router aborts the request) and `expired(now)`
  (the lease ran out: `--kv-hold-seconds`) give them back to the allocator.

Worker side: the KV pool's regions and a lease table are registered with the transport.
A lease word holds the handle's epoch while its blocks are held and is zeroed before
they are released: a reader reads the word after the blocks and trusts the blocks only
if the epoch is still there (they were held, unchanged, while it read them).
"""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog
import torch

from omnibus.engine.config import EngineConfig
from omnibus.engine.core.sequence import Sequence
from omnibus.engine.kv_transfer.handle import KvHandle, kv_digest
from omnibus.engine.kv_transfer.transport import Transport

log = structlog.get_logger(__name__)

LEASE_SLOTS = 4096  # handles held at once at most (a hold past them is not offered)
LOAD_THREADS = 2  # concurrent reads, each reading lease words into its own probe word


@dataclass
class _Held:
    blocks: list[int]
    slot: int
    expires: float


@dataclass(frozen=True)
class KvTransferStats:
    held: int = 0  # handles held now
    held_blocks: int = 0
    sent: int = 0  # handles given out since start
    released: int = 0  # ... released by their readers
    expired: int = 0  # ... whose lease ran out first
    loads: int = 0  # reads finished since start, and the failed ones among them
    load_failures: int = 0
    loaded_tokens: int = 0  # tokens whose KV arrived (not computed here; a local prefix hit is not counted)
    loaded_bytes: int = 0
    load_seconds: float = 0.0  # summed over loads
    refused: int = 0  # kv_source handles not read (layout or digest mismatch, malformed)


def pool_layout(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """The KV pool's layout as a handle names it: layers, one block's shape, the dtype."""
    k = kv_caches[0][0]
    return f"{len(kv_caches)}x{'x'.join(map(str, k.shape[1:]))}:{str(k.dtype).removeprefix('torch.')}"


class KvConnector:
    """One per engine, in the step loop's process; its scheduler-side verbs run on the
    step loop's thread only."""

    def __init__(self, transport: Transport, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, hold_seconds: float) -> None:
        self.transport = transport
        self.block_size = block_size
        self.hold_seconds = hold_seconds
        self.layout = pool_layout(kv_caches)
        self._tensors = [t for layer in kv_caches for t in layer]  # K0, V0, K1, V1, ...
        if any(t.device.type != "cpu" for t in self._tensors):
            # The TCP transport reads host memory; device memory needs Mooncake's CUDA build
            # (RDMA) and its registration of device pointers, which has not run here.
            raise RuntimeError("--kv-transfer reads the KV pool in host memory: this engine's pool is on "
                               f"{self._tensors[0].device}; KV transfer from device memory is not supported yet")
        self.regions = tuple(t.data_ptr() for t in self._tensors)
        self.block_bytes = self._tensors[0][0].numel() * self._tensors[0].element_size()
        for t in self._tensors:
            transport.register(t.data_ptr(), t.numel() * t.element_size())
        self._lease = torch.zeros(LEASE_SLOTS, dtype=torch.int64)  # slot -> epoch while held
        self._probes = torch.zeros(LOAD_THREADS, dtype=torch.int64)  # where a read's lease word lands
        for t in (self._lease, self._probes):
            transport.register(t.data_ptr(), t.numel() * 8)
        self._free_slots = list(range(LEASE_SLOTS - 1, -1, -1))
        self._free_probes: queue.SimpleQueue[int] = queue.SimpleQueue()  # one per read running
        for probe in range(LOAD_THREADS):
            self._free_probes.put(probe)
        self._epochs = itertools.count(1)
        self.held: dict[str, _Held] = {}
        self._loads: dict[int, tuple[Sequence, int]] = {}  # ticket -> (request, tokens it reads)
        self._tickets = itertools.count(1)
        self._queued: list[tuple[int, KvHandle, list[int], tuple[int, ...]]] = []  # reads to begin
        self._done: queue.SimpleQueue[tuple[int, bool, float, int]] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="omnibus-kv")
        self._stats = dict.fromkeys(KvTransferStats.__dataclass_fields__, 0)

    # ---- the sender ------------------------------------------------------------

    def hold(self, seq: Sequence) -> KvHandle | None:
        """Keeps the blocks of `seq`'s computed tokens (its last token's KV is not
        computed yet) for a reader: they leave `seq.block_table` referenced, the rest
        stay for the caller to free. None when there is nothing to hold or no lease."""
        n = min(seq.num_computed_tokens, seq.num_tokens - 1)
        if n <= 0 or not self._free_slots or seq.request_id in self.held:
            return None
        nb = -(-n // self.block_size)
        blocks, seq.block_table = seq.block_table[:nb], seq.block_table[nb:]
        seq.num_registered_blocks = 0
        slot, epoch = self._free_slots.pop(), next(self._epochs)
        self._lease[slot] = epoch
        self.held[seq.request_id] = _Held(blocks, slot, time.monotonic() + self.hold_seconds)
        self._stats["sent"] += 1
        return KvHandle(
            peer=self.transport.address, request_id=seq.request_id, num_tokens=n, blocks=tuple(blocks),
            regions=self.regions, block_bytes=self.block_bytes, layout=self.layout,
            digest=kv_digest(seq.token_ids[:n], seq.adapter_salt, seq.cache_salt),
            lease_addr=self._lease.data_ptr() + slot * 8, lease_epoch=epoch)

    def release(self, request_id: str) -> list[int] | None:
        """The blocks a reader is done with (for the allocator to free), or None when
        `request_id` holds none."""
        held = self.held.pop(request_id, None)
        if held is None:
            return None
        self._stats["released"] += 1
        return self._let_go(held)

    def expired(self, now: float) -> list[list[int]]:
        """The blocks of every hold whose lease ran out (O(held), and only while some are)."""
        if not self.held:
            return []
        gone = [rid for rid, h in self.held.items() if h.expires <= now]
        for rid in gone:
            log.warning("kv_hold_expired", request_id=rid, seconds=self.hold_seconds)
        self._stats["expired"] += len(gone)
        return [self._let_go(self.held.pop(rid)) for rid in gone]

    def _let_go(self, held: _Held) -> list[int]:
        self._lease[held.slot] = 0  # before the blocks can be reused: readers see the lease end
        self._free_slots.append(held.slot)
        return held.blocks

    def held_tables(self) -> Iterator[list[int]]:
        return (h.blocks for h in self.held.values())

    # ---- the reader ------------------------------------------------------------

    def readable(self, seq: Sequence) -> bool:
        """Whether `seq.kv_source` can be read here; a handle that cannot is dropped (the
        request is computed here) and counted."""
        src = seq.kv_source
        if src is None:
            return False
        why = src.problem(self.block_size)
        if why is None and src.layout != self.layout:
            why = f"its pool layout {src.layout} is not this engine's {self.layout}"
        if why is None and len(src.regions) != len(self.regions):
            why = "its layers differ from this engine's"
        if why is None and (src.num_tokens >= seq.num_tokens
                            or kv_digest(seq.token_ids[:src.num_tokens], seq.adapter_salt, seq.cache_salt)
                            != src.digest):
            why = "its tokens, adapter or cache group differ from the request's"
        if why is not None:
            log.warning("kv_source_refused", request_id=seq.request_id, peer=src.peer, why=why)
            self._stats["refused"] += 1
            seq.kv_source = None
            return False
        return True

    def start_load(self, seq: Sequence, first_block: int) -> None:
        """Queues a read of the source's blocks from `first_block` on into `seq.block_table`'s
        (which holds them already), begun by `launch_reads`; `finished` reports it."""
        src = seq.kv_source
        assert src is not None
        ticket = next(self._tickets)
        nb = len(src.blocks)
        self._loads[ticket] = (seq, src.num_tokens - first_block * self.block_size)
        self._queued.append((ticket, src, seq.block_table[first_block:nb], src.blocks[first_block:nb]))

    @property
    def queued(self) -> bool:
        """Reads wait for `launch_reads`."""
        return bool(self._queued)

    def launch_reads(self) -> None:
        """Begins the queued reads on the worker threads (after the step's host-tier copies)."""
        for args in self._queued:
            self._pool.submit(self._read, *args)
        self._queued = []

    def _read(self, ticket: int, src: KvHandle, local_blocks: list[int], remote_blocks: tuple[int, ...]) -> None:
        """On a worker thread: the blocks, then the lease word (into this read's probe
        word); the read counts only if the word still holds the handle's epoch."""
        start, ok, nbytes = time.perf_counter(), False, 0
        probe = self._free_probes.get()  # never waits: one per thread
        try:
            local, remote, lengths = _ranges(local_blocks, remote_blocks, self.regions, src.regions,
                                             self.block_bytes)
            nbytes = sum(lengths)
            if self.transport.read(src.peer, local, remote, lengths):
                self._probes[probe] = 0
                addr = self._probes.data_ptr() + probe * 8
                ok = (self.transport.read(src.peer, [addr], [src.lease_addr], [8])
                      and int(self._probes[probe]) == src.lease_epoch)
        except Exception:  # a transport error is a failed load: recomputed, never used
            log.exception("kv_read_error", peer=src.peer)
        finally:
            self._free_probes.put(probe)
        self._done.put((ticket, ok, time.perf_counter() - start, nbytes if ok else 0))

    def finished(self) -> list[tuple[Sequence, int]]:
        """The loads done since the last call: each request and the tokens whose KV it
        now holds (the handle's), 0 when its read failed."""
        done = []
        s = self._stats
        while True:
            try:
                ticket, ok, seconds, nbytes = self._done.get_nowait()
            except queue.Empty:
                return done
            seq, tokens = self._loads.pop(ticket)
            src = seq.kv_source
            assert src is not None
            s["loads"] += 1
            s["load_seconds"] += seconds
            if ok:
                s["loaded_tokens"] += tokens
                s["loaded_bytes"] += nbytes
            else:
                s["load_failures"] += 1
                log.warning("kv_load_failed", request_id=seq.request_id, peer=src.peer)
            done.append((seq, src.num_tokens if ok else 0))

    @property
    def loading(self) -> int:
        return len(self._loads)

    def stats(self) -> KvTransferStats:
        return KvTransferStats(**{**self._stats, "held": len(self.held),
                                  "held_blocks": sum(len(h.blocks) for h in self.held.values())})

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)  # a read in flight writes into the pool
        self.transport.close()


def make_connector(config: EngineConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> KvConnector:
    """The engine's connector for --kv-transfer (not "none") over its KV pool."""
    from omnibus.engine.kv_transfer.transport import make_transport

    return KvConnector(make_transport(config.kv_transfer, config.kv_transfer_host), kv_caches,
                       config.block_size, config.kv_hold_seconds)


def _ranges(local_blocks: list[int], remote_blocks: tuple[int, ...], local_regions: tuple[int, ...],
            remote_regions: tuple[int, ...], block_bytes: int) -> tuple[list[int], list[int], list[int]]:
    """The byte ranges that copy each remote block into its local block in every region,
    runs of consecutive blocks on both sides merged into one range."""
    runs: list[tuple[int, int, int]] = []  # (local block, remote block, blocks)
    for lb, rb in zip(local_blocks, remote_blocks):
        if runs and runs[-1][0] + runs[-1][2] == lb and runs[-1][1] + runs[-1][2] == rb:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((lb, rb, 1))
    local, remote, lengths = [], [], []
    for lbase, rbase in zip(local_regions, remote_regions):
        for lb, rb, n in runs:
            local.append(lbase + lb * block_bytes)
            remote.append(rbase + rb * block_bytes)
            lengths.append(n * block_bytes)
    return local, remote, lengths
