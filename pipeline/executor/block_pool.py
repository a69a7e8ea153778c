"""KV blocks as bookkeeping, no tensors: which fixed-size blocks each sequence holds, and which hold a known prefix.

A sequence's KV lives in ``block_size``-token blocks listed in its block table (position p is in table[p //
block_size] at offset p % block_size). Blocks are reference counted, so sequences that start with the same tokens
share the blocks of that prefix. A block full of committed tokens (never to change again) gets a key: a SHA-256
digest of its tokens and of the key before it, the first block's parent being the request's cache salt (none by
default), so requests with different salts never share a block. A new sequence whose prompt starts with keyed
blocks takes them instead of computing them (prefix reuse), but only after comparing each block's stored place,
parent and tokens with its own: a digest collision can cost a reuse, never hand out another prompt's KV. A block
nobody holds stays cached until its memory is needed: fresh blocks come from the free list first, then from growing
the pool up to its limit, and only then from evicting the least recently released cached block; a block a running
sequence holds is never evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

ROOT = bytes(32)  # the first block's parent without a cache salt


class OutOfBlocks(RuntimeError):
    """Every block is held by a running sequence: the pool's limit is below what the running requests need."""


@dataclass
class PrefixStats:
    queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    hit_tokens: int = 0  # of those, tokens whose KV was reused instead of computed

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def digest(parent: bytes, tokens) -> bytes:
    """The key of a block of ``tokens`` whose parent key is ``parent`` (32 bytes): ids as fixed-width int64, so no
    two blocks of ``block_size`` tokens share an encoding."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def salt_root(cache_salt: str | None) -> bytes:
    """The first block's parent for requests with this cache salt."""
    if cache_salt is None:
        return ROOT
    return hashlib.sha256(b"cache_salt\x00" + cache_salt.encode("utf-8")).digest()


def block_hashes(tokens: list[int], block_size: int, parent: bytes = ROOT, first: int = 0) -> list[bytes]:
    """Keys of the full blocks of ``tokens`` from block ``first`` on; each covers its tokens and all before them
    (``parent``: the key of block ``first - 1``, or the salt's root for block 0), so equal keys mean equal prefixes,
    not just equal blocks."""
    keys = []
    for start in range(first * block_size, len(tokens) - block_size + 1, block_size):
        parent = digest(parent, tokens[start:start + block_size])
        keys.append(parent)
    return keys


class BlockPool:
    def __init__(self, block_size: int, max_blocks: int, reuse: bool = True):
        if block_size < 1 or max_blocks < 1:
            raise ValueError(f"block pool: block_size {block_size} and max_blocks {max_blocks} must be >= 1")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.reuse = reuse
        self.capacity = 0  # blocks that exist (the KV tensors grow to match); ids are 0 .. capacity - 1
        self.free: list[int] = []  # blocks holding nothing worth keeping
        self.refs: list[int] = []  # [capacity] sequences holding each block
        # [capacity] how many times each block was handed out fresh: a companion cache's record of what it wrote
        # into a block holds only while the block's generation is the one it wrote in
        self.generation: list[int] = []
        self.cached: OrderedDict[int, None] = OrderedDict()  # released hashed blocks, least recently released first
        self.hash_of: dict[int, bytes] = {}  # block -> prefix key
        self.block_of: dict[bytes, int] = {}  # prefix key -> block
        # block -> (its index in the table, its parent's key, its tokens): what a hit is checked against, so a
        # colliding key is a miss
        self.content_of: dict[int, tuple[int, bytes, tuple[int, ...]]] = {}
        self.tables: dict[object, list[int]] = {}  # sequence -> its blocks in order
        self._hashed: dict[object, int] = {}  # sequence -> how many of its leading blocks are committed
        # sequence -> the key of its last committed block (its salt's root before any): the next block's parent,
        # kept per sequence because a block computed twice is keyed once, so its table's block may have no key
        self._chain: dict[object, bytes] = {}
        self.stats = PrefixStats()

    # ---- per sequence -----------------------------------------------------------------------------------------

    def open(self, seq, prompt: list[int], cache_salt: str | None = None) -> int:
        """Start ``seq``; returns how many leading tokens of ``prompt`` already have KV (whole cached blocks, never
        all of ``prompt``: the caller still computes at least its last token). Only blocks keyed under the same
        ``cache_salt`` are reused."""
        if seq in self.tables:
            raise ValueError(f"block pool: sequence {seq!r} is already open")
        parent = salt_root(cache_salt)
        self.tables[seq], self._hashed[seq], self._chain[seq] = [], 0, parent
        if not self.reuse:
            return 0
        self.stats.queried_tokens += len(prompt)
        usable = (len(prompt) - 1) // self.block_size  # whole blocks strictly before the last token
        for index, key in enumerate(block_hashes(prompt[:usable * self.block_size], self.block_size, parent)):
            block = self.block_of.get(key)
            tokens = tuple(prompt[index * self.block_size:(index + 1) * self.block_size])
            if block is None or self.content_of[block] != (index, parent, tokens):
                break
            self._take(block)
            self.tables[seq].append(block)
            parent = key
        self._hashed[seq], self._chain[seq] = len(self.tables[seq]), parent
        reused = len(self.tables[seq]) * self.block_size
        self.stats.hit_tokens += reused
        return reused

    def reserve(self, seq, length: int) -> None:
        """Make ``seq``'s table cover positions [0, length)."""
        table = self.tables[seq]
        while len(table) * self.block_size < length:
            table.append(self._fresh())

    def trim(self, seq, length: int) -> None:
        """Release the blocks of ``seq`` wholly past ``length`` (rejected draft tokens)."""
        table = self.tables[seq]
        keep = -(-length // self.block_size)
        if keep < self._hashed[seq]:
            raise ValueError(f"block pool: cannot trim {seq!r} to {length} tokens, into its committed prefix")
        while len(table) > keep:
            self._release(table.pop())

    def commit(self, seq, tokens: list[int]) -> None:
        """``tokens``: the sequence's committed tokens so far (its KV at these positions is final); keys the full
        blocks among them so later sequences can reuse them."""
        table, done, size = self.tables[seq], self._hashed[seq], self.block_size
        full = min(len(tokens) // size, len(table))
        if not self.reuse or full <= done:
            return
        parent = self._chain[seq]
        for index, key in enumerate(block_hashes(tokens[:full * size], size, parent, done),
                                    start=done):
            block = table[index]
            if key not in self.block_of and block not in self.hash_of:
                self.block_of[key], self.hash_of[block] = block, key
                self.content_of[block] = (index, parent, tuple(tokens[index * size:(index + 1) * size]))
            parent = key
        self._hashed[seq], self._chain[seq] = full, parent

    def committed_blocks(self, seq) -> int:
        """How many leading blocks of ``seq`` are committed (keyed, or found keyed when it opened)."""
        return self._hashed[seq]

    def close(self, seq) -> None:
        """The sequence has left: release its blocks (hashed ones stay cached for later prompts)."""
        for block in reversed(self.tables.pop(seq)):  # the tail first: it is the least likely to be shared
            self._release(block)
        del self._hashed[seq], self._chain[seq]

    # ---- blocks -------------------------------------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Blocks some running sequence holds."""
        return sum(1 for count in self.refs if count)

    def _take(self, block: int) -> None:
        if self.refs[block] == 0:
            self.cached.pop(block, None)
        self.refs[block] += 1

    def _release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.cached[block] = None
            else:
                self.free.append(block)

    def _fresh(self) -> int:
        if self.free:
            block = self.free.pop()
        elif self.capacity < self.max_blocks:
            block = self.capacity
            self.capacity += 1
            self.refs.append(0)
            self.generation.append(0)
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            del self.block_of[self.hash_of.pop(block)], self.content_of[block]
        else:
            raise OutOfBlocks(f"KV cache: all {self.max_blocks} blocks of {self.block_size} tokens are held by "
                              f"running requests; raise build.kv_cache.max_tokens or lower build.max_batch_size")
        self.refs[block] = 1
        self.generation[block] += 1
        return block
