"""Content hashes of full KV blocks for prefix caching.

A block's hash chains its parent's hash, its own tokens and the request's extra keys (model,
adapter and its registration, cache salt), so equal hashes mean the same tokens after the same prefix
under the same weights and tenant: a hit is only possible for the same model, adapter and cache salt,
and an adapter id registered again (over other weights, maybe) starts afresh. SHA-256 is
used rather than Python's hash() because a collision here would hand one tenant's KV to another.
"""

from __future__ import annotations

import hashlib
import struct


def root_hash(model: str, adapter: str | None, registration: int, cache_salt: str | None) -> bytes:
    """The parent of a sequence's first block: everything besides tokens that shapes the KV.
    `registration`: which registration of `adapter` (LoraSlots.registration; 0 with no adapter)."""
    key = "\x00".join((model, adapter or "", str(registration), cache_salt or ""))
    return hashlib.sha256(b"loraplex-kv\x00" + key.encode()).digest()


def chain_hashes(parent: bytes, tokens: list[int], block_size: int, start_block: int, end_block: int) -> list[bytes]:
    """Hashes of blocks [start_block, end_block) of `tokens`; `parent` is the hash of block
    start_block - 1 (or the root hash when start_block == 0)."""
    out = []
    for b in range(start_block, end_block):
        chunk = tokens[b * block_size:(b + 1) * block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{len(chunk)}q", *chunk)).digest()
        out.append(parent)
    return out
