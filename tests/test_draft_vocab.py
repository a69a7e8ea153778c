"""pipeline/draft_vocab.py: a draft whose head covers part of the vocabulary gives the full head's logits there."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.draft_vocab import CONFIG_KEY, ReducedVocabHead, check_ids, logit_width, reduce_head, vocab_ids

IDS = [1, 4, 5, 9, 17, 30, 63]


def _model(tied: bool):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=tied)).eval()


@pytest.mark.parametrize("tied", [False, True])
def test_the_reduced_head_gives_the_full_heads_logits_at_its_ids(tied):
    full = _model(tied)
    reduced = copy.deepcopy(full)
    setattr(reduced.config, CONFIG_KEY, IDS)
    reduce_head(reduced)
    ids = torch.tensor([[3, 8, 1, 60, 2]])
    with torch.no_grad():
        want, got = full(ids).logits, reduced(ids).logits  # [1, 5, 64] both
    assert got.shape == want.shape and logit_width(reduced) == logit_width(full) == 64
    assert torch.allclose(got[..., IDS], want[..., IDS], atol=1e-6)
    outside = [i for i in range(64) if i not in IDS]
    assert torch.isneginf(got[..., outside]).all()
    probs = torch.softmax(got, dim=-1)  # the draft never proposes a token outside its vocabulary
    assert probs[..., outside].sum() == 0 and torch.allclose(probs.sum(-1), torch.ones(1, 5))


def test_reduce_head_is_a_no_op_without_the_key_and_applies_once():
    model = _model(False)
    head = model.get_output_embeddings()
    reduce_head(model)
    assert model.get_output_embeddings() is head and vocab_ids(model) is None
    setattr(model.config, CONFIG_KEY, IDS)
    reduce_head(model)
    reduced = model.get_output_embeddings()
    reduce_head(model)  # a second executor over the same model object
    assert isinstance(reduced, ReducedVocabHead) and model.get_output_embeddings() is reduced
    assert reduced.weight.shape == (len(IDS), 32)


@pytest.mark.parametrize("ids, problem", [
    ([], "is empty"), ([3, 2], "ascending"), ([1, 1, 2], "ascending"), ([0, 64], "outside the model's 64"),
    ([-1, 2], "outside"), ("1,2", "list of token ids"), ([1.0, 2], "list of token ids")])
def test_bad_ids_are_named(ids, problem):
    assert problem in check_ids(ids, 64)
    model = _model(False)
    setattr(model.config, CONFIG_KEY, ids)
    if ids:
        with pytest.raises(ValueError, match="retrain it with train-draft --vocab"):
            reduce_head(model)
    assert check_ids(IDS, 64) is None
