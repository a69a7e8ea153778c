"""pipeline/executor/attention_choice.py: every kernel computes SDPA's grouped-query attention under any mask over
keys scattered in paged pools, the plan takes a kernel only where it is clearly faster, and a measured plan is kept
per head shape on disk."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.executor import attention_choice, row_kernels
from pipeline.executor.attention_choice import KINDS, AttentionPlan, attend_rows, choose, mask_dtype

BLOCK = 4
LIBRARY = row_kernels.unavailable()


def _runs(kind):
    if kind == "paged" and LIBRARY is not None:
        pytest.skip(f"the row kernels' library: {LIBRARY}")


def _inputs(dtype=torch.float32, n=2, heads=6, kv_heads=2, width=3, length=20, dim=16):
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(n, heads, width, dim, generator=gen).to(dtype)
    key = torch.randn(n, kv_heads, length, dim, generator=gen).to(dtype)
    value = torch.randn(n, kv_heads, length, dim, generator=gen).to(dtype)
    # A ragged mask: row 0 causal over its last keys, row 1 a tree-like pattern (a node sees its root, not its
    # sibling) and fewer keys (a shorter row padded to the group's blocks)
    allowed = torch.ones(n, width, length, dtype=torch.bool)
    allowed[0, :, length - width:] = torch.tril(torch.ones(width, width, dtype=torch.bool))
    allowed[1, :, 12:] = False
    allowed[1, 2, 10] = False
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
    return query, key, value, mask


def _reference(query, key, value, mask, scale):
    """Each query head against its own KV head (h // group), in float64."""
    group = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    scores = query.double() @ k.transpose(-1, -2) * scale + mask.double()
    return torch.softmax(scores, dim=-1) @ v


def _paged(kind, query, key, value, mask, scale):
    """attend_rows over pools holding each row's keys and values in scattered blocks (and other rows' blocks
    between them), the query and output [n, heads, W, d] as _reference's."""
    n, kv_heads, length, dim = key.shape
    blocks = length // BLOCK
    table = torch.randperm(2 * n * blocks, generator=torch.Generator().manual_seed(1))[:n * blocks].view(n, blocks)
    pools = []
    for tensor in (key, value):
        pool = torch.randn(2 * n * blocks, BLOCK, kv_heads, dim).to(tensor.dtype)  # other rows' KV: never read
        pool[table.reshape(-1)] = tensor.transpose(1, 2).reshape(n * blocks, BLOCK, kv_heads, dim)
        pools.append(pool)
    out = attend_rows(kind, query.transpose(1, 2), *pools, table, mask.to(mask_dtype(kind, query.dtype)), scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_every_kernel_computes_grouped_query_attention(kind):
    _runs(kind)
    query, key, value, mask = _inputs()
    out = _paged(kind, query, key, value, mask, 0.3)
    assert out.shape == query.shape and out.dtype == query.dtype
    assert torch.allclose(out.double(), _reference(query, key, value, mask, 0.3), atol=1e-5)
    # the default scale is SDPA's, 1/sqrt(d)
    assert torch.allclose(_paged(kind, query, key, value, mask, None).double(),
                          _reference(query, key, value, mask, 16 ** -0.5), atol=1e-5)


@pytest.mark.skipif(LIBRARY is not None or row_kernels.head_multiple() != 8,
                    reason="heads of 24: the C++ kernel's eight lanes (an AVX2 build)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_plus_plus_kernel_takes_heads_of_its_lane_width(dtype):
    query, key, value, mask = _inputs(dtype, dim=24, width=5, length=40)
    out = _paged("paged", query, key, value, mask, 0.3)
    tolerance = 1e-5 if dtype == torch.float32 else 0.03
    assert (out.double() - _reference(query, key, value, mask, 0.3)).abs().max() < tolerance


@pytest.mark.parametrize("kind", KINDS)
def test_every_kernel_keeps_16_bit_inputs_close_to_float32(kind):
    _runs(kind)
    query, key, value, mask = _inputs(torch.bfloat16)
    out = _paged(kind, query, key, value, mask, 0.3)
    assert out.dtype == torch.bfloat16
    expected = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=mask.float(),
                                              scale=0.3, enable_gqa=True)
    assert (out.float() - expected).abs().max() < 0.03


def test_the_plan_keeps_sdpa_unless_another_kernel_is_clearly_faster():
    times = {("sdpa", 1): 300.0, ("grouped", 1): 120.0, ("sdpa_f32", 1): 80.0,  # the fastest of the others
             ("sdpa", 2): 100.0, ("grouped", 2): 95.0, ("sdpa_f32", 2): 130.0,  # 5% faster: within the noise
             ("sdpa", 8): 200.0, ("grouped", 8): 150.0}  # a float32 plan has no sdpa_f32
    assert choose(times) == {1: "sdpa_f32", 2: "sdpa", 8: "grouped"}
    plan = AttentionPlan(choose(times), times)
    # a width runs as the narrowest measured width at least as wide; past them all (prompt chunks), SDPA
    assert [plan.kind(w) for w in (1, 2, 3, 8, 9, 200)] == ["sdpa_f32", "sdpa", "grouped", "grouped", "sdpa", "sdpa"]
    assert AttentionPlan().kind(1) == "sdpa"
    assert plan.to_dict()["by_width"] == {"1": "sdpa_f32", "2": "sdpa", "8": "grouped"}


def test_a_real_measurement_times_every_kernel_at_every_width():
    plan = attention_choice.measure(torch.bfloat16, torch.device("cpu"), 4, 2, 16, widths=(1, 3), lengths=(32,),
                                    rounds=1)
    assert set(plan.times_us) == {(kind, w) for kind in KINDS if kind != "paged" for w in (1, 3)}
    assert set(plan.by_width) == {1, 3} and set(plan.by_width.values()) <= set(KINDS)
    float32 = attention_choice.measure(torch.float32, torch.device("cpu"), 4, 2, 16, widths=(1,), lengths=(32,),
                                       rounds=1)
    assert {kind for kind, _ in float32.times_us} == {"sdpa", "grouped"}  # float32 copies of float32: no third


def test_a_head_shape_is_measured_once_and_kept_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path))
    calls = []

    def measured(dtype, device, heads, kv_heads, dim, kinds):
        calls.append((dtype, heads, kv_heads, dim))
        return AttentionPlan({1: "grouped", 4: "sdpa"}, {("sdpa", 1): 2.0, ("grouped", 1): 1.0})

    monkeypatch.setattr(attention_choice, "measure", measured)
    monkeypatch.setattr(attention_choice, "_PLANS", {})
    first = attention_choice.measured_once(torch.float32, "cpu", 8, 2, 16)
    assert first.kind(1) == "grouped" and len(calls) == 1
    assert attention_choice.measured_once(torch.float32, "cpu", 8, 2, 16) is first and len(calls) == 1
    attention_choice.measured_once(torch.bfloat16, "cpu", 8, 2, 16)
    assert len(calls) == 2  # another dtype is measured on its own
    monkeypatch.setattr(attention_choice, "_PLANS", {})  # a new process reads the file back
    assert attention_choice.measured_once(torch.float32, "cpu", 8, 2, 16) == first and len(calls) == 2
    for saved in (tmp_path / "kernel-plans").glob("*.json"):
        saved.write_text("{not json")  # a damaged file is measured again
    monkeypatch.setattr(attention_choice, "_PLANS", {})
    attention_choice.measured_once(torch.float32, "cpu", 8, 2, 16)
    assert len(calls) == 3
    # CUDA keeps SDPA without measuring (no GPU is needed to decide that)
    assert attention_choice.measured_once(torch.float16, "cuda", 8, 2, 16) == AttentionPlan() and len(calls) == 3


def test_a_models_heads_come_from_its_config(monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    seen = []
    monkeypatch.setattr(attention_choice, "measured_once",
                        lambda *args, library: seen.append((*args[2:], library)) or AttentionPlan())
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=6, num_key_value_heads=2))
    attention_choice.for_model(llama, "cpu")
    attention_choice.for_model(GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=4)), "cpu")
    assert seen == [(6, 2, 8, True), (4, 4, 8, True)]  # an engine's plan may time the C++ kernel, however small


def test_the_c_plus_plus_kernel_is_timed_only_where_it_can_run(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(row_kernels, "_state", {"reason": None, "isa": "avx2"})  # eight lanes: heads of 24 too
    assert "paged" in attention_choice.kinds_for(torch.float32, cpu, 24, library=True)
    assert "paged" not in attention_choice.kinds_for(torch.float32, cpu, 20, library=True)
    monkeypatch.setattr(row_kernels, "_state", {"reason": None, "isa": "avx512"})
    assert "paged" not in attention_choice.kinds_for(torch.float32, cpu, 24, library=True)
    assert attention_choice.kinds_for(torch.bfloat16, cpu, 64, library=True) == KINDS
    assert attention_choice.kinds_for(torch.float32, cpu, 64, library=True) == ("sdpa", "grouped", "paged")
    assert "paged" not in attention_choice.kinds_for(torch.bfloat16, cpu, 64, library=False)
    assert "paged" not in attention_choice.kinds_for(torch.bfloat16, cpu, 40, library=True)  # head size
    assert "paged" not in attention_choice.kinds_for(torch.float16, cpu, 64, library=True)
    assert "paged" not in attention_choice.kinds_for(torch.bfloat16, torch.device("cuda"), 64, library=True)
    monkeypatch.setattr(row_kernels, "_state", {"reason": "needs AVX2"})
    assert "paged" not in attention_choice.kinds_for(torch.bfloat16, cpu, 64, library=True)


@pytest.mark.skipif(LIBRARY is not None, reason=f"the row kernels' library: {LIBRARY}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_plus_plus_kernel_zeroes_what_attends_to_nothing_and_ignores_the_thread_count(dtype):
    query, key, value, mask = _inputs(dtype, length=600, width=5)  # several chunks of keys
    never = torch.finfo(torch.float32).min  # the engine makes this kernel's masks in float32
    mask = mask.float().masked_fill(mask <= torch.finfo(dtype).min, never)
    mask[1, :, 3] = never  # a padding slot: every key masked
    together = _paged("paged", query, key, value, mask, 0.3)
    assert torch.equal(together[1, :, 3], torch.zeros_like(together[1, :, 3]))
    exact = _reference(query, key, value, mask.masked_fill(mask <= never, -1e30), 0.3)
    live = torch.ones(2, 5, dtype=torch.bool)
    live[1, 3] = False
    tolerance = 1e-5 if dtype == torch.float32 else 0.03
    assert (together.double() - exact).transpose(1, 2)[live].abs().max() < tolerance
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        split = _paged("paged", query, key, value, mask, 0.3)
        torch.set_num_threads(1)
        alone = _paged("paged", query, key, value, mask, 0.3)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(split, together) and torch.equal(alone, together)
    alone_row = _paged("paged", query[:1], key[:1], value[:1], mask[:1], 0.3)
    assert torch.equal(alone_row, together[:1])  # a row's result does not depend on its neighbours
