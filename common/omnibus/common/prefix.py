"""The prefix-cache block hash: one definition for the engine's KV block allocator
and the router's prefix-aware routing. Torch-free, so the router can import it.

A full block's hash chains the previous block's hash, its token ids and a salt (the
LoRA adapter's identity), so equal hashes mean equal prefixes under the same weights.
Engines report the cached blocks' keys (the first 8 bytes of each hash, as an
integer) in their load reports; the router computes the same keys for a request's
leading blocks and counts how many an engine holds.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Collection, Sequence


def block_hash(parent: bytes, tokens: Sequence[int], salt: str | None) -> bytes:
    """Chained hash of one full block. blake2b: collisions would leak KV across
    tenants, so a cryptographic hash is worth its ~1 µs per block."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    if salt:
        h.update(b"\x00adapter:" + salt.encode())
    return h.digest()


def block_key(h: bytes) -> int:
    """The compact form of a block hash that load reports carry (64 bits)."""
    return int.from_bytes(h[:8], "little")


def leading_block_keys(
    token_ids: Sequence[int], block_size: int, salt: str | None, max_blocks: int
) -> list[int]:
    """Keys of the first `max_blocks` full blocks of `token_ids`, chained as the engine
    chains them. Only blocks the engine could reuse count: it always computes the last
    token itself, so a block ending on the last token is left out."""
    keys: list[int] = []
    parent = b""
    for i in range(min((len(token_ids) - 1) // block_size, max_blocks)):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], salt)
        keys.append(block_key(parent))
    return keys


def matched_blocks(keys: Sequence[int], cached: Collection[int]) -> int:
    """How many of the leading `keys` are in `cached` (stops at the first miss: a prefix
    is reused only up to its first uncached block)."""
    n = 0
    for key in keys:
        if key not in cached:
            break
        n += 1
    return n
