"""pipeline/executor/row_kernels.py: the C++ product for a few rows is F.linear's product, a row's result does not
depend on the other rows or the thread count, what it cannot take is refused, and a machine where it cannot load
says why and keeps aten's products."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.executor import matmul_choice, row_kernels
from pipeline.quantize import Int8WeightOnlyLinear

REASON = row_kernels.unavailable()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"the rows kernel cannot run here: {REASON}")


def _inputs(rows, dtype, n=37, k=48, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return x, weight, bias


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_is_f_linears_product(rows, with_bias):
    x, weight, bias = _inputs(rows, torch.float32)
    bias = bias if with_bias else None
    got = row_kernels.rows_mm(x, weight, bias)
    assert got.shape == (rows, 37) and got.dtype == torch.float32
    assert torch.allclose(got, F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float(),
                          atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("k", [96, 48])  # with AVX512_BF16, rows a multiple of 32 long multiply in pairs; others not
def test_bfloat16_is_the_float32_product_of_the_bfloat16_numbers_rounded_once(rows, k):
    x, weight, bias = _inputs(rows, torch.bfloat16, n=50, k=k)
    got = row_kernels.rows_mm(x, weight, bias)
    exact = F.linear(x.double(), weight.double(), bias.double())
    assert got.dtype == torch.bfloat16
    # float32 accumulation, then one rounding to bfloat16: within half a bfloat16 step of the exact value (plus a
    # little for float32's own sums)
    assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-4).all()


def _int8_layer(n=37, k=48, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(k, n, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen))
        linear.bias.copy_(torch.randn(n, generator=gen))
    return Int8WeightOnlyLinear.from_linear(linear)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("k", [16, 48, 80])  # whole groups of the kernel's two accumulators, and a partial one
def test_int8_is_the_layers_product_with_its_row_scales_and_bias(dtype, rows, k):
    layer = _int8_layer(k=k, dtype=dtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = row_kernels.rows_mm_int8(x, layer)
    exact = x.double() @ layer.qweight.double().T * layer.scale.double() + layer.bias.double()
    assert got.shape == (rows, 37) and got.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(got.double(), exact, atol=1e-5, rtol=1e-5)
    else:  # float32 sums, rounded once to bfloat16
        assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-4).all()
    assert torch.allclose(got.float(), layer(x).float(), atol=0.05, rtol=0.02)  # the layer's forward rounds twice


@needs_kernel
def test_an_int8_layers_float32_scales_follow_the_layer_and_any_scale_layout_gives_one_result():
    """rows_mm_int8 passes float32 copies of the layer's scale and bias, made once: a layer given new ones (as fusing
    gives its rows views of the fused scale) is multiplied by those; the operator takes 16-bit or strided ones too."""
    layer = _int8_layer(dtype=torch.bfloat16)
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(4)).bfloat16()
    first = row_kernels.rows_mm_int8(x, layer)
    layer.scale = layer.scale * 2
    layer.bias = torch.nn.Parameter(layer.bias * 2, requires_grad=False)
    assert torch.equal(row_kernels.rows_mm_int8(x, layer), first * 2)  # doubling is exact in every format
    ops = torch.ops.specpipe_rows
    strided = torch.stack([layer.scale.float(), torch.zeros(37)], dim=1)[:, 0]  # float32, not contiguous
    assert not strided.is_contiguous()
    expected = ops.rows_mm_int8(x, layer.qweight, layer.scale.float(), layer.bias.float())
    for scale, bias in ((layer.scale, layer.bias), (strided, layer.bias.float())):
        assert torch.equal(ops.rows_mm_int8(x, layer.qweight, scale, bias), expected)


@needs_kernel
def test_an_int8_rows_result_does_not_depend_on_its_neighbours_or_the_thread_count():
    layer = _int8_layer(n=300, k=80, dtype=torch.bfloat16)
    x = torch.randn(16, 80, generator=torch.Generator().manual_seed(3)).bfloat16()
    together = row_kernels.rows_mm_int8(x, layer)
    for i in range(16):
        assert torch.equal(row_kernels.rows_mm_int8(x[i:i + 1], layer), together[i:i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = row_kernels.rows_mm_int8(x, layer)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)


def test_the_plan_times_an_int8_layers_forward_against_the_rows_kernel(monkeypatch):
    layers = [_int8_layer(n=8, k=32), _int8_layer(n=32, k=16)]
    monkeypatch.setattr(row_kernels, "_state", {"reason": None})
    assert matmul_choice.kinds_for(layers) == ("linear", "rows")
    assert row_kernels.supports(torch.bfloat16, layers[0]) and not row_kernels.supports(torch.bfloat16, layers[0].scale)
    assert "rows" not in matmul_choice.kinds_for(layers + [_int8_layer(n=8, k=24)])
    monkeypatch.setattr(row_kernels, "_state", {"reason": "needs AVX2"})
    assert matmul_choice.kinds_for(layers) == ("linear",)
    assert matmul_choice.weight_bytes(layers) == 8 * 32 + 32 * 16 + 4 * (8 + 32)


@needs_kernel
def test_the_rows_kind_multiplies_an_int8_layer_in_the_kernel_and_linear_calls_it():
    layer = _int8_layer(k=48, dtype=torch.bfloat16)
    x = torch.randn(3, 48).bfloat16()
    assert torch.equal(matmul_choice.product("rows", x, layer, None), row_kernels.rows_mm_int8(x, layer))
    assert torch.equal(matmul_choice.product("linear", x, layer, None), layer(x))
    wide = torch.randn(row_kernels.MAX_ROWS + 1, 48).bfloat16()
    assert torch.equal(matmul_choice.product("rows", wide, layer, None), layer(wide))
    # a forward that reads no logits hands the LM head no rows: aten's product, not the kernel's refusal
    assert matmul_choice.product("rows", x[:0], layer, None).shape == (0, 37)
    assert matmul_choice.product("rows", x[:0], layer.weight, None).shape == (0, 37)


@needs_kernel
@pytest.mark.parametrize("dtype,k", [(torch.float32, 64), (torch.bfloat16, 64), (torch.bfloat16, 80)])
def test_a_rows_result_does_not_depend_on_its_neighbours_or_the_thread_count(dtype, k):
    x, weight, bias = _inputs(16, dtype, n=300, k=k)
    together = row_kernels.rows_mm(x, weight, bias)
    for i in range(16):
        assert torch.equal(row_kernels.rows_mm(x[i:i + 1], weight, bias), together[i:i + 1])
    assert torch.equal(row_kernels.rows_mm(x[3:10], weight, bias), together[3:10])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = row_kernels.rows_mm(x, weight, bias)
        torch.set_num_threads(2)
        split = row_kernels.rows_mm(x, weight, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together) and torch.equal(split, together)


@needs_kernel
def test_the_library_splits_its_rows_between_torchs_threads():
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert row_kernels.threads() == count  # one, built without OpenMP
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_what_the_kernel_cannot_take_is_refused():
    x, weight, _ = _inputs(17, torch.float32)
    with pytest.raises(RuntimeError, match="1 to 16 rows"):
        row_kernels.rows_mm(x, weight, None)
    with pytest.raises(RuntimeError, match="one dtype"):
        row_kernels.rows_mm(x[:2].to(torch.bfloat16), weight, None)
    assert not row_kernels.supports(torch.float32, torch.zeros(8, 40))  # rows not a multiple of 16 long
    assert not row_kernels.supports(torch.float32, torch.zeros(40, 8).T)  # not contiguous
    assert not row_kernels.supports(torch.float16, torch.zeros(8, 32, dtype=torch.float16))
    assert not row_kernels.supports(torch.bfloat16, torch.zeros(8, 32))  # inputs of another dtype
    assert row_kernels.supports(torch.bfloat16, torch.zeros(8, 32, dtype=torch.bfloat16))


@needs_kernel
def test_product_runs_a_forward_wider_than_the_kernel_takes_as_f_linear():
    x, weight, bias = _inputs(20, torch.float32)
    assert torch.allclose(matmul_choice.product("rows", x, weight, bias), F.linear(x, weight, bias), atol=1e-5)


def test_where_it_cannot_load_it_says_why(monkeypatch):
    monkeypatch.setenv(row_kernels.OFF_SWITCH, "1")
    assert "turned off" in row_kernels._load()
    monkeypatch.delenv(row_kernels.OFF_SWITCH)
    monkeypatch.setattr(row_kernels.platform, "machine", lambda: "aarch64")
    assert "x86-64" in row_kernels._load()
    monkeypatch.setattr(row_kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(row_kernels, "cpu_flags", lambda: frozenset({"avx", "avx2"}))
    assert "AVX2 and FMA" in row_kernels._load() and "(fma missing" in row_kernels._load()


def test_the_build_targets_the_widest_instruction_set_the_cpu_has():
    avx2, avx512 = frozenset({"avx2", "fma"}), frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
    assert row_kernels.instruction_set(avx2) == ("avx2", ["-O3", "-ffp-contract=off", "-fopenmp", "-mavx2", "-mfma"])
    name, flags = row_kernels.instruction_set(avx2 | avx512)
    assert name == "avx512" and "-mavx512f" in flags and "-mavx2" not in flags and "-DSPECPIPE_DPBF16" not in flags
    name, flags = row_kernels.instruction_set(avx2 | avx512 | {"avx512_bf16"})
    assert name == "avx512+bf16" and "-mavx512bf16" in flags and "-DSPECPIPE_DPBF16" in flags
    assert "avx512f" not in str(row_kernels.instruction_set(avx512 - {"avx512bw"} | avx2))  # AVX2 then
    assert "fma missing" in row_kernels.instruction_set(frozenset({"avx2"}))


@pytest.mark.slow  # one C++ compile at -O0, about 15 s
def test_the_sources_compile_for_the_instruction_set_this_cpu_does_not_build(tmp_path):
    """The library loads only this CPU's build, so a source that compiles for AVX2 but not for AVX-512 (an
    intrinsic whose flag the other set lacks) would fail only on the other kind of machine: compile it here."""
    import shutil
    import subprocess
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    compiler = shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    here = row_kernels.instruction_set(row_kernels.cpu_flags())
    avx512 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})
    other = row_kernels.instruction_set(avx512 if isinstance(here, str) or here[0] == "avx2" else
                                        frozenset({"avx2", "fma"}))
    includes = [f"-I{row_kernels.CSRC}", f"-isystem{sysconfig.get_paths()['include']}",
                *(f"-isystem{path}" for path in include_paths())]
    # Every source in one translation unit: torch's headers, most of a compile's time, are read once. -O0 last:
    # the flags' -O3 would triple the time and check nothing more.
    unit = tmp_path / "all_sources.cpp"
    unit.write_text("".join(f'#include "{source}"\n' for source in row_kernels.SOURCES))
    done = subprocess.run([compiler, "-c", "-std=c++20", "-fPIC", *other[1], "-O0", *includes, str(unit),
                           "-o", "/dev/null"], capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 0, f"the sources for {other[0]}: {errors[:3] or done.stderr[-500:]}"


def test_a_failed_build_is_a_reason_not_an_error(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("Error building extension: c++: not found")

    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path))
    monkeypatch.delenv(row_kernels.OFF_SWITCH, raising=False)
    monkeypatch.setattr(row_kernels, "cpu_flags",
                        lambda: frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"}))
    monkeypatch.setattr(row_kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    reason = row_kernels._load()
    assert reason.startswith("its C++ build failed") and "c++: not found" in reason


def test_the_plan_offers_rows_only_where_it_loads_and_takes_every_matrix(monkeypatch):
    bf16 = [torch.zeros(8, 32, dtype=torch.bfloat16), torch.zeros(32, 16, dtype=torch.bfloat16)]
    monkeypatch.setattr(row_kernels, "_state", {"reason": None})
    assert "rows" in matmul_choice.kinds_for(bf16)
    assert "rows" not in matmul_choice.kinds_for(bf16 + [torch.zeros(8, 24, dtype=torch.bfloat16)])
    monkeypatch.setattr(row_kernels, "_state", {"reason": "needs AVX-512"})
    assert matmul_choice.kinds_for(bf16) == ("linear", "w_xt", "widened")


def test_the_plan_takes_rows_where_clearly_fastest_and_never_past_its_widest(monkeypatch):
    timed = []

    def cost(kind, weights, inputs, width):
        timed.append((kind, width))
        return {"linear": 2.0, "w_xt": 1.7, "rows": 1.0 if width <= 2 else 1.9}[kind] / 1e3

    monkeypatch.setattr(matmul_choice, "_pass", cost)
    plan = matmul_choice.measure([torch.zeros(8, 32)], widths=(1, 2, 4, 32), rounds=1,
                                 kinds=("linear", "w_xt", "rows"))
    assert plan.by_width == {1: "rows", 2: "rows", 4: "w_xt", 32: "w_xt"}
    assert ("rows", 32) not in timed and ("rows", 32) not in plan.times_ms


def test_state_says_what_was_tried_without_trying(monkeypatch):
    monkeypatch.setattr(row_kernels, "_state", {})
    assert row_kernels.state() == "not tried" and row_kernels._state == {}
    threads = torch.get_num_threads()
    monkeypatch.setattr(row_kernels, "_state", {"reason": None})
    assert row_kernels.state() == f"loaded (?, {threads} of {threads} threads)"
    monkeypatch.setattr(row_kernels, "_state", {"reason": None, "isa": "avx2"})
    assert row_kernels.state() == f"loaded (avx2, {threads} of {threads} threads)"
    monkeypatch.setattr(row_kernels, "_state", {"reason": "turned off by SPECPIPE_NO_ROW_KERNEL"})
    assert row_kernels.state() == "turned off by SPECPIPE_NO_ROW_KERNEL"


def test_a_lock_left_by_a_killed_build_is_removed_a_live_one_kept(tmp_path):
    lock = tmp_path / "lock"
    assert not row_kernels._clear_stale_lock(lock)  # none there
    lock.write_text("")
    mtime = lock.stat().st_mtime
    assert not row_kernels._clear_stale_lock(lock, now=mtime + 5) and lock.exists()  # a build under way
    assert row_kernels._clear_stale_lock(lock, now=mtime + row_kernels.STALE_LOCK_S + 1) and not lock.exists()


def test_a_new_build_of_the_kernel_is_timed_anew(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path))
    monkeypatch.setattr(matmul_choice, "_PLANS", {})
    monkeypatch.setattr(matmul_choice, "_pass", lambda kind, weights, inputs, width: 1e-3)
    weights = [torch.zeros(8, 32), torch.zeros(32, 16)]
    monkeypatch.setattr(row_kernels, "_state", {"reason": None, "build": "first"})
    matmul_choice.measured_once(weights)
    monkeypatch.setattr(row_kernels, "_state", {"reason": None, "build": "second"})
    matmul_choice.measured_once(weights)
    assert len(list((tmp_path / "kernel-plans").glob("*.json"))) == 2  # one plan per build
    assert row_kernels.build() == "second"
    monkeypatch.setattr(row_kernels, "_state", {"reason": "needs AVX-512"})
    assert row_kernels.build() is None


def test_a_build_folder_others_can_write_is_refused(tmp_path):
    """The process loads the library it finds there: a folder (or its parent) writable by others could hold
    someone else's code."""
    parent, folder = tmp_path / "extensions", tmp_path / "extensions" / "rows_mm-x"
    folder.mkdir(parents=True, mode=0o700)
    parent.chmod(0o700)
    assert row_kernels._not_private(folder) is None
    folder.chmod(0o777)
    assert "not private" in row_kernels._not_private(folder) and "SPECPIPE_CACHE" in row_kernels._not_private(folder)
    folder.chmod(0o700)
    parent.chmod(0o757)  # others may replace the folder itself
    assert str(parent) in row_kernels._not_private(folder)
    parent.chmod(0o700)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_ops_round_as_the_torch_expressions_they_replace(dtype):
    from pipeline.layer_math import rms_norm, rotate

    gen = torch.Generator().manual_seed(4)
    x, weight = torch.randn(3, 40, generator=gen).to(dtype), torch.randn(40, generator=gen).to(dtype)
    # RMSNorm: only the order of the sum of squares differs (float32 statistics)
    assert (row_kernels.rms_norm(x, weight, 1e-5).float() - rms_norm(x, weight, 1e-5).float()).abs().max() < 1e-5
    qkv, cos, sin = (torch.randn(3, n, generator=gen).to(dtype) for n in (7 * 8, 8, 8))  # 3 + 2 heads of 8, then V
    rotated = qkv.clone()
    row_kernels.rope_(rotated, cos, sin, 5)
    expected = rotate(qkv[:, :40].view(3, 5, 8), cos[:, None], sin[:, None])
    assert torch.equal(rotated[:, :40].view(3, 5, 8), expected) and torch.equal(rotated[:, 40:], qkv[:, 40:])
    h = torch.randn(3, 2 * 24, generator=gen).to(dtype)
    gated = row_kernels.silu_mul(h)
    assert gated.shape == (3, 24)
    assert (gated.float() - (F.silu(h[:, :24]) * h[:, 24:]).float()).abs().max() < 1e-5
