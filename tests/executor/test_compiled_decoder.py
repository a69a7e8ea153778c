"""pipeline/executor/compiled_decoder.py: the lean decoder compiled per width bucket gives the eager decoder's
logits, hidden states and middle layers' outputs for every shape a step takes (prompt chunks beside decodes, a K
sweep, batches, trees, a forward wider than any bucket); after the warm-up nothing compiles again, and a second
start on the same weights loads the packages instead of compiling."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.executor import compiled_decoder
from pipeline.executor.compiled_decoder import CompiledDecoder, bucket, buckets, capped_width, cheapest_routes
from pipeline.executor import paged_attention
from pipeline.executor.model_runner import BatchModelRunner
from pipeline.speculative.tree import TokenTree
from tests.executor.test_llama_decoder import SIZES, _model

MAX_WIDTH = 8  # buckets 1, 2, 4, 8: the warm-up compiles four graphs


def test_buckets_are_powers_of_two_up_to_the_widest_forward():
    assert buckets(1) == [1] and buckets(8) == [1, 2, 4, 8] and buckets(9) == [1, 2, 4, 8, 16]
    assert [bucket(w, buckets(16)) for w in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    with pytest.raises(ValueError, match="wider than the widest compiled bucket"):
        bucket(17, buckets(16))


def test_an_extra_width_is_a_bucket_of_its_own_below_the_widest():
    assert buckets(8, (5,)) == [1, 2, 4, 5, 8] and bucket(5, buckets(8, (5,))) == 5
    assert buckets(8, (4, 8)) == [1, 2, 4, 8]  # already a power of two: compiled once
    assert buckets(4, (5,)) == [1, 2, 4]  # past the widest bucket: the cap holds


def test_no_bucket_is_wider_than_the_cap():
    assert buckets(capped_width(5, 16)) == [1, 2, 4, 8]  # every row's verify fits under the cap
    assert buckets(capped_width(40, 16)) == [1, 2, 4, 8, 16]
    assert buckets(capped_width(12, 10)) == [1, 2, 4, 8]  # 16 would hold 12 but is past the cap
    assert buckets(capped_width(5, 6)) == [1, 2, 4]


def test_the_package_key_covers_the_traced_code(tmp_path, monkeypatch):
    """Packages are reused across starts by key: a changed layer or operator must not load an old package."""
    decoder = BatchModelRunner(_model(LlamaForCausalLM, LlamaConfig), "cpu", max_tokens=64, block_size=8,
                               max_blocks=16)._decoder
    assert all(path.is_file() for path in compiled_decoder.CODE)
    source = tmp_path / "layer.py"
    source.write_text("x = 1\n")
    monkeypatch.setattr(compiled_decoder, "CODE", [*compiled_decoder.CODE, source])
    before = CompiledDecoder(decoder, 4, store=tmp_path).key()
    assert CompiledDecoder(decoder, 4, store=tmp_path).key() == before  # the same everything: the same packages
    source.write_text("x = 2\n")
    assert CompiledDecoder(decoder, 4, store=tmp_path).key() != before


def test_the_store_keeps_recent_keys_and_prunes_old_ones(tmp_path):
    """The key folder in use stays; of the others, the KEPT_KEYS - 1 most recently used stay whatever their age, and
    beyond them only those used within MAX_IDLE_DAYS."""
    from pipeline.executor import compiled_decoder

    day, now = 86400, 1_000_000_000.0
    ages = {"in-use": 400, "a": 100, "b": 200, "c": 300, "d": 5, "e": 500}  # days since last used
    for name, age in ages.items():
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (now - age * day, now - age * day))
    (tmp_path / "not-a-key.txt").write_text("x")
    removed = compiled_decoder.prune_store(tmp_path, tmp_path / "in-use", now=now)
    # newest first: d (5), a (100), b (200) are the KEPT_KEYS - 1 = 3 kept; c (300) and e (500) are idle too long
    assert compiled_decoder.KEPT_KEYS == 4 and sorted(p.name for p in removed) == ["c", "e"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "d", "in-use", "not-a-key.txt"]
    os.utime(tmp_path / "b", (now - 40 * day, now - 40 * day))  # under the limit, old: kept while among the newest
    assert compiled_decoder.prune_store(tmp_path, tmp_path / "in-use", now=now) == []


def test_each_width_runs_on_the_cheapest_bucket_at_least_as_wide():
    assert cheapest_routes({1: 5.0, 2: 4.0, 4: 6.0, 8: 5.5}) == {1: 2, 2: 2, 4: 8, 8: 8}
    assert cheapest_routes({1: 3.0, 2: 4.0, 4: 4.0}) == {1: 1, 2: 2, 4: 4}  # a tie keeps the narrower


def _runners(store):
    eager = BatchModelRunner(_model(LlamaForCausalLM, LlamaConfig), "cpu", max_tokens=200, block_size=8,
                             max_blocks=64, aux_layers=(0,))
    with mock.patch.dict(os.environ, {"SPECPIPE_CACHE": str(store)}):
        compiled = BatchModelRunner(_model(LlamaForCausalLM, LlamaConfig), "cpu", max_tokens=200, block_size=8,
                                    max_blocks=64, compile=True, max_width=MAX_WIDTH, aux_layers=(0,))
    return eager, compiled


def _same(a, b, what):
    for x, y in zip(a, b):
        assert x.shape == y.shape and (x - y).abs().max() < 1e-5, what


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    return _runners(tmp_path_factory.mktemp("specpipe-cache"))


@pytest.mark.slow  # compiled parity: the warm-up compiles four graphs
def test_compiled_steps_equal_eager_and_nothing_compiles_after_warm_up(runners):
    eager, compiled = runners
    decoder = compiled.compiled
    assert decoder.sizes == [1, 2, 4, 8] and decoder.warm_up_s > 0 and decoder.built == 4
    assert set(decoder.bucket_ms) == set(decoder.route) == {1, 2, 4, 8}
    assert all(decoder.route[w] >= w and decoder.bucket_ms[decoder.route[w]] <= decoder.bucket_ms[w] for w in (1, 2, 4))
    assert compiled.cache.preallocate and not eager.cache.preallocate
    vocab = SIZES["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompt = {name: torch.randint(0, vocab, (n,), generator=gen).tolist() for name, n in (("a", 11), ("b", 6),
                                                                                           ("c", 3))}
    tree = TokenTree.from_choices([[0], [1], [1, 0]])  # root + 3 nodes

    def both(seqs, rows, **kwargs):
        out = [runner.forward(seqs, rows, hidden=True, **kwargs) for runner in (eager, compiled)]
        _same(out[0], out[1], (seqs, [len(r) for r in rows], kwargs))
        _same(eager.aux_hidden, compiled.aux_hidden, "a layer's output of every token")  # not the padding's

    for runner in (eager, compiled):
        for name, ids in prompt.items():
            runner.open(name, ids)
    both(["a", "b"], [prompt["a"][:7], prompt["b"]], logits_for=[1, 2])  # two prompt chunks: 13 tokens, eager
    both(["a"], [prompt["a"][7:]], logits_for=[1])  # the rest of a chunk, 4 tokens, one logit
    for k in range(6):  # a K sweep: verifies of 1 to 6 tokens, rolled back
        both(["a"], [list(range(5, 6 + k))])
        for runner in (eager, compiled):
            runner.truncate("a", 11)
    both(["a", "b", "c"], [[1, 2, 3], [4], [5, 6]])  # a batch of three rows, 6 tokens
    both(["a", "c"], [[7, 8, 9, 10], [11]], trees=[tree, None])  # a tree beside a decode
    assert decoder.built == 4, "a step compiled after the warm-up"
    assert decoder.eager_calls == 1  # only the 13-token chunk was wider than the widest bucket


@pytest.mark.slow  # loads the packages the test above compiled
def test_a_second_start_loads_the_packages_and_new_weights_compile_anew(runners, tmp_path):
    eager, compiled = runners
    first = compiled.compiled
    again = CompiledDecoder(first.decoder, MAX_WIDTH, store=first.store)
    again.warm_up()
    assert again.built == 0 and again.folder == first.folder  # everything loaded, nothing compiled
    # the packages hold the weights: private to their owner
    assert first.folder.stat().st_mode & 0o777 == 0o700
    assert {p.stat().st_mode & 0o777 for p in first.folder.glob("*.pt2")} == {0o600}
    ids, positions = torch.tensor([3, 1, 4]), torch.tensor([0, 1, 2])
    with torch.inference_mode():  # where the runner calls them (the pools are inference tensors)
        with paged_attention.active(*_plan(compiled, ids)):
            loaded = again.step(ids, positions, torch.tensor([2]))
        with paged_attention.active(*_plan(compiled, ids)):
            fresh = first.step(ids, positions, torch.tensor([2]))
    _same(loaded[:2], fresh[:2], "the loaded packages compute what the compiled ones did")
    # A damaged package is compiled again; the others still load.
    (first.folder / "step-4.pt2").write_bytes(b"not a package")
    damaged = CompiledDecoder(first.decoder, MAX_WIDTH, store=first.store)
    damaged.warm_up()
    assert damaged.built == 1
    # Other weights (frozen into the graphs) are another key: nothing of the first decoder's is reused.
    other = BatchModelRunner(_model(LlamaForCausalLM, LlamaConfig), "cpu", max_tokens=200, block_size=8,
                             max_blocks=64, aux_layers=(0,))._decoder
    with torch.no_grad():
        other.norm.add_(0.5)
    assert CompiledDecoder(other, MAX_WIDTH, store=first.store).key() != first.key()
    assert CompiledDecoder(first.decoder, MAX_WIDTH, store=first.store, autotune=True).key() != first.key()


def _plan(runner, ids):
    """A prepared one-row forward of ``ids`` on a fresh sequence of ``runner``'s cache, rolled back after use."""
    seq = object()
    runner.cache.open(seq, [])
    _, plan = runner.cache.prepare([seq], [len(ids)], "cpu", runner.dtype)
    return plan, runner.cache
