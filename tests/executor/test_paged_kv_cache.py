"""pipeline/executor/paged_kv_cache.py: the plan prepare builds for one short row without a tree (every decode and
verify at batch 1, built from the row's numbers) is the general path's, tensor for tensor."""

from __future__ import annotations

import pytest
import torch

from pipeline.executor import paged_kv_cache
from pipeline.executor.attention_choice import AttentionPlan
from pipeline.executor.paged_kv_cache import PagedKVCache
from pipeline.speculative.tree import TokenTree


def _prepared(block_size: int, start: int, count: int, kernel: str, dtype):
    cache = PagedKVCache(block_size, 64, 512)
    cache.attention = AttentionPlan({16: kernel})
    cache.open("other", list(range(9)))  # another row's blocks first: the row's table is not 0, 1, 2, ...
    cache.pool.reserve("other", 9)
    cache.open("seq", list(range(100, 100 + start)))
    cache.lengths["seq"] = start
    positions, plan = cache.prepare(["seq"], [count], "cpu", dtype)
    return positions, cache.write_slots, plan


@pytest.mark.parametrize("kernel, dtype", [("sdpa", torch.float32), ("paged", torch.bfloat16)])
def test_one_short_row_gets_the_general_paths_plan(monkeypatch, kernel, dtype):
    for block_size in (4, 16):
        for start in (0, 1, 3, 15, 16, 37):
            for count in (1, 2, 5, 16):
                fast = _prepared(block_size, start, count, kernel, dtype)
                with monkeypatch.context() as general:
                    general.setattr(paged_kv_cache, "SHORT_ROW", 0)  # the row as a group of its own, the general way
                    expected = _prepared(block_size, start, count, kernel, dtype)
                case = f"block size {block_size}, start {start}, {count} tokens"
                for got, want in zip(fast[:2], expected[:2]):
                    assert got.dtype == want.dtype and torch.equal(got, want), case
                (group,), (want,) = fast[2].groups, expected[2].groups
                assert fast[2].tokens == expected[2].tokens == count, case
                for name in ("query_index", "slots", "tokens", "blocks", "mask"):
                    got, should = getattr(group, name), getattr(want, name)
                    assert got.dtype == should.dtype and got.shape == should.shape, (case, name)
                    assert torch.equal(got, should), (case, name)
                assert (group.dense, group.kernel) == (want.dense, want.kernel) == (True, kernel), case


def test_a_short_row_with_a_tree_or_beside_another_row_takes_the_general_path(monkeypatch):
    calls = []
    monkeypatch.setattr(PagedKVCache, "_one_short_row", lambda self, *a: calls.append(a) or None)
    cache = PagedKVCache(4, 64, 512)
    for seq in ("a", "b"):
        cache.open(seq, [1, 2, 3])
        cache.lengths[seq] = 3
    cache.prepare(["a", "b"], [2, 2], "cpu", torch.float32)
    cache.prepare(["a"], [17], "cpu", torch.float32)  # a prompt chunk past SHORT_ROW
    tree = TokenTree.from_choices([[0], [1], [0, 0]])
    _, plan = cache.prepare(["b"], [tree.size], "cpu", torch.float32, trees=[tree])
    assert calls == []
    assert plan.groups[0].mask[0, 0, :, 3:7].eq(0).tolist() == tree.mask.tolist()  # the tree's own mask
