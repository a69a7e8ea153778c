"""pipeline/executor/compiled_decoder.py: the lean decoder compiled per width bucket gives the eager decoder's
logits, hidden states and middle layers' outputs for every shape a step takes (prompt chunks beside decodes, a K sweep, batches, trees,
a forward wider than any bucket), and after the warm-up nothing compiles again."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.executor.compiled_decoder import bucket, buckets, compiled_graphs
from pipeline.executor.model_runner import BatchModelRunner
from pipeline.speculative.tree import TokenTree
from tests.executor.test_llama_decoder import SIZES, _model

MAX_WIDTH = 8  # buckets 1, 2, 4, 8: the warm-up compiles eight graphs per runner


def test_buckets_are_powers_of_two_up_to_the_widest_forward():
    assert buckets(1) == [1] and buckets(8) == [1, 2, 4, 8] and buckets(9) == [1, 2, 4, 8, 16]
    assert [bucket(w, buckets(16)) for w in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    with pytest.raises(ValueError, match="wider than the widest compiled bucket"):
        bucket(17, buckets(16))


def _runners():
    eager = BatchModelRunner(_model(LlamaForCausalLM, LlamaConfig), "cpu", max_tokens=200, block_size=8,
                             max_blocks=64, aux_layers=(0,))
    compiled = BatchModelRunner(_model(LlamaForCausalLM, LlamaConfig), "cpu", max_tokens=200, block_size=8,
                                max_blocks=64, compile=True, max_width=MAX_WIDTH, aux_layers=(0,))
    return eager, compiled


def _same(a, b, what):
    for x, y in zip(a, b):
        assert x.shape == y.shape and (x - y).abs().max() < 1e-5, what


@pytest.fixture(scope="module")
def runners():
    return _runners()


@pytest.mark.slow  # torch.compile parity: the warm-up compiles eight graphs (about 25 s on 2 cores)
def test_compiled_steps_equal_eager_and_nothing_recompiles_after_warm_up(runners):
    eager, compiled = runners
    assert compiled.compiled.sizes == [1, 2, 4, 8] and compiled.compiled.warm_up_s > 0
    assert compiled.cache.preallocate and not eager.cache.preallocate
    graphs = compiled_graphs()
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
    assert compiled_graphs() == graphs, "a step recompiled after the warm-up"
    assert compiled.compiled.eager_calls == 1  # only the 13-token chunk was wider than the widest bucket
