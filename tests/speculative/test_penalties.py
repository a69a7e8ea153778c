"""adjust_logits against a position-by-position oracle written from the definitions (OpenAI's penalty formula,
the CTRL repetition rule, min_tokens), one plain loop per position with its own history."""

from __future__ import annotations

import pytest
import torch

from pipeline.speculative.penalties import adjust_logits
from pipeline.speculative.sampling_params import LogitsAdjust

VOCAB = 12


def oracle(logits_row, adjust, history, prompt, stop_ids):
    """One position: its logits after ``history`` (the tokens generated before it)."""
    out = [float(x) for x in logits_row]
    for token, bias in adjust.logit_bias:
        out[token] += bias
    if len(history) < adjust.min_tokens:
        for token in stop_ids:
            out[token] = float("-inf")
    for token in range(len(out)):
        count = history.count(token)
        if adjust.repetition_penalty != 1 and (count or token in prompt):
            out[token] = out[token] / adjust.repetition_penalty if out[token] > 0 else \
                out[token] * adjust.repetition_penalty
        out[token] -= adjust.frequency_penalty * count + adjust.presence_penalty * (count > 0)
    return torch.tensor(out)


CASES = {
    "frequency": LogitsAdjust(frequency_penalty=0.7),
    "presence": LogitsAdjust(presence_penalty=-1.3),
    "repetition": LogitsAdjust(repetition_penalty=1.8),
    "bias": LogitsAdjust(logit_bias=((3, 5.0), (7, -100.0))),
    "min_tokens": LogitsAdjust(min_tokens=5),
    "all": LogitsAdjust(0.4, 0.9, 1.3, ((2, 2.5), (5, -3.0)), 4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_position_sees_the_draft_tokens_before_it(case):
    adjust = CASES[case]
    torch.manual_seed(0)
    generated, prompt, stop_ids = [1, 4, 4], [0, 9, 4], [11, 6]
    drafts = [4, 2, 6, 4]
    paths = [drafts[:j] for j in range(len(drafts) + 1)]
    logits = torch.randn(len(paths), VOCAB) * 3
    got = adjust_logits(logits, adjust, generated, prompt, paths, stop_ids)
    for p, path in enumerate(paths):
        want = oracle(logits[p], adjust, generated + path, prompt, stop_ids)
        assert torch.allclose(got[p], want, atol=1e-5), (case, p)
    assert not torch.equal(got, logits)  # the case changes something
    if adjust.frequency_penalty or adjust.presence_penalty or adjust.repetition_penalty != 1 or adjust.min_tokens:
        # positions differ only by their paths: one shared state would give equal rows here
        same = oracle(logits[-1], adjust, generated, prompt, stop_ids)
        assert not torch.allclose(got[-1], same, atol=1e-5)


def test_a_tree_node_sees_only_its_own_ancestors():
    adjust = LogitsAdjust(frequency_penalty=1.0)
    logits = torch.zeros(3, VOCAB)
    got = adjust_logits(logits, adjust, [], [], [[], [5], [7]], [])  # two siblings after the root
    assert got[1, 5] == -1 and got[1, 7] == 0 and got[2, 7] == -1 and got[2, 5] == 0 and (got[0] == 0).all()


def test_neutral_and_input_untouched():
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    got = adjust_logits(logits, LogitsAdjust(frequency_penalty=2.0), [3], [], [[], [3]], [])
    assert torch.equal(logits, before)  # a new tensor: the verify's logits feed the log-probabilities unchanged
    assert got[1, 3] == logits[1, 3] - 4.0
    assert LogitsAdjust().neutral and not LogitsAdjust(min_tokens=1).neutral


@pytest.mark.parametrize("kwargs", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                                    dict(min_tokens=-1)])
def test_out_of_range_values_are_refused_by_name(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        LogitsAdjust(**kwargs)
