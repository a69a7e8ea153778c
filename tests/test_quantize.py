"""pipeline/quantize.py: int8 weight-only layers, what replacing a model's layers does, and what it costs.

The speculative-decoding claim for a quantized target is "greedy output equals the QUANTIZED target's own
target-only output"; that rests on each row of a forward being computed from its own activations alone, tested
here bitwise, and end to end on the tiny pair (float32 and bfloat16 activations).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipeline.executor import SpeculativeExecutor
from pipeline.quantize import Int8WeightOnlyLinear, logit_error, quantize_model, weight_bytes
from tests.conftest import load_tiny_models

PROMPTS = ["def add(a, b):\n    return", "for i in range(10):", "import numpy as np\n"]


def _dequantized_reference(layer: Int8WeightOnlyLinear, x: torch.Tensor) -> torch.Tensor:
    weight = layer.qweight.float() * layer.scale.float()[:, None]
    bias = None if layer.bias is None else layer.bias.float()
    return nn.functional.linear(x.float(), weight, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96, 64), (5, 48), (259, 40), (7, 37)], ids=str)  # 40, 37: unpacked
def test_int8_layer_equals_its_dequantized_matrix(dtype, shape):
    torch.manual_seed(0)
    out_features, in_features = shape
    linear = nn.Linear(in_features, out_features, bias=True).to(dtype)
    layer = Int8WeightOnlyLinear.from_linear(linear)
    x = torch.randn(2, 5, in_features, dtype=dtype)
    got = layer(x)
    assert got.shape == (2, 5, out_features) and got.dtype == dtype
    ref = _dequantized_reference(layer, x)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert (got.float() - ref).abs().max() <= tolerance * ref.abs().max()
    # ... and the dequantized matrix is within half a quantization step of the original weights, per channel
    step = layer.scale.float()[:, None]
    dequantized = layer.qweight.float() * step
    assert ((dequantized - linear.weight.float()).abs() <= step * 0.51).all()


def test_each_row_is_computed_alone():
    """A row's output does not depend on the other rows of the forward (the verify pass's K+1 positions, other
    requests), bit for bit: the property that keeps a quantized target's greedy output the same with and without
    speculation."""
    torch.manual_seed(1)
    layer = Int8WeightOnlyLinear.from_linear(nn.Linear(64, 300, bias=False).to(torch.bfloat16))
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    together = layer(x)
    assert torch.equal(torch.cat([layer(x[i:i + 1]) for i in range(9)]), together)
    assert torch.equal(layer(x[:5]), together[:5])


def test_zero_rows_and_extremes_quantize_exactly():
    linear = nn.Linear(16, 3, bias=False)
    with torch.no_grad():
        linear.weight.zero_()
        linear.weight[1, 0] = 2.0  # the row's absmax: exactly 127 steps
        linear.weight[2] = torch.linspace(-1, 1, 16)
    layer = Int8WeightOnlyLinear.from_linear(linear)
    assert layer.qweight[0].abs().sum() == 0 and layer.scale[0] == 1
    assert layer.qweight[1, 0] == 127 and layer.qweight[2].abs().max() == 127
    assert torch.allclose(layer.weight[1], linear.weight[1])


def test_quantize_model_replaces_linear_layers_and_counts_bytes(tiny_pair):
    target, _, _ = load_tiny_models(tiny_pair)
    linears = sum(type(m) is nn.Linear for m in target.modules())
    before = weight_bytes(target)
    report = quantize_model(target, "int8_weight_only")
    assert report.layers == linears and not any(type(m) is nn.Linear for m in target.modules())
    assert report.bytes_before == before and report.bytes_after == weight_bytes(target) < before
    # The LM head is the largest matrix; its int8 copy is a quarter of its float32 bytes (plus one scale a row).
    head = target.get_output_embeddings()
    assert isinstance(head, Int8WeightOnlyLinear) and head.qweight.dtype == torch.int8
    assert quantize_model(target, "none").layers == 0
    with pytest.raises(ValueError, match="fp8"):
        quantize_model(target, "fp8")


def test_weight_bytes_counts_a_tied_matrix_once():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    assert weight_bytes(model) == 10 * 4 * 4


def test_int8_error_against_float32_is_bounded_on_the_tiny_pair(tiny_pair):
    """The cost in exactness, measured as the build measures it: int8 weights with float32 and with bfloat16
    activations, and bfloat16 alone, stay close to the float32 model and mostly keep its top-1 token."""
    reference, _, tokenizer = load_tiny_models(tiny_pair)
    ids = torch.tensor([tokenizer("\n".join(PROMPTS))["input_ids"][:64]])
    cases = ((torch.float32, "int8_weight_only", 0.5, 0.9), (torch.bfloat16, "int8_weight_only", 0.75, 0.85),
             (torch.bfloat16, "none", 0.5, 0.9))  # the last: the 16-bit path alone
    for dtype, mode, max_error, agreement in cases:
        quantized = copy.deepcopy(reference).to(dtype)
        quantize_model(quantized, mode)
        error = logit_error(reference, quantized, ids)
        assert 0 < error["max_abs_logit_error"] <= max_error, error
        assert error["top1_agreement"] >= agreement, error
    assert logit_error(reference, reference, ids)["max_abs_logit_error"] == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_pair_is_lossless_against_its_own_target_only_output(tiny_pair, dtype):
    """Greedy speculative output of an int8 target (with an int8 draft) equals that int8 target's target-only
    output, at every K (the accept rule compares against the model that runs, whatever its weights)."""
    executor = SpeculativeExecutor.from_pretrained(tiny_pair / "target", tiny_pair / "draft", max_draft_len=4,
                                                   dtype=dtype, quantization="int8_weight_only",
                                                   draft_quantization="int8_weight_only")
    assert isinstance(executor.target.model.get_output_embeddings(), Int8WeightOnlyLinear)
    assert isinstance(executor.draft.model.get_output_embeddings(), Int8WeightOnlyLinear)
    plain = [r.token_ids for r in executor.generate(PROMPTS, 24, max_draft_len=0)]
    for k in (1, 4):
        results = executor.generate(PROMPTS, 24, max_draft_len=k)
        assert [r.token_ids for r in results] == plain, f"K={k}"
        assert sum(r.stats.draft_tokens for r in results) > 0


def test_bfloat16_pair_keeps_its_own_greedy_output_up_to_near_ties(tiny_pair):
    """The 16-bit path without int8: greedy speculative output equals bfloat16 target-only output, except where a
    verify over K+1 positions rounds a near tie the other way (pipeline/parity.py's rule; a wider flip is a bug)."""
    from pipeline.parity import divergence

    executor = SpeculativeExecutor.from_pretrained(tiny_pair / "target", tiny_pair / "draft", max_draft_len=4,
                                                   dtype="bfloat16")
    model = executor.target.model

    @torch.no_grad()
    def next_logits(ids):
        return model(torch.tensor([ids])).logits[0, -1]

    plain = executor.generate(PROMPTS, 24, max_draft_len=0)
    spec = executor.generate(PROMPTS, 24, max_draft_len=4)
    assert sum(r.stats.draft_tokens for r in spec) > 0
    for prompt, a, b in zip(PROMPTS, plain, spec):
        found = divergence(executor.encode(prompt), a.token_ids, b.token_ids, next_logits)
        assert found is None or found.near_tie, found.describe()
