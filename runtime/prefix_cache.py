"""Prefix caching for the continuous batcher: the KV of full blocks of prompts, reused by later prompts.

    cache = PrefixCache(block_size=16, max_tokens=8192)
    hit = cache.lookup(namespace, prompt, limit)      # the cached blocks the prompt starts with (pinned)
    ... restore hit.arrays() into a row's cache, prefill only prompt[hit.tokens:] ...
    cache.release(hit.keys)                            # when the row leaves the batch
    cache.insert(namespace, prompt, block_of, upto)    # the prompt's full blocks not cached yet

A block is `block_size` consecutive prompt positions. Its key is a hash chained
over the namespace (the session's model identity and backend: nothing is shared
across models, adapters or runtimes) and every token id up to the block's end,
so a block is found only after the very same tokens: the KV of a position
depends on the tokens before it and on nothing else (causal attention; each row
of a batch computes what it would alone). Each block also keeps its own token
ids and its parent's key, checked on lookup, so a hash collision cannot hand out
another prompt's KV.

A block holds, for each cache tensor of the model, that block's positions in the
session's contract layout, (kv_heads, block_size, head_dim) as numpy: restoring a
prefix copies them into the new row's cache (block KV without copies is a later
step). The memory budget counts tokens: at most max_tokens // block_size blocks
are held. When a new block does not fit, the least recently used block that is
not referenced goes first; a block is referenced while a running row restored
from it (pinned by lookup until release) or while a cached block continues it (a
child: evicting the parent would strand it). When nothing can go, the new block
is not cached.

Capped sliding-window layers (a cache that keeps only the newest W positions)
follow another rule: a prefix of P positions is restored, and a block cached,
only when P <= W for every capped layer (the smallest window bounds it), so that
a restored cache holds exactly the positions a full prefill of the prefix would
(all P of them); a block is cached only from a cache that still holds all of its
positions in every layer. The batcher therefore feeds a prompt's blocks within
the window on their own first (and caches them) and the rest over them; the
positions past W are always prefilled. Layers with a window but an uncapped
cache are unaffected (they hold every position).
"""

from __future__ import annotations

import collections
import hashlib
import threading
from dataclasses import dataclass, field

import numpy as np

from kvforge.checks import is_int
from kvforge.errors import KvforgeError


@dataclass
class _Block:
    key: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    arrays: list[np.ndarray]  # per cache tensor: (kv_heads, block_size, head_dim)
    pins: int = 0  # running rows restored from it
    children: int = 0  # cached blocks that continue it


@dataclass
class PrefixHit:
    """What a lookup found: the cached blocks a prompt starts with (pinned until released)."""

    keys: list[bytes] = field(default_factory=list)
    blocks: list[_Block] = field(default_factory=list)
    block_size: int = 0

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.block_size

    def arrays(self) -> list[np.ndarray]:
        """Per cache tensor, the prefix's positions: (1, kv_heads, tokens, head_dim)."""
        return [np.concatenate([b.arrays[j] for b in self.blocks], axis=1)[None]
                for j in range(len(self.blocks[0].arrays))]


@dataclass
class PrefixStats:
    lookups: int = 0  # prompts looked up
    hits: int = 0  # prompts that restored a cached prefix
    hit_tokens: int = 0  # prompt tokens restored from the cache instead of prefilled
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    cached_blocks: int = 0  # held now
    cached_tokens: int = 0  # held now (cached_blocks * block_size)


class PrefixCache:
    """Blocks of prompt KV keyed by the hash of the tokens up to them; LRU within a token budget (module doc)."""

    def __init__(self, block_size: int = 16, max_tokens: int = 8192):
        if not is_int(block_size) or block_size < 1:
            raise KvforgeError(f"prefix_block must be an int >= 1, got {block_size!r}")
        if not is_int(max_tokens) or max_tokens < 0:
            raise KvforgeError(f"prefix_cache_tokens must be an int >= 0 (0: no prefix cache), got {max_tokens!r}")
        self.block_size = int(block_size)
        self.max_tokens = int(max_tokens)
        self.max_blocks = self.max_tokens // self.block_size
        self._blocks: collections.OrderedDict[bytes, _Block] = collections.OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # a cache may be shared between batchers (of one model or several)
        self._stats = PrefixStats()

    # -- keys ------------------------------------------------------------------------------
    @staticmethod
    def namespace(model_id: str, backend: str = "") -> bytes:
        """The root of every key chain: the model's identity (and the runtime that computes its KV)."""
        return hashlib.blake2b(f"{model_id}\0{backend}".encode(), digest_size=16).digest()

    def _keys(self, namespace: bytes, prompt, blocks: int) -> list[bytes]:
        keys, key = [], namespace
        ids = np.asarray(prompt[:blocks * self.block_size], np.int64)
        for k in range(blocks):
            key = hashlib.blake2b(key + ids[k * self.block_size:(k + 1) * self.block_size].tobytes(), digest_size=16).digest()
            keys.append(key)
        return keys

    # -- the batcher's side ----------------------------------------------------------------
    def lookup(self, namespace: bytes, prompt, limit: int) -> PrefixHit:
        """The longest run of cached blocks the prompt starts with, at most `limit` tokens; pins them."""
        n = min(len(prompt), limit) // self.block_size
        hit = PrefixHit(block_size=self.block_size)
        if n <= 0 or self.max_blocks == 0:
            return hit
        with self._lock:
            self._stats.lookups += 1
            parent = None
            for k, key in enumerate(self._keys(namespace, prompt, n)):
                block = self._blocks.get(key)
                if (block is None or block.parent != parent
                        or block.tokens != tuple(prompt[k * self.block_size:(k + 1) * self.block_size])):
                    break
                hit.keys.append(key)
                hit.blocks.append(block)
                parent = key
            for key, block in zip(hit.keys, hit.blocks):
                block.pins += 1
                self._blocks.move_to_end(key)
            if hit.blocks:
                self._stats.hits += 1
                self._stats.hit_tokens += hit.tokens
        return hit

    def release(self, keys: list[bytes]) -> None:
        """Unpin blocks a lookup pinned (the row that restored them has left)."""
        with self._lock:
            for key in keys:
                block = self._blocks.get(key)
                if block is not None and block.pins > 0:
                    block.pins -= 1

    def missing(self, namespace: bytes, prompt, upto: int) -> tuple[list[bytes], int]:
        """The chain keys of the prompt's full blocks within `upto` tokens, and the index of the first not cached."""
        n = min(len(prompt), upto) // self.block_size
        if n <= 0 or self.max_blocks == 0:
            return [], 0
        keys = self._keys(namespace, prompt, n)
        with self._lock:
            first = 0
            while first < n and keys[first] in self._blocks:
                first += 1
        return keys, first

    def insert(self, keys: list[bytes], prompt, first: int, block_arrays) -> int:
        """Cache blocks first.. of a prompt (keys from missing()); block_arrays(k) gives block k's per-tensor arrays.
        Returns how many were added (fewer when the budget holds only referenced blocks)."""
        added = 0
        with self._lock:
            for k in range(first, len(keys)):
                key = keys[k]
                parent = keys[k - 1] if k else None
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    continue
                if parent is not None and parent not in self._blocks:
                    break  # its parent was evicted meanwhile: the chain would be unreachable
                if len(self._blocks) >= self.max_blocks and not self._evict_one(keep=parent):
                    break
                tokens = tuple(int(t) for t in prompt[k * self.block_size:(k + 1) * self.block_size])
                self._blocks[key] = _Block(key, parent, tokens, [np.array(a, copy=True, order="C") for a in block_arrays(k)])
                if parent is not None:
                    self._blocks[parent].children += 1
                self._stats.inserted_blocks += 1
                added += 1
        return added

    def _evict_one(self, keep: bytes | None) -> bool:
        for key, block in self._blocks.items():  # least recently used first
            if block.pins == 0 and block.children == 0 and key != keep:
                del self._blocks[key]
                if block.parent is not None and block.parent in self._blocks:
                    self._blocks[block.parent].children -= 1
                self._stats.evicted_blocks += 1
                return True
        return False

    # -- inspection ------------------------------------------------------------------------
    @property
    def stats(self) -> PrefixStats:
        with self._lock:
            s = PrefixStats(**vars(self._stats))
            s.cached_blocks = len(self._blocks)
            s.cached_tokens = len(self._blocks) * self.block_size
            return s

    def pinned(self) -> int:
        """Blocks referenced by running rows now."""
        with self._lock:
            return sum(1 for b in self._blocks.values() if b.pins)

    def clear(self) -> None:
        """Drop every block no running row references."""
        with self._lock:
            while self._evict_one(keep=None):
                pass
