"""One rank's KV memory as the transport sees it, and the ranks of a tensor-parallel engine.

`KvShard` is what every rank registers and reads with: its pool's K and V tensors (or a
staging area shaped as them, `Staging`), probe words for lease checks, and `read`, which
copies a peer's blocks into its own and then checks the holder's lease word. An engine
of one rank has one shard, in its connector (connector.py). Under tensor parallelism
each rank holds its heads of every block, at the same block ids: rank 0's connector
decides (holds, leases, loads) and `RankLink` sends each decision to ranks 1..N-1, whose
`RankKv` acts on it with its own shard and transport and reports its reads back. A
handle then names every rank's peer and regions; rank r reads from the holder's rank r.
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
import torch

from omnibus.engine.kv_transfer.reshard import Part, reshard_plan
from omnibus.engine.kv_transfer.transport import Transport

if TYPE_CHECKING:
    from omnibus.engine.kv_transfer.handle import KvHandle
    from omnibus.engine.parallel.ranks import Ranks

log = structlog.get_logger(__name__)

LOAD_THREADS = 4  # concurrent reads, each reading lease (and progress) words into its own probe words
POLL_FIRST_S, POLL_MOST_S = 0.001, 0.02  # an early handle's progress is polled this often, backing off


class Staging:
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


def staging_slots(staging_bytes: int, tensors: list[torch.Tensor]) -> int:
    """Blocks `staging_bytes` holds over every tensor of the pool (ValueError: none)."""
    per_block = tensors[0][0].numel() * tensors[0].element_size() * len(tensors)
    slots = staging_bytes // per_block
    if slots < 1:
        raise ValueError(f"--kv-transfer-staging-bytes {staging_bytes} holds no block of this pool "
                         f"({per_block} bytes a block over its layers)")
    return slots


@dataclass(frozen=True)
class Progress:
    """How a reader follows an early handle's progress words: the holder's block size, the
    first block it reads (past its local prefix hit), and how long it waits for progress
    that does not move before it gives up (the holder stalled)."""

    block_size: int
    first_block: int
    stall_s: float


class KvShard:
    """A rank's KV memory registered with its transport: the pool's tensors (K0, V0, K1,
    ...) read in place, or a `Staging` area of `slots` blocks when `slots` > 0 (a pool
    in device memory needs one: the TCP transport reads host memory only)."""

    def __init__(self, transport: Transport, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 slots: int) -> None:
        self.transport = transport
        self.tensors = [t for layer in kv_caches for t in layer]
        self.block_bytes = self.tensors[0][0].numel() * self.tensors[0].element_size()
        self.layers = len(kv_caches)
        with torch.inference_mode(False):  # written from the read threads, which are not in inference mode
            self.staging = Staging(self.tensors, slots) if slots else None
            # where a read's lease word lands, then (an early handle's) the progress words
            self._probes = torch.zeros((LOAD_THREADS, 1 + self.layers), dtype=torch.int64)
        if self.staging is None and any(t.device.type != "cpu" for t in self.tensors):
            raise ValueError("--kv-transfer reads a pool in device memory through host staging: "
                             "--kv-transfer-staging-bytes must be > 0")
        shown = self.staging.tensors if self.staging is not None else self.tensors
        self.regions = tuple(t.data_ptr() for t in shown)
        for t in shown:
            transport.register(t.data_ptr(), t.numel() * t.element_size())
        transport.register(self._probes.data_ptr(), self._probes.numel() * 8)
        self._free_probes: queue.SimpleQueue[int] = queue.SimpleQueue()  # one per read running
        for probe in range(LOAD_THREADS):
            self._free_probes.put(probe)

    def read(self, peer: str, remote_regions: tuple[int, ...], local_blocks: list[int],
             remote_blocks: tuple[int, ...], src: KvHandle,
             progress: Progress | None = None) -> tuple[bool, int, float]:
        """On a worker thread: `peer`'s blocks into this shard's (staging slots when it
        stages), then the holder's lease word (into this read's probe word). True when the
        word still holds the handle's epoch; the bytes read; the seconds spent waiting for
        an early handle's progress (`progress`: how to follow it)."""
        ok, nbytes, waited = False, 0, 0.0
        probe = self._free_probes.get()  # never waits: one per thread
        try:
            ok, nbytes, waited = self._read_sources([(peer, remote_regions, self.regions)], local_blocks,
                                                    remote_blocks, src, progress, probe, self.block_bytes)
        except Exception:  # a transport error is a failed load: recomputed, never used
            log.exception("kv_read_error", peer=peer)
        finally:
            self._free_probes.put(probe)
        return ok, nbytes if ok else 0, waited

    def read_resharded(self, src: KvHandle, parts: list[Part], local_blocks: list[int],
                       remote_blocks: tuple[int, ...], progress: Progress | None = None) -> tuple[bool, int, float]:
        """On a worker thread: a handle of another rank count (reshard.py). Each part's
        holder rank's blocks into host scratch shaped as its blocks (registered for this
        read; an early handle's as its progress words allow), the lease word, then each
        part's heads into this shard's pool blocks (not staging: the copy is the last
        step). True when every byte arrived under the lease; the bytes read; the seconds
        spent waiting for progress."""
        k, n = len(self.tensors), len(local_blocks)
        pool = self.tensors[0]
        tokens, _, head_dim = pool.shape[1:]
        heads = src.block_bytes // (tokens * head_dim * pool.element_size())
        ok, nbytes, waited, scratch = False, 0, 0.0, []
        probe = self._free_probes.get()
        try:
            with torch.inference_mode(False):
                for _ in parts:
                    buf = torch.empty((k, n, tokens, heads, head_dim), dtype=pool.dtype)
                    self.transport.register(buf.data_ptr(), buf.numel() * buf.element_size())
                    scratch.append(buf)
            sources = [(src.peer if part.rank == 0 else src.rank_peers[part.rank - 1],
                        src.regions[part.rank * k:(part.rank + 1) * k], tuple(b.data_ptr() for b in buf))
                       for part, buf in zip(parts, scratch)]
            ok, nbytes, waited = self._read_sources(sources, list(range(n)), remote_blocks, src, progress, probe,
                                                    src.block_bytes)
            if not ok:
                return False, 0, waited
            at = torch.tensor(local_blocks, device=pool.device)
            with torch.inference_mode():  # the pool is an inference tensor
                for part, buf in zip(parts, scratch):
                    for t, b in zip(self.tensors, buf):
                        t[at, :, part.local] = b[:, :, part.heads].to(t.device)
            ok = True
        except Exception:  # a transport error is a failed load: recomputed, never used
            log.exception("kv_read_error", peer=src.peer)
        finally:
            for buf in scratch:
                self.transport.unregister(buf.data_ptr())
            self._free_probes.put(probe)
        return ok, nbytes if ok else 0, waited

    def _leased(self, src: KvHandle, probe: int, progress: bool = False) -> bool:
        """Reads the holder's lease word (and with `progress` its progress words after it)
        into `probe`'s words: True when it still holds the handle's epoch."""
        self._probes[probe, 0] = 0
        addr = self._probes.data_ptr() + probe * self._probes.shape[1] * 8
        local, remote, lengths = [addr], [src.lease_addr], [8]
        if progress:
            local.append(addr + 8)
            remote.append(src.progress_addr)
            lengths.append(self.layers * 8)
        return self.transport.read(src.peer, local, remote, lengths) and int(self._probes[probe, 0]) == src.lease_epoch

    def _read_sources(self, sources: list[tuple[str, tuple[int, ...], tuple[int, ...]]], local_blocks: list[int],
                      remote_blocks: tuple[int, ...], src: KvHandle, progress: Progress | None, probe: int,
                      block_bytes: int) -> tuple[bool, int, float]:
        """Each source's blocks (a peer, its regions, the local regions they land in: K0,
        V0, K1, ...) into `local_blocks`, then the lease: at once, or an early handle's as
        its progress words allow (`_read_as_final`). Whether all arrived under the lease;
        the bytes read; the seconds spent waiting for progress."""
        if src.progress_addr and progress is not None:
            return self._read_as_final(sources, local_blocks, remote_blocks, src, progress, probe, block_bytes)
        nbytes = 0
        for peer, remote_regions, local_regions in sources:
            local, remote, lengths = _ranges(local_blocks, remote_blocks, local_regions, remote_regions, block_bytes)
            if not self.transport.read(peer, local, remote, lengths):
                return False, 0, 0.0
            nbytes += sum(lengths)
        return self._leased(src, probe), nbytes, 0.0

    def _read_as_final(self, sources: list[tuple[str, tuple[int, ...], tuple[int, ...]]], local_blocks: list[int],
                       remote_blocks: tuple[int, ...], src: KvHandle, progress: Progress, probe: int,
                       block_bytes: int) -> tuple[bool, int, float]:
        """An early handle's blocks from each source, each layer's read as the holder's
        progress words say they are final (a block once all its tokens are, the last at the end), until
        every layer's are; the lease is checked with every look at the progress and after
        the last read. Fails when the lease ends or the progress stands still for
        `progress.stall_s`. Each pass reads something or waits (backing off), so it ends."""
        bs, first, total = progress.block_size, progress.first_block, len(local_blocks)
        done = [0] * self.layers  # blocks of local_blocks read, per layer
        nbytes, waited, pause = 0, 0.0, POLL_FIRST_S
        moved = time.monotonic()
        words = self._probes[probe]
        while True:
            if not self._leased(src, probe, progress=True):
                return False, 0, waited
            if min(done) == total:
                return True, nbytes, waited
            final = words[1:].tolist()
            newly = []  # (layer, its blocks read so far, ready now)
            for layer, tokens in enumerate(final):
                ready = total if tokens >= src.num_tokens else min(total, max(0, tokens // bs - first))
                if ready > done[layer]:
                    newly.append((layer, done[layer], ready))
                    done[layer] = ready
            if newly:
                for peer, remote_regions, local_regions in sources:
                    local: list[int] = []
                    remote: list[int] = []
                    lengths: list[int] = []
                    for layer, start, ready in newly:
                        kv = slice(2 * layer, 2 * layer + 2)
                        ranges = _ranges(local_blocks[start:ready], remote_blocks[start:ready],
                                         local_regions[kv], remote_regions[kv], block_bytes)
                        local += ranges[0]
                        remote += ranges[1]
                        lengths += ranges[2]
                    if not self.transport.read(peer, local, remote, lengths):
                        return False, 0, waited
                    nbytes += sum(lengths)
                moved, pause = time.monotonic(), POLL_FIRST_S
                continue
            if time.monotonic() - moved > progress.stall_s:
                log.warning("kv_progress_stalled", peer=src.peer, request_id=src.request_id, seconds=progress.stall_s,
                            final=min(final), tokens=src.num_tokens)
                return False, 0, waited
            time.sleep(pause)
            waited += pause
            pause = min(2 * pause, POLL_MOST_S)

    def stage_out(self, blocks: list[int], slots: list[int]) -> None:
        assert self.staging is not None
        self.staging.copy_out(self.tensors, blocks, slots)

    def stage_in(self, slots: list[int], blocks: list[int]) -> None:
        assert self.staging is not None
        self.staging.copy_in(self.tensors, slots, blocks)


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


# ---- tensor parallelism ---------------------------------------------------------


class RankKv:
    """Rank r's side (r >= 1), in its process: its shard, registered with its own transport,
    and the reads rank 0 asked of it, done on worker threads and reported at each poll.
    It lasts as long as the rank's process (which ends with os._exit)."""

    def __init__(self, transport: Transport, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 slots: int, rank: int, size: int, num_kv_heads: int) -> None:
        self.shard = KvShard(transport, kv_caches, slots)
        self.rank, self.size, self.num_kv_heads = rank, size, num_kv_heads
        self._pool = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="omnibus-kv")
        self._done: queue.SimpleQueue[tuple[int, bool]] = queue.SimpleQueue()

    def hello(self) -> tuple[str, tuple[int, ...]]:
        return self.shard.transport.address, self.shard.regions

    def read(self, ticket: int, src: KvHandle, local_blocks: list[int], remote_blocks: tuple[int, ...],
             progress: Progress | None) -> None:
        """Rank 0's read `ticket`, begun on a worker thread; `progress`: how to follow an
        early handle's (the words are the holder's rank 0's)."""
        holder = 1 + len(src.rank_peers)
        if holder != self.size:  # another rank count: this rank's heads from the holder ranks that hold them
            parts = reshard_plan(self.num_kv_heads, holder, self.size, self.rank)
            self._pool.submit(lambda: self._done.put(
                (ticket, self.shard.read_resharded(src, parts, local_blocks, remote_blocks, progress)[0])))
            return
        k = len(self.shard.regions)
        peer, regions = src.rank_peers[self.rank - 1], src.regions[self.rank * k:(self.rank + 1) * k]
        self._pool.submit(lambda: self._done.put(
            (ticket, self.shard.read(peer, regions, local_blocks, remote_blocks, src, progress)[0])))

    def finished(self) -> dict[int, bool]:
        done = {}
        while True:
            try:
                ticket, ok = self._done.get_nowait()
            except queue.Empty:
                return done
            done[ticket] = ok


def serve_kv(runtime: Any, rank: int, message: tuple, gather: Any) -> None:
    """Rank `rank`'s answer to rank 0's "kv_*" `message` (parallel/ranks.py serve_rank);
    `gather(obj)` sends an object back to rank 0 (a gather over the group)."""
    kind = message[0]
    if kind == "kv_setup":
        from omnibus.engine.kv_transfer.transport import make_transport

        _, transport, host, slots, size, num_kv_heads = message
        runtime.kv = RankKv(make_transport(transport, host), runtime.pool, slots, rank, size, num_kv_heads)
        gather(runtime.kv.hello())
    elif kind == "kv_read":
        runtime.kv.read(*message[1:])
    elif kind == "kv_poll":
        gather(runtime.kv.finished())
    elif kind == "kv_stage_out":  # acknowledged: the copy is whole before its handle or progress goes out
        runtime.kv.shard.stage_out(message[1], message[2])
        gather(True)
    elif kind == "kv_stage_in":
        runtime.kv.shard.stage_in(message[1], message[2])


class RankLink:
    """Rank 0's side: every decision about KV sent to ranks 1..N-1 (in the order of the
    step's other messages), and their reads' results gathered back."""

    def __init__(self, ranks: Ranks, transport: str, host: str) -> None:
        """Each rank's shard gets a transport of kind `transport` on `host` (--kv-transfer,
        --kv-transfer-host: the ranks share rank 0's host)."""
        self.ranks, self.transport, self.host = ranks, transport, host
        self.size = ranks.tp.size

    def _gather(self) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.gather_object(None, out, dst=0, group=self.ranks.tp.cpu_group)
        return out[1:]

    def setup(self, slots: int, num_kv_heads: int) -> list[tuple[str, tuple[int, ...]]]:
        """Each rank's shard (`slots` staging blocks, 0: none; the model's `num_kv_heads`,
        to read handles of other rank counts) and its (address, regions), ranks 1..N-1
        in order."""
        self.ranks.send(("kv_setup", self.transport, self.host, slots, self.size, num_kv_heads))
        return self._gather()

    def read(self, ticket: int, src: KvHandle, local_blocks: list[int], remote_blocks: tuple[int, ...],
             progress: Progress | None) -> None:
        self.ranks.send(("kv_read", ticket, src, local_blocks, remote_blocks, progress))

    def poll(self) -> list[dict[int, bool]]:
        self.ranks.send(("kv_poll",))
        return self._gather()

    def stage_out(self, blocks: list[int], slots: list[int]) -> None:
        """Every rank's `blocks` copied into its `slots`, done on return (a reader may read
        them as soon as the hold's handle or progress says so)."""
        self.ranks.send(("kv_stage_out", blocks, slots))
        self._gather()

    def stage_in(self, slots: list[int], blocks: list[int]) -> None:
        self.ranks.send(("kv_stage_in", slots, blocks))
