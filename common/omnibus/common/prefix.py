"""The prefix-cache block hash: one definition for the engine's KV block allocator
and the router's prefix-aware routing. Torch-free, so the router can import it.

A full block's hash chains the previous block's hash, its token ids, the LoRA adapter's
identity (its salt) and the request's cache salt (its tenant's cache group, which the
router sets from its keys file), so equal hashes mean equal prefixes under the same
weights for the same cache group: one tenant's prompt never warms another's cache,
whose timing would tell it what the other sent (vLLM's CVE-2025-46570). Engines
report the cached blocks' keys (the first 8 bytes of each hash, as an integer) in their
load reports; the router computes the same keys, with the same salts, for a request's
leading blocks and counts how many an engine holds.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Collection, Sequence


MAX_CACHE_SALT_LEN = 64  # characters of a request's cache salt (the router sends 32)


def check_cache_salt(cache_salt: str) -> None:
    """A request's cache salt: at most MAX_CACHE_SALT_LEN printable ASCII characters, ""
    for none. Raises ValueError. (No NUL, as no adapter salt has one, so the bytes a block
    hash chains after its tokens are read one way only.)"""
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    if len(cache_salt) > MAX_CACHE_SALT_LEN or not all(" " <= c <= "~" for c in cache_salt):
        raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT_LEN} printable ASCII characters, "
                         f"got {cache_salt[:80]!r}")


def block_hash(parent: bytes, tokens: Sequence[int], adapter_salt: str | None, cache_salt: str) -> bytes:
    """Chained hash of one full block: `adapter_salt` the adapter's identity (None or "":
    the base model), `cache_salt` the request's cache group ("": none, one shared cache).
    With neither it is the unsalted hash. blake2b: collisions would leak KV across
    tenants, so a cryptographic hash is worth its ~1 µs per block."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    if adapter_salt:
        h.update(b"\x00adapter:" + adapter_salt.encode())
    if cache_salt:
        h.update(b"\x00cache:" + cache_salt.encode())
    return h.digest()


def block_key(h: bytes) -> int:
    """The compact form of a block hash that load reports carry (64 bits)."""
    return int.from_bytes(h[:8], "little")


def leading_block_keys(
    token_ids: Sequence[int], block_size: int, adapter_salt: str | None, max_blocks: int,
    cache_salt: str = "",
) -> list[int]:
    """Keys of the first `max_blocks` full blocks of `token_ids`, chained as the engine
    chains them (with the same salts). Only blocks the engine could reuse count: it always
    computes the last token itself, so a block ending on the last token is left out."""
    keys: list[int] = []
    parent = b""
    for i in range(min((len(token_ids) - 1) // block_size, max_blocks)):
        block = token_ids[i * block_size:(i + 1) * block_size]
        parent = block_hash(parent, block, adapter_salt, cache_salt)
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
