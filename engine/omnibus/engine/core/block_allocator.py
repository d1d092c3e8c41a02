"""KV block allocator with reference counts and a prefix cache.

The pool has `num_blocks` blocks of `block_size` token slots; block 0 is a reserved
null block (padding slots point at it) and is never handed out. Every other block
is in exactly one state:

- free: ref count 0, no hash;
- cached: ref count 0 but holds the KV of a full block known by its hash, reusable
  by a later request until evicted (least recently freed first);
- referenced: ref count > 0 (it may also be cached, shared by several sequences).

Free and cached blocks share one LRU queue, so allocation and freeing are O(1).
A full block's hash chains the previous block's hash, its token ids, the LoRA adapter's
identity and the request's cache salt (its tenant's cache group), so equal hashes mean
equal prefixes under the same weights for the same cache group: tenants in different
groups never share a block (the rule is omnibus.common.prefix, which the router's
prefix-aware routing shares).
This module is the one place that frees blocks.

With a host tier (`host_blocks` > 0, --kv-offload-bytes) a cached block about to be
overwritten is first saved to a host slot under its hash, and a prefix whose next block
is no longer on the device but is in host memory is loaded back into a fresh block
instead of being recomputed. The allocator only decides: each copy is queued, in order,
for the model runner to make before the step's forward (`take_copies`); applied in that
order they are consistent even when a step saves a block and loads another into it.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence as Seq
from dataclasses import dataclass

from omnibus.common.prefix import block_hash, block_key
from omnibus.engine.core.sequence import Sequence

NULL_BLOCK = 0


@dataclass(frozen=True)
class KvCopy:
    """One block's KV copied between the device pool and the host tier, every layer."""

    save: bool  # True: device block -> host slot; False: host slot -> device block
    block: int
    slot: int


@dataclass(frozen=True)
class BlockCounts:
    free: int
    cached: int
    referenced: int
    total: int  # usable blocks, excluding the null block


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 host_blocks: int = 0) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hashes: list[bytes | None] = [None] * num_blocks
        # Blocks with ref count 0, front = evicted first.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> block
        self.keys: dict[bytes, int] = {}  # hash -> its block_key, in `cached`'s order (load reports)
        self.num_cached_free = 0  # blocks in free_queue that hold a hash (kept, not counted per step)
        self.num_cache_hits = 0  # blocks served from the prefix cache since start
        self.num_evictions = 0
        self.cache_generation = 0  # bumped whenever the set of cached hashes changes
        # the host tier: hash -> host slot, least recently used first, and the free slots
        self.host_blocks = host_blocks if enable_prefix_caching else 0
        self.host: OrderedDict[bytes, int] = OrderedDict()
        self.host_keys: dict[bytes, int] = {}  # hash -> its block_key, as `keys`
        self.host_free = list(range(self.host_blocks))
        self.copies: list[KvCopy] = []  # queued for the runner, in order (take_copies)
        self._loading: set[int] = set()  # host slots that queued loads read
        self.num_host_hits = 0  # blocks loaded back from host memory since start
        self.num_host_saves = 0

    # ---- queries -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free plus evictable cached)."""
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    # ---- allocation ----------------------------------------------------------

    def allocate_prefix(self, seq: Sequence, limit: int | None = None) -> int:
        """Attach cached blocks for `seq`'s leading full blocks; return tokens covered.

        Only for a sequence holding no blocks. At least one token is left to compute,
        because the next token's logits come from the last position's forward; `limit`
        caps the tokens read from the cache further (a request that needs the logits of
        its prompt positions reads none past those it has scored).
        """
        if seq.block_table:
            raise RuntimeError(f"allocate_prefix on {seq.request_id}, which already holds blocks")
        if not self.enable_prefix_caching:
            return 0
        self._hash_full_blocks(seq, seq.num_tokens - 1)
        most = seq.num_tokens - 1 if limit is None else min(seq.num_tokens - 1, limit)
        wanted = seq.block_hashes[: most // self.block_size]
        for h in wanted:
            block = self.cached.get(h)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
                self.num_cached_free -= 1
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        self.num_cache_hits += len(seq.block_table)
        # then what the host tier holds, each into a fresh block (bounded by the prompt's
        # blocks and by the free ones)
        for h in wanted[len(seq.block_table):]:
            slot = self.host.get(h)
            if slot is None or not self.free_queue:
                break
            self.host.move_to_end(h)
            self._loading.add(slot)  # no save may take this slot before the load is made
            block = self._take_block()
            self.copies.append(KvCopy(False, block, slot))
            self._register(block, h)
            seq.block_table.append(block)
            self.num_host_hits += 1
        seq.num_registered_blocks = len(seq.block_table)
        return len(seq.block_table) * self.block_size

    def allocate_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s block table to hold `num_tokens` tokens. All or nothing."""
        need = -(-num_tokens // self.block_size) - len(seq.block_table)
        if need <= 0:
            return True  # the common decode step: the last block has room
        if need > len(self.free_queue):
            return False
        for _ in range(need):
            seq.block_table.append(self._take_block())
        return True

    def _take_block(self) -> int:
        """The least recently freed block, referenced once; a cached one is evicted (its
        KV saved to the host tier first, when there is one)."""
        block, _ = self.free_queue.popitem(last=False)
        h = self.hashes[block]
        if h is not None:  # evict: its cached KV is about to be overwritten
            self.hashes[block] = None
            self.num_cached_free -= 1
            if self.cached.get(h) == block:
                del self.cached[h], self.keys[h]
                self.cache_generation += 1
                self._save(block, h)
            self.num_evictions += 1
        self.ref_counts[block] = 1
        return block

    def _save(self, block: int, h: bytes) -> None:
        """Queue `block`'s KV into a host slot under `h` (the least recently used slot's
        hash is dropped when none is free)."""
        if not self.host_blocks or h in self.host:
            return
        if self.host_free:
            slot = self.host_free.pop()
        else:  # the least recently used slot that no queued load still reads
            old = next((k for k, s in self.host.items() if s not in self._loading), None)
            if old is None:
                return  # every slot is being loaded from: this block is not kept
            slot = self.host.pop(old)
            del self.host_keys[old]
        self.host[h] = slot
        self.host_keys[h] = block_key(h)
        self.copies.append(KvCopy(True, block, slot))
        self.num_host_saves += 1
        self.cache_generation += 1

    def take_copies(self) -> Seq[KvCopy]:
        """The copies queued since the last call, in the order they must be made (before
        the forward of the step planned meanwhile)."""
        if not self.copies:
            return ()  # the common step: nothing allocated
        copies, self.copies = self.copies, []
        self._loading.clear()
        return copies

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`. Cached blocks stay reusable; the sequence's
        tail goes to the front of the queue so it is evicted before its shared head."""
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def free_blocks(self, blocks: Seq[int]) -> None:
        """Release blocks a request no longer holds: those its KV transfer kept
        (kv_transfer/connector.py `hold`), given back when the reader is done."""
        for block in reversed(blocks):
            self._release(block)

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_queue[block] = None
            if self.hashes[block] is None:
                self.free_queue.move_to_end(block, last=False)
            else:
                self.num_cached_free += 1

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free `seq`'s blocks past the ones holding its first `num_tokens` tokens (the
        slots of speculated tokens the model rejected; never cached: only full blocks of
        computed tokens are)."""
        keep = -(-num_tokens // self.block_size)
        for block in reversed(seq.block_table[keep:]):
            self._release(block)
        del seq.block_table[keep:]
        seq.num_registered_blocks = min(seq.num_registered_blocks, keep)

    def cache_blocks(self, seq: Sequence) -> None:
        """Register `seq`'s full, computed blocks in the prefix cache (a block whose last
        token is still pending waits: its hash needs that token)."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        if full <= seq.num_registered_blocks:
            return  # hot path: no block filled up since the last call
        full = min(full, len(seq.block_table))
        self._hash_full_blocks(seq, full * self.block_size)
        for i in range(seq.num_registered_blocks, full):
            self._register(seq.block_table[i], seq.block_hashes[i])
        seq.num_registered_blocks = full

    def _register(self, block: int, h: bytes) -> None:
        if self.hashes[block] is None and h not in self.cached:
            self.hashes[block] = h
            self.cached[h] = block
            self.keys[h] = block_key(h)
            self.cache_generation += 1

    def _hash_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq.block_hashes` to cover every full block within `num_tokens`."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else b""
            seq.block_hashes.append(
                block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs], seq.adapter_salt, seq.cache_salt))

    def cached_keys(self, limit: int) -> list[int]:
        """Keys (omnibus.common.prefix.block_key) of at most `limit` cached blocks, the
        most recently registered first: what load reports tell routers. O(limit), at C
        speed (each key was computed once, when its block was registered)."""
        device = list(itertools.islice(reversed(self.keys.values()), limit))
        if len(device) < limit and self.host_keys:  # then the host tier's, most recent first
            host = (k for h, k in reversed(self.host_keys.items()) if h not in self.keys)
            device += itertools.islice(host, limit - len(device))
        return device

    # ---- integrity -----------------------------------------------------------

    def counts(self) -> BlockCounts:
        """O(1): the engine publishes these after every step."""
        cached = self.num_cached_free
        return BlockCounts(free=len(self.free_queue) - cached, cached=cached,
                           referenced=self.num_usable_blocks - len(self.free_queue), total=self.num_usable_blocks)

    def check_integrity(self, block_tables: Iterable[list[int]]) -> BlockCounts:
        """Prove the pool's bookkeeping: every usable block is free, cached or referenced
        (free + cached + referenced = total), ref counts equal the number of block tables
        holding each block, the null block is never handed out, and the cache index
        points at blocks carrying that hash. Raises RuntimeError naming what is wrong."""
        holders = Counter(b for table in block_tables for b in table)
        problems = []
        if NULL_BLOCK in holders or NULL_BLOCK in self.free_queue or self.ref_counts[NULL_BLOCK]:
            problems.append("the null block is in use")
        for b in range(1, self.num_blocks):
            if self.ref_counts[b] != holders.get(b, 0):
                problems.append(f"block {b}: ref count {self.ref_counts[b]} but {holders.get(b, 0)} holders")
            if (self.ref_counts[b] == 0) != (b in self.free_queue):
                problems.append(f"block {b}: ref count {self.ref_counts[b]}, in free queue: {b in self.free_queue}")
        for h, b in self.cached.items():
            if self.hashes[b] != h:
                problems.append(f"cache index points at block {b}, which holds another hash")
        if sum(h is not None for h in self.hashes) != len(self.cached):
            problems.append("blocks carry hashes missing from the cache index")
        if list(self.keys) != list(self.cached) or any(k != block_key(h) for h, k in self.keys.items()):
            problems.append("the load reports' block keys differ from the cache index")
        slots = list(self.host.values()) + self.host_free
        if sorted(slots) != list(range(self.host_blocks)):
            problems.append(f"host tier slots are not each held once or free: {len(self.host)} held, "
                            f"{len(self.host_free)} free of {self.host_blocks}")
        if set(self.host_keys) != set(self.host):
            problems.append("the host tier's block keys differ from its index")
        counts = self.counts()
        actual_cached = sum(1 for b in self.free_queue if self.hashes[b] is not None)
        if actual_cached != counts.cached:
            problems.append(f"cached-block counter says {counts.cached}, the free queue holds {actual_cached}")
        if counts.free + counts.cached + counts.referenced != counts.total:
            problems.append(f"free + cached + referenced != total: {counts}")
        if problems:
            raise RuntimeError("KV block allocator integrity check failed: " + "; ".join(problems[:10]))
        return counts
