"""pipeline/executor/block_pool.py: block tables, shared prefixes, trimming and eviction, as pure bookkeeping."""

from __future__ import annotations

import pytest

from pipeline.executor import block_pool
from pipeline.executor.block_pool import BlockPool, OutOfBlocks, block_hashes


def test_hashes_cover_the_whole_prefix_not_just_the_block():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, different prefix
    assert block_hashes([1, 2, 3, 4, 5, 6, 7], 4) == a[:1]  # a partial block has no hash
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, parent=a[0], first=1) == a[1:]  # continuing from block 1


def test_a_prompt_reuses_committed_blocks_and_computes_at_least_its_last_token():
    pool = BlockPool(block_size=4, max_blocks=16)
    prompt = list(range(10))
    assert pool.open("a", prompt) == 0
    pool.reserve("a", 9)
    pool.commit("a", prompt[:9])  # blocks 0-1 full and final; the third is partial
    assert pool.open("b", prompt) == 8 and pool.tables["b"] == pool.tables["a"][:2]
    assert [pool.refs[block] for block in pool.tables["a"]] == [2, 2, 1]
    # A prompt that is exactly the cached blocks still computes its last token: only the first block is reused.
    assert pool.open("c", prompt[:8]) == 4
    assert pool.open("d", [0, 1, 2, 99, 4, 5, 6, 7, 8]) == 0  # differs inside the first block
    assert pool.stats.queried_tokens == 10 + 10 + 8 + 9 and pool.stats.hit_tokens == 12


def test_trim_releases_blocks_past_the_length_but_never_the_committed_prefix():
    pool = BlockPool(block_size=4, max_blocks=16)
    pool.open("a", list(range(6)))
    pool.reserve("a", 13)
    assert len(pool.tables["a"]) == 4
    pool.trim("a", 9)  # positions 0-8 stay: three blocks
    assert len(pool.tables["a"]) == 3 and len(pool.free) == 1
    pool.commit("a", list(range(9)))
    with pytest.raises(ValueError, match="committed prefix"):
        pool.trim("a", 4)


def test_released_blocks_stay_cached_and_the_least_recently_released_is_evicted_first():
    pool = BlockPool(block_size=2, max_blocks=4)
    for name, tokens in (("a", [1, 2, 3]), ("b", [7, 8, 9])):
        pool.open(name, tokens)
        pool.reserve(name, 2)
        pool.commit(name, tokens[:2])
    pool.close("a")
    pool.close("b")
    assert pool.held == 0 and list(pool.cached) == [0, 1]  # a's block released first
    pool.open("c", [5, 5, 5])
    pool.reserve("c", 6)  # two blocks grow the pool to its limit, the third evicts a's block
    assert pool.capacity == 4 and list(pool.cached) == [1]
    assert pool.open("a2", [1, 2, 3]) == 0 and pool.open("b2", [7, 8, 9]) == 2  # a's prefix is gone, b's is not
    with pytest.raises(OutOfBlocks, match="raise build.kv_cache.max_tokens"):
        pool.reserve("a2", 4)  # every block is held now: c's three and b's shared one


def test_without_reuse_nothing_is_shared_or_counted():
    pool = BlockPool(block_size=2, max_blocks=8, reuse=False)
    pool.open("a", [1, 2, 3])
    pool.reserve("a", 3)
    pool.commit("a", [1, 2, 3])
    pool.close("a")
    assert pool.open("b", [1, 2, 3]) == 0 and not pool.cached and pool.stats.queried_tokens == 0


def _committed(pool, seq, tokens, salt=None):
    """Open ``seq`` for ``tokens``, give it blocks for all of them and commit them (its KV is computed)."""
    reused = pool.open(seq, tokens, salt)
    pool.reserve(seq, len(tokens))
    pool.commit(seq, tokens)
    return reused


def test_a_key_collision_never_hands_out_another_prompts_blocks(monkeypatch):
    """Every block gets the same key: a hit is checked against the block's stored tokens and parent, so a prompt
    never takes blocks computed for other tokens, and an equal prompt still can."""
    monkeypatch.setattr(block_pool, "digest", lambda parent, tokens: bytes(32))  # the unsalted root's value too
    pool = BlockPool(block_size=2, max_blocks=16)
    _committed(pool, "a", [1, 2, 3, 4, 5])
    assert pool.open("b", [7, 8, 3, 4, 5]) == 0  # other first block
    assert pool.open("c", [1, 2, 1, 2, 5]) == 2  # its own first block, then a's first block again: not a child of it
    assert pool.tables["c"] == pool.tables["a"][:1]
    _committed(pool, "d", [9, 9, 9])
    assert pool.open("e", [9, 9, 0]) == 0  # the key is taken by a's block, whose tokens differ


def test_blocks_computed_twice_keep_their_place_in_the_chain():
    """Two sequences compute the same first block (neither found it cached); only one copy is keyed. The other
    sequence's next block must still be keyed as a second block, never as a first one: a prompt that starts with
    that block's tokens has other KV at those positions."""
    pool = BlockPool(block_size=2, max_blocks=16)
    for seq in ("a", "b"):
        pool.open(seq, [1, 2, 3])
        pool.reserve(seq, 3)
    pool.commit("a", [1, 2])
    pool.commit("b", [1, 2])  # a duplicate of a's block: not keyed
    pool.reserve("b", 5)
    pool.commit("b", [1, 2, 3, 4])  # b's second block, in a later commit
    assert pool.open("c", [3, 4, 0]) == 0
    assert pool.open("d", [1, 2, 3, 4, 0]) == 4  # as a second block it is found


def test_a_cache_salt_shares_blocks_only_with_the_same_salt():
    pool = BlockPool(block_size=2, max_blocks=16)
    prompt = [1, 2, 3, 4, 5]
    assert _committed(pool, "alice", prompt, "tenant-a") == 0
    assert pool.open("bob", prompt, "tenant-b") == 0
    assert pool.open("nobody", prompt) == 0
    assert pool.open("alice-again", prompt, "tenant-a") == 4
    _committed(pool, "plain", [1, 2, 3, 4, 6])
    assert pool.open("plain-again", prompt) == 4 and pool.open("bob-again", prompt, "tenant-b") == 0
