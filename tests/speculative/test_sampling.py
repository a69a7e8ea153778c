"""pipeline/speculative/sampling.py: temperature, top-k and top-p as probabilities, and their parameter checks."""

from __future__ import annotations

import pytest
import torch

from pipeline.speculative import SamplingParams, logits_to_probs


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
