"""Where a request's KV lies on another engine: the handle that engine gives out.

An engine that holds a request's KV for a transfer (the prefill engine of a
disaggregated pair, or an engine draining its running requests) ends the request with
a `KvHandle`; the router passes it to the engine that goes on with the request, whose
connector reads the blocks it names. Every field a reader needs to find, check and
trust the bytes is here: the holder's transfer address and memory layout, which of
its blocks hold which tokens, a digest of those tokens (with the adapter's identity
and the tenant's cache group, as prefix-cache hashes have), and the lease word that
says the blocks were still held while they were read. A handle given out while its
prefill still runs also names the holder's progress words: a reader reads each layer's
blocks as they become final. Torch-free.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omnibus.v1 import engine_pb2


@dataclass(frozen=True)
class KvHandle:
    peer: str  # the holder's transfer-engine address (host:port)
    request_id: str  # the holder's request: aborting it there releases the blocks
    num_tokens: int  # tokens whose KV the blocks hold: the request's first num_tokens
    blocks: tuple[int, ...]  # the holder's block ids, block i holding tokens [i*bs, (i+1)*bs)
    regions: tuple[int, ...]  # base address of each layer's K cache, then its V cache
    block_bytes: int  # one block's bytes in one region
    layout: str  # the pool's shape and dtype (layout_of): readers with another refuse it
    digest: bytes  # kv_digest of the tokens, the adapter's salt and the cache salt
    lease_addr: int  # a 64-bit word that holds lease_epoch while the blocks are held
    lease_epoch: int
    # tensor parallelism: ranks 1..N-1's addresses (rank 0's is `peer`); `regions` then
    # lists every rank's regions, rank 0's first; the lease word is rank 0's
    rank_peers: tuple[str, ...] = ()
    # given out before its prefill ended (--kv-transfer-overlap): the holder's progress
    # words (one int64 a layer: that layer's tokens whose KV is final on every rank; rank
    # 0's, as the lease word); 0: all final now
    progress_addr: int = 0

    def to_proto(self) -> engine_pb2.KvHandle:
        from omnibus.v1 import engine_pb2

        return engine_pb2.KvHandle(
            peer=self.peer, request_id=self.request_id, num_tokens=self.num_tokens,
            blocks=self.blocks, regions=self.regions, block_bytes=self.block_bytes,
            layout=self.layout, digest=self.digest, lease_addr=self.lease_addr,
            lease_epoch=self.lease_epoch, rank_peers=self.rank_peers, progress_addr=self.progress_addr)

    @classmethod
    def from_proto(cls, msg: engine_pb2.KvHandle) -> KvHandle:
        return cls(msg.peer, msg.request_id, msg.num_tokens, tuple(msg.blocks), tuple(msg.regions),
                   msg.block_bytes, msg.layout, msg.digest, msg.lease_addr, msg.lease_epoch,
                   tuple(msg.rank_peers), msg.progress_addr)

    def problem(self, block_size: int) -> str | None:
        """Why the handle cannot describe a pool of `block_size`-token blocks (a router's
        message is input like any other), or None."""
        if not self.peer or self.num_tokens <= 0:
            return "it names no peer or no tokens"
        if len(self.blocks) != -(-self.num_tokens // block_size):
            return f"{len(self.blocks)} blocks cannot hold {self.num_tokens} tokens of {block_size}"
        if (not self.regions or len(self.regions) % (2 * (1 + len(self.rank_peers))) or self.block_bytes <= 0
                or not all(self.rank_peers)):
            return "its memory regions are malformed"
        return None


def kv_digest(tokens: Sequence[int], adapter_salt: str | None, cache_salt: str) -> bytes:
    """What a handle's KV was computed from: the tokens, under the adapter's weights, in
    the tenant's cache group. A reader compares its own request's digest with the handle's
    and reads nothing on a mismatch."""
    h = hashlib.blake2b(digest_size=16)
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    h.update(b"\x00" + (adapter_salt or "").encode() + b"\x00" + cache_salt.encode())
    return h.digest()
