"""The KV connector: what the scheduler asks of KV that lives on another engine.

Modelled on vLLM's KVConnector v1 (a scheduler side and a worker side) and SGLang's
disaggregation managers, for one process: the step loop's.

Scheduler side (core/lifecycle.py and core/admission.py call these, never a transport):

- `readable(seq)` (once, when the request arrives): whether the KV its `kv_source` handle
  names can be read into this engine (same pool layout, or one of another rank count
  that reshards; the handle's digest equals the request's own tokens, adapter salt and
  cache salt); if so admission reserves blocks for it and seats it LOADING;
- `start_load(seq, first_block)` / `finished()`: read the blocks past the local prefix
  hit on a worker thread (overlapped with the steps of everyone else; the transport
  releases the GIL) and report each load done or failed. A failed load is recomputed
  from the local prefix, never used. Reads are queued and begin at `launch_reads`, which
  the engine calls once the step's host-tier copies are made: a fresh block may be one
  whose old KV the tier is about to save;
- `hold(seq)`: a request that ends for a transfer (a prefill for another engine, or a
  running request of a draining engine) keeps its computed blocks, referenced, under a
  lease; its output carries the `KvHandle`;
- `hold_early(seq)` (--kv-transfer-overlap, a prefill for another engine, once seated
  with blocks for its whole prompt): the handle goes out before the prefill runs, naming
  the blocks of the prompt less its last token and per-layer progress words; the reader
  reads each layer's blocks as they become final and computes the last prompt token
  itself. A pool read in place by one rank has its words advanced by the forward, layer
  by layer (`seq.kv_progress`, worker/kv_pool.py KvMarks); a staged or sharded pool's
  advance at the end of each step (`advance`: every rank's chunk is computed then, and a
  staged hold's finished blocks are copied out first). When the prefill ends, `hold`
  keeps its blocks as any hold's; a request that ends before its prompt is computed
  (aborted, preempted, drained) is `drop`ped: its lease ends first, so a reader fails
  and recomputes;
- `release(request_id)` (the reader's router aborts the request) and `expired(now)`
  (the lease ran out: `--kv-hold-seconds`) give them back to the allocator.

Worker side: the KV pool's regions (or a staging area's, below) and a lease table are
registered with the transport.
A lease word holds the handle's epoch while its blocks are held and is zeroed before
they are released: a reader reads the word after the blocks and trusts the blocks only
if the epoch is still there (they were held, unchanged, while it read them).

Staging (shards.py `Staging`, --kv-transfer-staging-bytes): a pool the transport cannot read in
place (device memory, with a TCP transport) moves through host memory laid out as the
pool's blocks are. A hold copies its blocks out (and gives the pool's blocks back at
once: the staged copy is what is held); a read lands in staging slots and is copied into
the request's blocks on the step thread before it runs. Either side may stage or not: a
handle names blocks of registered memory of the pool's layout, wherever they are.

Tensor parallelism (shards.py): each rank holds its heads of every block at the same
block ids. This connector (rank 0's) decides for all: holds and leases are its own, a
staged hold or read is copied on every rank, a read is made by every rank from the
holder's rank of the same number, and it counts only when every rank's read did. A
handle of another rank count is read by each rank from the holder ranks that hold its
heads, through host scratch (reshard.py).
"""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import torch

from omnibus.engine.config import EngineConfig
from omnibus.engine.core.sequence import Sequence
from omnibus.engine.kv_transfer.handle import KvHandle, kv_digest
from omnibus.engine.kv_transfer.reshard import Layout, reshard_plan, reshardable
from omnibus.engine.kv_transfer.shards import LOAD_THREADS, KvShard, Progress, RankLink, staging_slots
from omnibus.engine.kv_transfer.transport import Transport

if TYPE_CHECKING:
    from omnibus.engine.parallel.ranks import Ranks

log = structlog.get_logger(__name__)

LEASE_SLOTS = 4096  # handles held at once at most (a hold past them is not offered)


@dataclass
class _Held:
    blocks: list[int]  # the pool blocks it keeps referenced, or the staging slots of its copy
    staged: bool
    slot: int  # its lease word (and its row of progress words)
    expires: float
    # an early hold whose prefill still runs: its blocks (staged: the ones its slots copy)
    # are the request's, the tokens it promises are `tokens`; a staged one's first
    # `copied` slots hold their final copy
    live: bool = False
    tokens: int = 0
    copied: int = 0


@dataclass
class _Load:
    seq: Sequence
    tokens: int  # the tokens it reads
    blocks: list[int]  # its blocks they land in
    slots: list[int]  # staging slots on the way ([] when read in place)
    ranks_left: int  # ranks whose read has not reported yet (tensor parallelism)
    ok: bool = True
    seconds: float = 0.0
    nbytes: int = 0
    own_done: bool = False
    waited: float = 0.0  # of `seconds`, waiting for the holder's progress


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
    layout: str = ""  # the pool's layout as its handles name it (a reader needs the same but for the ranks)
    sent_early: int = 0  # of `sent`, given out before their prefill ended (--kv-transfer-overlap)
    dropped: int = 0  # ... whose request ended before its prompt was computed (readers recompute)
    load_wait_seconds: float = 0.0  # of load_seconds, waiting for holders' progress


def pool_layout(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], ranks: int = 1) -> str:
    """The KV pool's layout as a handle names it: layers, one block's shape (one rank's
    heads), the dtype, and the ranks over which the heads are split."""
    k = kv_caches[0][0]
    shape = f"{len(kv_caches)}x{'x'.join(map(str, k.shape[1:]))}:{str(k.dtype).removeprefix('torch.')}"
    return shape if ranks == 1 else f"{shape}/tp{ranks}"


class KvConnector:
    """One per engine, in the step loop's process; its scheduler-side verbs run on the
    step loop's thread only."""

    def __init__(self, transport: Transport, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, hold_seconds: float, staging_bytes: int = 0, ranks: RankLink | None = None,
                 overlap: bool = False, num_kv_heads: int = 0) -> None:
        """`staging_bytes` > 0: holds and reads go through that much host memory (a pool on
        a GPU needs it: the TCP transport reads host memory only). `ranks`: the other
        ranks of a tensor-parallel engine, each given a shard of its own (staging as this
        rank's). `overlap`: prefills for other engines give their handle out early
        (`hold_early`). `num_kv_heads`: the model's, to read handles of engines of
        another rank count (0: not those)."""
        self.block_size = block_size
        self.hold_seconds = hold_seconds
        tensors = [t for layer in kv_caches for t in layer]  # K0, V0, K1, V1, ...
        slots = staging_slots(staging_bytes, tensors) if staging_bytes else 0
        self.shard = KvShard(transport, kv_caches, slots)
        self.staging = self.shard.staging
        self.block_bytes = self.shard.block_bytes
        self.ranks = ranks
        self.rank_peers: tuple[str, ...] = ()
        self.regions = self.shard.regions  # every rank's, as a handle names them
        if ranks is not None:
            others = ranks.setup(slots, num_kv_heads)
            self.rank_peers = tuple(address for address, _ in others)
            self.regions += tuple(r for _, regions in others for r in regions)
        self.layout = pool_layout(kv_caches, 1 + len(self.rank_peers))
        self.num_kv_heads = num_kv_heads
        self._lease = torch.zeros(LEASE_SLOTS, dtype=torch.int64)  # slot -> epoch while held
        transport.register(self._lease.data_ptr(), LEASE_SLOTS * 8)
        # An early hold's progress words (slot -> one per layer), written through numpy
        # views (no torch dispatch per layer): by the forward after each layer where the
        # pool is read in place by one rank, else by `advance` at the step's end.
        self.overlaps = overlap
        self.marks_layers = overlap and self.staging is None and ranks is None
        self.layers = len(kv_caches)
        self._progress = torch.zeros((LEASE_SLOTS, self.layers) if self.overlaps else (0, 0), dtype=torch.int64)
        self._progress_words = self._progress.numpy()
        if self.overlaps:
            transport.register(self._progress.data_ptr(), self._progress.numel() * 8)
        self._free_slots = list(range(LEASE_SLOTS - 1, -1, -1))
        self._epochs = itertools.count(1)
        self.held: dict[str, _Held] = {}
        self._loads: dict[int, _Load] = {}
        self._tickets = itertools.count(1)
        self._queued: list[tuple[int, KvHandle, list[int], tuple[int, ...]]] = []  # reads to begin
        self._done: queue.SimpleQueue[tuple[int, bool, float, int, float]] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="omnibus-kv")
        self._stats = dict.fromkeys(KvTransferStats.__dataclass_fields__.keys() - {"layout"}, 0)

    @property
    def transport(self) -> Transport:
        return self.shard.transport

    # ---- the sender ------------------------------------------------------------

    def hold(self, seq: Sequence) -> KvHandle | None:
        """Keeps the blocks of `seq`'s computed tokens (its last token's KV is not
        computed yet) for a reader: in place they leave `seq.block_table` referenced (the
        rest stay for the caller to free); staged, a copy is kept and every block stays
        for the caller. None when there is nothing to hold, no lease or no staging room."""
        held = self.held.get(seq.request_id)
        if held is not None and held.live:
            self._settle_early(seq, held)  # its handle went out already
            return None
        if held is not None:  # an earlier request of this id still holds its KV: one hold an id
            log.warning("kv_hold_id_held", request_id=seq.request_id)
            return None
        n = min(seq.num_computed_tokens, seq.num_tokens - 1)
        if n <= 0 or not self._free_slots:
            return None
        nb = -(-n // self.block_size)
        if self.staging is not None:
            blocks = self.staging.take(nb)
            if blocks is None:
                log.warning("kv_staging_full", request_id=seq.request_id, blocks=nb, free=self.staging.free)
                return None
            self._stage_out(seq.block_table[:nb], blocks)
        else:
            blocks, seq.block_table = seq.block_table[:nb], seq.block_table[nb:]
            seq.num_registered_blocks = 0
        slot, epoch = self._free_slots.pop(), next(self._epochs)
        self._lease[slot] = epoch
        self.held[seq.request_id] = _Held(blocks, self.staging is not None, slot,
                                          time.monotonic() + self.hold_seconds)
        self._stats["sent"] += 1
        return KvHandle(
            peer=self.transport.address, request_id=seq.request_id, num_tokens=n, blocks=tuple(blocks),
            regions=self.regions, block_bytes=self.block_bytes, layout=self.layout,
            digest=kv_digest(seq.token_ids[:n], seq.adapter_salt, seq.cache_salt),
            lease_addr=self._lease.data_ptr() + slot * 8, lease_epoch=epoch, rank_peers=self.rank_peers)

    def hold_early(self, seq: Sequence) -> KvHandle | None:
        """A handle for the KV of `seq`'s prompt less its last token, given out before its
        prefill runs (it is seated, with blocks for its whole prompt): each of its layers'
        progress words says how many of its tokens are final. None when this connector
        gives no early handles (--kv-transfer-overlap off), or there is nothing to hold,
        no lease or no staging room."""
        n = seq.num_prompt_tokens - 1
        nb = -(-n // self.block_size)
        if (not self.overlaps or n <= 0 or seq.num_output_tokens or len(seq.block_table) < nb
                or not self._free_slots or seq.request_id in self.held):
            return None
        blocks = seq.block_table[:nb]
        if self.staging is not None:  # its blocks are copied into these as they become final
            blocks = self.staging.take(nb)
            if blocks is None:
                log.warning("kv_staging_full", request_id=seq.request_id, blocks=nb, free=self.staging.free)
                return None
        slot, epoch = self._free_slots.pop(), next(self._epochs)
        self._lease[slot] = epoch
        self._progress_words[slot] = 0  # advanced past a prefix hit's blocks too: the host tier's copies land before
        if self.marks_layers:  # the forward marks them (else `advance` does)
            seq.kv_progress = self._progress_words[slot]
        self.held[seq.request_id] = _Held(blocks, self.staging is not None, slot, float("inf"), live=True, tokens=n)
        self._stats["sent"] += 1
        self._stats["sent_early"] += 1
        return KvHandle(
            peer=self.transport.address, request_id=seq.request_id, num_tokens=n, blocks=tuple(blocks),
            regions=self.regions, block_bytes=self.block_bytes, layout=self.layout,
            digest=kv_digest(seq.token_ids[:n], seq.adapter_salt, seq.cache_salt),
            lease_addr=self._lease.data_ptr() + slot * 8, lease_epoch=epoch, rank_peers=self.rank_peers,
            progress_addr=self._progress.data_ptr() + slot * self.layers * 8)

    def advance(self, scheduled: list) -> None:
        """A step's chunks (core/plan.py ScheduledSeq) are computed, on every rank: the
        early holds among them that the forward does not mark (staged or sharded pools)
        say so, a staged one's newly finished blocks copied out first (every rank's, one
        copy a step, done on return)."""
        if self.marks_layers or not self.held:
            return
        marks, pool, slots = [], [], []
        for item in scheduled:
            held = self.held.get(item.seq.request_id) if item.seq.handed_on else None
            if held is None or not held.live:
                continue
            end = min(item.start + item.num_tokens, held.tokens)
            final = len(held.blocks) if end == held.tokens else end // self.block_size  # (its blocks' tokens all are)
            if held.staged and final > held.copied:
                pool += item.seq.block_table[held.copied:final]
                slots += held.blocks[held.copied:final]
                held.copied = final
            marks.append((held.slot, end))
        if slots:
            self._stage_out(pool, slots)
        for slot, end in marks:
            self._progress_words[slot] = end

    def _stage_out(self, blocks: list[int], slots: list[int]) -> None:
        """The pool's `blocks` copied into staging `slots` on every rank, done on return."""
        if self.ranks is not None:
            self.ranks.stage_out(blocks, slots)
        self.shard.stage_out(blocks, slots)

    def _settle_early(self, seq: Sequence, held: _Held) -> None:
        """An early hold's request ends (`hold`): the blocks it promised (in place) or their
        copies (staged: its blocks stay for the caller) become the hold's, on its lease
        from now, when every layer's progress covers its tokens; else (it ends
        mid-prefill: a drain) it is dropped, and its readers recompute."""
        if int(self._progress_words[held.slot].min()) < held.tokens:
            self.drop(seq)
            return
        if not held.staged:
            nb = len(held.blocks)
            assert seq.block_table[:nb] == held.blocks, "an early hold's blocks moved under it"
            seq.block_table = seq.block_table[nb:]
            seq.num_registered_blocks = 0
        seq.kv_progress = None
        held.live, held.expires = False, time.monotonic() + self.hold_seconds

    def drop(self, seq: Sequence) -> None:
        """`seq`'s early hold ends with its prefill unfinished (aborted, preempted, ended):
        its lease ends before the request's blocks can be freed, so a reader fails and
        recomputes. Its blocks stay the request's."""
        held = self.held.get(seq.request_id)
        if held is not None and held.live:
            del self.held[seq.request_id]
            self._let_go(held)
            self._stats["dropped"] += 1
            log.info("kv_early_hold_dropped", request_id=seq.request_id,
                     computed=int(self._progress_words[held.slot].min()), promised=held.tokens)
        seq.kv_progress = None

    def release(self, request_id: str) -> list[int] | None:
        """The blocks a reader is done with (for the allocator to free), or None when
        `request_id` holds none."""
        held = self.held.get(request_id)
        if held is None or held.live:  # a live one is its request's: aborting that drops it
            return None
        del self.held[request_id]
        self._stats["released"] += 1
        return self._let_go(held)

    def expired(self, now: float) -> list[list[int]]:
        """The blocks of every hold whose lease ran out (O(held), and only while some are)."""
        if not self.held:
            return []
        gone = [rid for rid, h in self.held.items() if h.expires <= now]  # (a live one's is inf)
        for rid in gone:
            log.warning("kv_hold_expired", request_id=rid, seconds=self.hold_seconds)
        self._stats["expired"] += len(gone)
        return [self._let_go(self.held.pop(rid)) for rid in gone]

    def _let_go(self, held: _Held) -> list[int]:
        self._lease[held.slot] = 0  # before the blocks can be reused: readers see the lease end
        self._free_slots.append(held.slot)
        if held.staged and self.staging is not None:
            self.staging.give(held.blocks)
            return []
        return held.blocks

    def held_tables(self) -> Iterator[list[int]]:
        """The pool blocks held (a staged hold keeps none; a live one's are its request's)."""
        return (h.blocks for h in self.held.values() if not h.staged and not h.live)

    # ---- the reader ------------------------------------------------------------

    def readable(self, seq: Sequence) -> bool:
        """Whether `seq.kv_source` can be read here; a handle that cannot is dropped (the
        request is computed here) and counted."""
        src = seq.kv_source
        if src is None:
            return False
        why = src.problem(self.block_size)
        if why is None and src.layout != self.layout and not self._reshardable(src):
            why = f"its pool layout {src.layout} is not this engine's {self.layout}, nor one of another rank count"
        if why is None and src.layout == self.layout and (len(src.regions) != len(self.regions)
                                                          or len(src.rank_peers) != len(self.rank_peers)):
            why = "its layers or ranks differ from this engine's"
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

    def _reshardable(self, src: KvHandle) -> bool:
        """Whether `src` is a handle of another rank count this engine can read (reshard.py):
        its layout matches but for the ranks and it names every rank's regions."""
        holder, own = Layout.parse(src.layout), Layout.parse(self.layout)
        if holder is None or own is None or not self.num_kv_heads:
            return False
        tokens, heads, head_dim = holder.block
        return (reshardable(holder, own, self.num_kv_heads) and holder.ranks == 1 + len(src.rank_peers)
                and len(src.regions) == 2 * holder.layers * holder.ranks
                and src.block_bytes == tokens * heads * head_dim * self.shard.tensors[0].element_size())

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
        if self.staging is not None and src.layout == self.layout:  # (a resharded read lands in scratch)
            taken = self.staging.take(len(local))
            if taken is None:
                log.warning("kv_staging_full", request_id=seq.request_id, blocks=len(local), free=self.staging.free)
                self._loads[ticket] = _Load(seq, 0, local, [], 0)
                self._done.put((ticket, False, 0.0, 0, 0.0))
                return
            slots = taken
        self._loads[ticket] = _Load(seq, src.num_tokens - first_block * self.block_size, local, slots,
                                    len(self.rank_peers))
        self._queued.append((ticket, src, slots or local, src.blocks[first_block:nb]))

    @property
    def queued(self) -> bool:
        """Reads wait for `launch_reads`."""
        return bool(self._queued)

    def launch_reads(self) -> None:
        """Begins the queued reads on the worker threads (after the step's host-tier copies),
        and on every other rank's."""
        for ticket, src, local, remote in self._queued:
            progress = self._follow(src, len(src.blocks) - len(remote))
            if self.ranks is not None:
                self.ranks.read(ticket, src, local, remote, progress)
            self._pool.submit(self._read, ticket, src, local, remote, progress)
        self._queued = []

    def _follow(self, src: KvHandle, first_block: int) -> Progress | None:
        """How a read of `src` from `first_block` on follows its holder's progress (an
        early handle's), or None."""
        return Progress(self.block_size, first_block, self.hold_seconds) if src.progress_addr else None

    def _read(self, ticket: int, src: KvHandle, local_blocks: list[int], remote_blocks: tuple[int, ...],
              progress: Progress | None) -> None:
        start = time.perf_counter()
        k = len(self.shard.regions)
        ok, nbytes, waited = False, 0, 0.0
        try:
            if src.layout != self.layout:  # another rank count: this rank's heads from the holder ranks holding them
                parts = reshard_plan(self.num_kv_heads, 1 + len(src.rank_peers), 1 + len(self.rank_peers), 0)
                ok, nbytes, waited = self.shard.read_resharded(src, parts, local_blocks, remote_blocks, progress)
            else:
                ok, nbytes, waited = self.shard.read(src.peer, src.regions[:k], local_blocks, remote_blocks, src,
                                                     progress)
        except Exception:  # reported as a failed load: never a request left loading
            log.exception("kv_read_error", peer=src.peer)
        finally:
            self._done.put((ticket, ok, time.perf_counter() - start, nbytes, waited))

    def finished(self) -> list[tuple[Sequence, int]]:
        """The loads done since the last call (this rank's read and every other rank's):
        each request and the tokens whose KV it now holds (the handle's), 0 when a read
        failed."""
        while True:
            try:
                ticket, ok, seconds, nbytes, waited = self._done.get_nowait()
            except queue.Empty:
                break
            load = self._loads[ticket]
            load.own_done, load.ok, load.seconds, load.nbytes = True, load.ok and ok, seconds, nbytes
            load.waited = waited
        # (the other ranks are asked once this rank's own read is done: one gather a step
        # while they finish, none while the reads run)
        if self.ranks is not None and any(load.own_done and load.ranks_left for load in self._loads.values()):
            for reports in self.ranks.poll():
                for ticket, ok in reports.items():
                    load = self._loads[ticket]
                    load.ranks_left -= 1
                    load.ok = load.ok and ok
        done = []
        for ticket in [t for t, load in self._loads.items() if load.own_done and not load.ranks_left]:
            done.append(self._settle(self._loads.pop(ticket)))
        return done

    def _settle(self, load: _Load) -> tuple[Sequence, int]:
        """A read every rank has finished: staged, into the request's blocks now, before it
        runs (on every rank); counted."""
        if load.slots and self.staging is not None:
            if load.ok:
                if self.ranks is not None:
                    self.ranks.stage_in(load.slots, load.blocks)
                self.shard.stage_in(load.slots, load.blocks)
            self.staging.give(load.slots)
        src = load.seq.kv_source
        assert src is not None
        s = self._stats
        s["loads"] += 1
        s["load_seconds"] += load.seconds
        s["load_wait_seconds"] += load.waited
        if load.ok:
            s["loaded_tokens"] += load.tokens
            s["loaded_bytes"] += load.nbytes * (1 + len(self.rank_peers))
        else:
            s["load_failures"] += 1
            log.warning("kv_load_failed", request_id=load.seq.request_id, peer=src.peer)
        return load.seq, src.num_tokens if load.ok else 0

    def stats(self) -> KvTransferStats:
        return KvTransferStats(**{**self._stats, "held": len(self.held), "layout": self.layout,
                                  "held_blocks": sum(map(len, self.held_tables()))})

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)  # a read in flight writes into the pool
        self.transport.close()


def make_connector(config: EngineConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   ranks: Ranks | None = None, num_kv_heads: int = 0) -> KvConnector:
    """The engine's connector for --kv-transfer (not "none") over its KV pool (and, under
    tensor parallelism, every rank's), staged through host memory when the pool is on a
    GPU (or when asked to be); `num_kv_heads` (the model's) lets it read handles of
    engines of another rank count."""
    from omnibus.engine.config import KV_STAGING_DEFAULT
    from omnibus.engine.kv_transfer.transport import make_transport

    staging = config.kv_transfer_staging_bytes
    if not staging and kv_caches[0][0].device.type != "cpu":
        staging = KV_STAGING_DEFAULT
    link = None if ranks is None else RankLink(ranks, config.kv_transfer, config.kv_transfer_host)
    return KvConnector(make_transport(config.kv_transfer, config.kv_transfer_host), kv_caches, config.block_size,
                       config.kv_hold_seconds, staging, link, config.kv_transfer_overlap, num_kv_heads)
