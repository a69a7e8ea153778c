"""KV blocks as bookkeeping, no tensors: which fixed-size blocks each sequence holds, and which hold a known prefix.

A sequence's KV lives in ``block_size``-token blocks listed in its block table (position p is in table[p //
block_size] at offset p % block_size). Blocks are reference counted, so sequences that start with the same tokens
share the blocks of that prefix. A block full of committed tokens (never to change again) gets a hash of its tokens
and of everything before it; a new sequence whose prompt starts with hashed blocks takes them instead of computing
them (prefix reuse). A block nobody holds stays cached until its memory is needed: fresh blocks come from the free
list first, then from growing the pool up to its limit, and only then from evicting the least recently released
cached block; a block a running sequence holds is never evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class OutOfBlocks(RuntimeError):
    """Every block is held by a running sequence: the pool's limit is below what the running requests need."""


@dataclass
class PrefixStats:
    queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    hit_tokens: int = 0  # of those, tokens whose KV was reused instead of computed

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def block_hashes(tokens: list[int], block_size: int, parent: int | None = None, first: int = 0) -> list[int]:
    """Hashes of the full blocks of ``tokens`` from block ``first`` on; each covers its tokens and all before them
    (``parent``: the hash of block ``first - 1``), so equal hashes mean equal prefixes, not just equal blocks."""
    hashes = []
    for start in range(first * block_size, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start:start + block_size])))
        hashes.append(parent)
    return hashes


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
        self.cached: OrderedDict[int, None] = OrderedDict()  # released hashed blocks, least recently released first
        self.hash_of: dict[int, int] = {}  # block -> prefix hash
        self.block_of: dict[int, int] = {}  # prefix hash -> block
        self.tables: dict[object, list[int]] = {}  # sequence -> its blocks in order
        self._hashed: dict[object, int] = {}  # sequence -> how many of its leading blocks are hashed
        self.stats = PrefixStats()

    # ---- per sequence -----------------------------------------------------------------------------------------

    def open(self, seq, prompt: list[int]) -> int:
        """Start ``seq``; returns how many leading tokens of ``prompt`` already have KV (whole cached blocks, never
        all of ``prompt``: the caller still computes at least its last token)."""
        if seq in self.tables:
            raise ValueError(f"block pool: sequence {seq!r} is already open")
        self.tables[seq], self._hashed[seq] = [], 0
        if not self.reuse:
            return 0
        self.stats.queried_tokens += len(prompt)
        usable = (len(prompt) - 1) // self.block_size  # whole blocks strictly before the last token
        for prefix in block_hashes(prompt[:usable * self.block_size], self.block_size):
            block = self.block_of.get(prefix)
            if block is None:
                break
            self._take(block)
            self.tables[seq].append(block)
        self._hashed[seq] = len(self.tables[seq])
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
        """``tokens``: the sequence's committed tokens so far (its KV at these positions is final); hashes the full
        blocks among them so later sequences can reuse them."""
        table, done = self.tables[seq], self._hashed[seq]
        full = min(len(tokens) // self.block_size, len(table))
        if not self.reuse or full <= done:
            return
        parent = self.hash_of.get(table[done - 1]) if done else None
        for index, prefix in enumerate(block_hashes(tokens[:full * self.block_size], self.block_size, parent, done),
                                       start=done):
            block = table[index]
            if prefix not in self.block_of and block not in self.hash_of:
                self.block_of[prefix], self.hash_of[block] = block, prefix
        self._hashed[seq] = full

    def close(self, seq) -> None:
        """The sequence has left: release its blocks (hashed ones stay cached for later prompts)."""
        for block in reversed(self.tables.pop(seq)):  # the tail first: it is the least likely to be shared
            self._release(block)
        del self._hashed[seq]

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
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            del self.block_of[self.hash_of.pop(block)]
        else:
            raise OutOfBlocks(f"KV cache: all {self.max_blocks} blocks of {self.block_size} tokens are held by "
                              f"running requests; raise build.kv_cache.max_tokens or lower build.max_batch_size")
        self.refs[block] = 1
        return block
