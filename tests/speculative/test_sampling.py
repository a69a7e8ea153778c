"""pipeline/speculative/sampling.py: temperature, top-k and top-p as probabilities, and their parameter checks."""

from __future__ import annotations

import pytest
import torch

from pipeline.speculative import SamplingParams, logits_to_probs, sample


def test_sampling_transforms():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    greedy = logits_to_probs(logits, SamplingParams(0.0))
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    top2 = logits_to_probs(logits, SamplingParams(1.0, top_k=2))
    assert (top2[0, 2:] == 0).all() and abs(top2.sum().item() - 1) < 1e-6
    full = logits_to_probs(logits, SamplingParams(1.0))
    nucleus = logits_to_probs(logits, SamplingParams(1.0, top_p=0.7))
    # the top token alone has ~0.61 < 0.7, so exactly two tokens survive
    assert (nucleus[0] > 0).sum().item() == 2 and full[0, 0] < 0.7
    hot = logits_to_probs(logits, SamplingParams(0.5))
    assert hot[0, 0] > full[0, 0]


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)])
def test_sampling_params_validated(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**{"temperature": 1.0, **kwargs})


# ---- tiny temperatures: the limit distribution, never NaN -----------------------------------------------------------

LOGITS = torch.tensor([[2.0, 7.5, -3.0, 7.0], [4.0, -1.0, 4.0, 0.5]])  # row 1: an exact tie for the max


@pytest.mark.parametrize("temperature", [1e-44, 1e-46, 5e-324])
def test_tiny_temperatures_put_all_mass_on_the_argmax(temperature):
    """1e-44 is a float32 denormal and the other two are 0 in float32: dividing the logits by them overflowed to
    NaN. The limit as the temperature goes to 0 is the argmax, shared evenly by exact ties; ordinary temperatures
    still give the plain softmax."""
    for extra in ({}, {"top_k": 2}, {"top_p": 0.9}):
        probs = logits_to_probs(LOGITS, SamplingParams(temperature, **extra))
        assert torch.isfinite(probs).all(), extra
        assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0]], extra
    for ordinary in (0.05, 0.7, 1.0, 3.0):
        torch.testing.assert_close(logits_to_probs(LOGITS, SamplingParams(ordinary)),
                                   torch.softmax(LOGITS / ordinary, -1), rtol=1e-6, atol=1e-7)


def test_sample_refuses_a_row_that_is_not_a_distribution():
    """torch.multinomial on a NaN row stops a GPU with a device-side assert, taking every request down with it."""
    probs = torch.tensor([[0.5, 0.5, 0.0], [float("nan"), 0.5, 0.5]])
    with pytest.raises(ValueError, match="probs: row 1 is not a probability distribution"):
        sample(probs, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="probs: row 0"):
        sample(torch.zeros(1, 3))
    assert sample(probs[:1], torch.Generator().manual_seed(0)).item() in (0, 1)
