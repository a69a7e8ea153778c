"""pipeline/executor/block_pool.py: block tables, shared prefixes, trimming and eviction, as pure bookkeeping."""

from __future__ import annotations

import pytest

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
