"""pipeline/executor/matmul_choice.py: both forms compute the same product, the plan takes the fastest measured form
per width, and a decoder on either form gives the modules' logits."""

from __future__ import annotations

import pytest
import torch

from pipeline.executor import matmul_choice, row_kernels
from pipeline.executor.matmul_choice import KINDS, KernelPlan, measure, product


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_the_same_product(kind, bias):
    if kind == "rows" and row_kernels.unavailable():
        pytest.skip(f"the rows kernel: {row_kernels.unavailable()}")
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(5, 32, generator=gen), torch.randn(40, 32, generator=gen)
    b = torch.randn(40, generator=gen) if bias else None
    expected = x @ weight.T + (b if bias else 0)
    out = product(kind, x, weight, b)
    assert torch.allclose(out, expected, atol=1e-5)
    # rows of stride 1, as F.linear gives them: a strided q, k or v sends SDPA to its slow math path
    assert out.is_contiguous()


def test_widened_is_offered_for_16_bit_weights_and_rounds_the_float32_product_once():
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(70, 32, generator=gen).bfloat16(), torch.randn(40, 32, generator=gen).bfloat16()
    bias = torch.randn(40, generator=gen).bfloat16()
    out = product("widened", x, weight, bias)
    exact = x.double() @ weight.double().T + bias.double()
    assert out.dtype == torch.bfloat16 and ((out.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-4).all()
    assert "widened" in matmul_choice.kinds_for([weight])
    assert "widened" not in matmul_choice.kinds_for([weight.float()])
    assert "widened" not in matmul_choice.kinds_for([weight, weight.float()])


def test_the_plan_takes_the_fastest_form_per_width(monkeypatch):
    costs = {("linear", 1): 1.0, ("w_xt", 1): 2.0, ("linear", 2): 3.0, ("w_xt", 2): 1.5, ("linear", 4): 2.0,
             ("w_xt", 4): 2.5, ("linear", 8): 2.0, ("w_xt", 8): 1.9}
    monkeypatch.setattr(matmul_choice, "_pass", lambda kind, weights, inputs, width: costs[kind, width] / 1e3)
    plan = measure([torch.zeros(8, 4)], widths=(1, 2, 4, 8), rounds=2)
    # w_xt only where clearly faster: at 8 it is 5% faster, within the noise, and F.linear stays
    assert plan.by_width == {1: "linear", 2: "w_xt", 4: "linear", 8: "linear"}
    # a width not measured runs as the narrowest measured width at least as wide; past them all, as the widest
    uneven = KernelPlan({1: "w_xt", 4: "rows", 64: "widened"})
    assert [uneven.kind(w) for w in (1, 2, 3, 4, 5, 64, 500)] == ["w_xt", "rows", "rows", "rows", "widened",
                                                                "widened", "widened"]
    assert plan.times_ms[("w_xt", 2)] == pytest.approx(1.5)
    assert plan.to_dict()["by_width"] == {"1": "linear", "2": "w_xt", "4": "linear", "8": "linear"}


def test_a_real_measurement_covers_every_width():
    weights = [torch.randn(64, 32), torch.randn(32, 64)]
    plan = measure(weights, widths=(1, 3), rounds=1)
    kinds = matmul_choice.kinds_for(weights)  # rows where its kernel loads on this machine
    assert set(plan.by_width) == {1, 3} and set(plan.by_width.values()) <= set(kinds)
    assert all(ms > 0 for ms in plan.times_ms.values()) and len(plan.times_ms) == 2 * len(kinds)


def test_an_empty_plan_is_f_linear_throughout():
    assert KernelPlan().kind(1) == "linear"
    assert matmul_choice.weight_bytes([torch.zeros(10, 10)]) == 400


def test_matrices_of_the_same_shapes_are_timed_once_per_process(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path))
    monkeypatch.setattr(matmul_choice, "_PLANS", {})
    monkeypatch.setattr(matmul_choice, "_pass", lambda kind, weights, inputs, width: calls.append(width) or 1e-3)
    first = matmul_choice.measured_once([torch.zeros(8, 4), torch.zeros(4, 8)])
    timed = len(calls)
    assert matmul_choice.measured_once([torch.ones(8, 4), torch.ones(4, 8)]) is first and len(calls) == timed
    matmul_choice.measured_once([torch.zeros(8, 4, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)])
    assert len(calls) > timed  # another dtype is timed on its own


def test_a_plan_is_kept_on_disk_for_the_next_start_per_thread_count_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path))
    costs = {("linear", w): 2.0 for w in matmul_choice.WIDTHS} | {("w_xt", w): 1.0 for w in matmul_choice.WIDTHS}
    calls = []

    def timed(kind, weights, inputs, width):
        calls.append(width)
        return costs[kind, width] / 1e3

    monkeypatch.setattr(matmul_choice, "_pass", timed)
    weights = [torch.zeros(8, 4), torch.zeros(4, 8)]
    monkeypatch.setattr(matmul_choice, "_PLANS", {})
    first = matmul_choice.measured_once(weights)
    assert first.kind(2) == "w_xt" and calls
    (saved,) = (tmp_path / "kernel-plans").glob("*.json")
    calls.clear()
    monkeypatch.setattr(matmul_choice, "_PLANS", {})  # a new process
    again = matmul_choice.measured_once(weights)
    assert calls == [] and again == first  # read back, not timed
    saved.write_text("{not json")  # a damaged file is measured again and rewritten
    monkeypatch.setattr(matmul_choice, "_PLANS", {})
    assert matmul_choice.measured_once(weights) == first and calls
    calls.clear()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # another thread count: its own plan
        monkeypatch.setattr(matmul_choice, "_PLANS", {})
        matmul_choice.measured_once(weights)
    finally:
        torch.set_num_threads(threads)
    assert calls and len(list((tmp_path / "kernel-plans").glob("*.json"))) == 2
    calls.clear()
    # a CPU of the same model name with other instruction sets (one EPYC with AVX-512, one without): its own plan
    monkeypatch.setattr(matmul_choice, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    monkeypatch.setattr(matmul_choice, "_PLANS", {})
    matmul_choice.measured_once(weights)
    assert calls and len(list((tmp_path / "kernel-plans").glob("*.json"))) == 3
