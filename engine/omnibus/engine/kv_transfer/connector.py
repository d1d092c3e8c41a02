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

Worker side: the KV pool's regions (or a staging area's, below) and a lease table are
registered with the transport.
A lease word holds the handle's epoch while its blocks are held and is zeroed before
they are released: a reader reads the word after the blocks and trusts the blocks only
if the epoch is still there (they were held, unchanged, while it read them).

Staging (`_Staging`, --kv-transfer-staging-bytes): a pool the transport cannot read in
place (device memory, with a TCP transport) moves through host memory laid out as the
pool's blocks are. A hold copies its blocks out (and gives the pool's blocks back at
once: the staged copy is what is held); a read lands in staging slots and is copied into
the request's blocks on the step thread before it runs. Either side may stage or not: a
handle names blocks of registered memory of the pool's layout, wherever they are.
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
    blocks: list[int]  # pool blocks it keeps referenced ([] when staged)
    slot: int
    expires: float
    staged: list[int]  # staging slots holding its copy ([] when read in place)


class _Staging:
    """Host memory shaped as `slots` blocks of every K and V tensor of the pool (pinned
    when the pool is on a GPU), the slots handed out by a free list. Step thread only,
    except the bytes a read's worker thread writes into slots it was given."""

    def __init__(self, tensors: list[torch.Tensor], slots: int) -> None:
        pin = tensors[0].device.type == "cuda"
        self.tensors = [torch.empty((slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in tensors]
        self._free = list(range(slots - 1, -1, -1))

    def take(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        taken, self._free = self._free[len(self._free) - n:], self._free[:len(self._free) - n]
        return taken

    def give(self, slots: list[int]) -> None:
        self._free += slots

    @property
    def free(self) -> int:
        return len(self._free)

    def copy_out(self, pool: list[torch.Tensor], blocks: list[int], slots: list[int]) -> None:
        """The pool's `blocks` into `slots` (synchronously: the copy is whole on return)."""
        src, dst = torch.tensor(blocks, device=pool[0].device), torch.tensor(slots)
        for p, t in zip(pool, self.tensors):
            t.index_copy_(0, dst, p.index_select(0, src).cpu())

    def copy_in(self, pool: list[torch.Tensor], slots: list[int], blocks: list[int]) -> None:
        """`slots` into the pool's `blocks`; the slots are free to reuse on return."""
        src, dst = torch.tensor(slots), torch.tensor(blocks, device=pool[0].device)
        for p, t in zip(pool, self.tensors):
            p.index_copy_(0, dst, t.index_select(0, src).to(p.device))


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
                 block_size: int, hold_seconds: float, staging_bytes: int = 0) -> None:
        """`staging_bytes` > 0: holds and reads go through that much host memory (a pool on
        a GPU needs it: the TCP transport reads host memory only)."""
        self.transport = transport
        self.block_size = block_size
        self.hold_seconds = hold_seconds
        self.layout = pool_layout(kv_caches)
        self._tensors = [t for layer in kv_caches for t in layer]  # K0, V0, K1, V1, ...
        self.block_bytes = self._tensors[0][0].numel() * self._tensors[0].element_size()
        self._staging: _Staging | None = None
        if staging_bytes:
            slots = staging_bytes // (self.block_bytes * len(self._tensors))
            if slots < 1:
                raise ValueError(f"--kv-transfer-staging-bytes {staging_bytes} holds no block of this pool "
                                 f"({self.block_bytes * len(self._tensors)} bytes a block over its layers)")
            self._staging = _Staging(self._tensors, slots)
        elif any(t.device.type != "cpu" for t in self._tensors):
            raise ValueError("--kv-transfer reads a pool in device memory through host staging: "
                             "--kv-transfer-staging-bytes must be > 0")
        shown = self._staging.tensors if self._staging is not None else self._tensors
        self.regions = tuple(t.data_ptr() for t in shown)
        for t in shown:
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
        # ticket -> (request, tokens it reads, its blocks they land in, staging slots on the way)
        self._loads: dict[int, tuple[Sequence, int, list[int], list[int]]] = {}
        self._tickets = itertools.count(1)
        self._queued: list[tuple[int, KvHandle, list[int], tuple[int, ...]]] = []  # reads to begin
        self._done: queue.SimpleQueue[tuple[int, bool, float, int]] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="omnibus-kv")
        self._stats = dict.fromkeys(KvTransferStats.__dataclass_fields__, 0)

    # ---- the sender ------------------------------------------------------------

    def hold(self, seq: Sequence) -> KvHandle | None:
        """Keeps the blocks of `seq`'s computed tokens (its last token's KV is not
        computed yet) for a reader: in place they leave `seq.block_table` referenced (the
        rest stay for the caller to free); staged, a copy is kept and every block stays
        for the caller. None when there is nothing to hold, no lease or no staging room."""
        n = min(seq.num_computed_tokens, seq.num_tokens - 1)
        if n <= 0 or not self._free_slots or seq.request_id in self.held:
            return None
        nb = -(-n // self.block_size)
        staged: list[int] = []
        if self._staging is not None:
            taken = self._staging.take(nb)
            if taken is None:
                log.warning("kv_staging_full", request_id=seq.request_id, blocks=nb, free=self._staging.free)
                return None
            staged = taken
            self._staging.copy_out(self._tensors, seq.block_table[:nb], staged)
            blocks, offered = [], staged
        else:
            blocks, seq.block_table = seq.block_table[:nb], seq.block_table[nb:]
            seq.num_registered_blocks = 0
            offered = blocks
        slot, epoch = self._free_slots.pop(), next(self._epochs)
        self._lease[slot] = epoch
        self.held[seq.request_id] = _Held(blocks, slot, time.monotonic() + self.hold_seconds, staged)
        self._stats["sent"] += 1
        return KvHandle(
            peer=self.transport.address, request_id=seq.request_id, num_tokens=n, blocks=tuple(offered),
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
        if held.staged and self._staging is not None:
            self._staging.give(held.staged)
        return held.blocks

    def held_tables(self) -> Iterator[list[int]]:
        return (h.blocks for h in self.held.values() if h.blocks)

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
        (which holds them already; staged, into staging slots first), begun by
        `launch_reads`; `finished` reports it (failed at once when staging has no room)."""
        src = seq.kv_source
        assert src is not None
        ticket = next(self._tickets)
        nb = len(src.blocks)
        local = seq.block_table[first_block:nb]
        slots: list[int] = []
        if self._staging is not None:
            taken = self._staging.take(len(local))
            if taken is None:
                log.warning("kv_staging_full", request_id=seq.request_id, blocks=len(local), free=self._staging.free)
                self._loads[ticket] = (seq, 0, local, [])
                self._done.put((ticket, False, 0.0, 0))
                return
            slots = taken
        self._loads[ticket] = (seq, src.num_tokens - first_block * self.block_size, local, slots)
        self._queued.append((ticket, src, slots or local, src.blocks[first_block:nb]))

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
            seq, tokens, blocks, slots = self._loads.pop(ticket)
            staging = self._staging
            if slots and staging is not None:  # staged: into the request's blocks now, before it runs
                if ok:
                    staging.copy_in(self._tensors, slots, blocks)
                staging.give(slots)
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
    """The engine's connector for --kv-transfer (not "none") over its KV pool, staged
    through host memory when the pool is on a GPU (or when asked to be)."""
    from omnibus.engine.config import KV_STAGING_DEFAULT
    from omnibus.engine.kv_transfer.transport import make_transport

    staging = config.kv_transfer_staging_bytes
    if not staging and kv_caches[0][0].device.type != "cpu":
        staging = KV_STAGING_DEFAULT
    return KvConnector(make_transport(config.kv_transfer, config.kv_transfer_host), kv_caches,
                       config.block_size, config.kv_hold_seconds, staging)


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
