"""`dtype: auto`: the rule (pipeline/dtypes.py) and what `check` and the stages do with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import dtypes
from pipeline.checks import check_pair, with_resolved_defaults
from pipeline.config import ModelSpec, parse_config
from pipeline.dtypes import checkpoint_dtype, cpu_runs_natively, resolve_dtype
from tests.conftest import tiny_config_dict

NO_FLAGS = frozenset({"avx2", "avx512f"})


def _cpu(native: bool):
    return lambda dtype: dtype == "float32" or native


def test_default_is_auto():
    assert ModelSpec(model="x").dtype == "auto"


@pytest.mark.parametrize("stated", ["float16", "bfloat16"])
def test_cpu_without_native_16_bit_runs_float32(stated):
    choice = resolve_dtype("auto", stated, "torch", "cpu", cpu_native=_cpu(False))
    assert choice.dtype == "float32"
    assert stated in choice.reason and "no native" in choice.reason


@pytest.mark.parametrize("stated", ["float16", "bfloat16"])
def test_cpu_with_native_16_bit_keeps_the_checkpoint_dtype(stated):
    assert resolve_dtype("auto", stated, "torch", "cpu", cpu_native=_cpu(True)).dtype == stated


@pytest.mark.parametrize("stated", ["float32", None])
def test_cpu_float32_or_unstated_checkpoint_runs_float32(stated):
    assert resolve_dtype("auto", stated, "torch", "cpu", cpu_native=_cpu(True)).dtype == "float32"


def test_cuda_follows_the_checkpoint():
    assert resolve_dtype("auto", "bfloat16", "torch", "cuda", cuda_bf16=True).dtype == "bfloat16"
    assert resolve_dtype("auto", "bfloat16", "torch", "cuda", cuda_bf16=False).dtype == "float16"
    assert resolve_dtype("auto", "float16", "torch", "cuda").dtype == "float16"
    assert resolve_dtype("auto", "float32", "torch", "cuda").dtype == "float32"


def test_trtllm_builds_16_bit():
    assert resolve_dtype("auto", "bfloat16", "trtllm", "cuda").dtype == "bfloat16"
    assert resolve_dtype("auto", "float16", "trtllm", "cuda").dtype == "float16"
    assert resolve_dtype("auto", "float32", "trtllm", "cuda").dtype == "float16"
    assert resolve_dtype("auto", None, "trtllm", "cuda").dtype == "float16"


@pytest.mark.parametrize("stated", ["float32", "bfloat16", None])
def test_int8_weights_run_with_16_bit_activations(stated):
    """aten's CPU int8 kernel takes 16-bit activations, on any CPU (it widens them itself)."""
    choice = resolve_dtype("auto", stated, "torch", "cpu", cpu_native=_cpu(False), int8_weights=True)
    assert choice.dtype == "bfloat16" and "int8" in choice.reason
    assert resolve_dtype("auto", stated, "torch", "cuda", cuda_bf16=False, int8_weights=True).dtype == "float16"
    assert resolve_dtype("float32", stated, "torch", "cpu", int8_weights=True).dtype == "float32"  # as written


def test_a_written_dtype_is_kept():
    choice = resolve_dtype("bfloat16", "float32", "torch", "cpu", cpu_native=_cpu(False))
    assert (choice.dtype, choice.reason) == ("bfloat16", "set in the config")


def test_checkpoint_dtype_reads_both_spellings_and_nested_text_config():
    assert checkpoint_dtype({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert checkpoint_dtype({"dtype": "float16"}) == "float16"
    assert checkpoint_dtype({"text_config": {"torch_dtype": "torch.bfloat16"}}) == "bfloat16"
    assert checkpoint_dtype({"torch_dtype": "int8"}) is None
    assert checkpoint_dtype({}) is None


def test_cpu_flags_decide_native_16_bit(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    flags = dtypes.cpu_flags(info)
    assert cpu_runs_natively("bfloat16", flags) and not cpu_runs_natively("float16", flags)
    assert not cpu_runs_natively("bfloat16", NO_FLAGS) and cpu_runs_natively("float32", NO_FLAGS)


def _bf16_pair(tiny_pair: Path, tmp_path: Path) -> Path:
    """A copy of the tiny pair whose config.json states bfloat16 (the weights stay as they are)."""
    import shutil

    out = tmp_path / "pair"
    shutil.copytree(tiny_pair, out)
    for role in ("target", "draft"):
        cfg_path = out / role / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.pop("torch_dtype", None)
        cfg["dtype"] = "bfloat16"
        cfg_path.write_text(json.dumps(cfg))
    return out


def test_check_prints_the_choice_and_stages_use_it(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_flags", lambda *a: NO_FLAGS)
    pair = _bf16_pair(tiny_pair, tmp_path)
    data = tiny_config_dict(pair)
    data["target"] = {"model": str(pair / "target")}  # dtype left out: auto
    data["draft"] = {"model": str(pair / "draft"), "dtype": "bfloat16"}
    config = parse_config(data)
    report = check_pair(config)
    assert not report.errors
    line = next(d for d in report.defaults if d.startswith("target.dtype"))
    assert line.startswith("target.dtype: float32 (auto: checkpoint bfloat16, but this CPU has no native bfloat16")
    assert not any(d.startswith("draft.dtype") for d in report.defaults)  # written, so not a default
    resolved = report.resolved(config)
    assert (resolved.target.dtype, resolved.draft.dtype) == ("float32", "bfloat16")
    assert with_resolved_defaults(config).target.dtype == "float32"  # what build/run/deploy use

    monkeypatch.setattr(dtypes, "cpu_flags", lambda *a: frozenset({"avx512_bf16"}))
    assert with_resolved_defaults(config).target.dtype == "bfloat16"


def test_build_records_the_resolved_dtype(tiny_pair, tmp_path):
    from pipeline.stages import run_stages

    data = tiny_config_dict(tiny_pair, name="auto-dtype")
    data["target"] = {"model": str(tiny_pair / "target")}
    data["draft"] = {"model": str(tiny_pair / "draft")}
    config = parse_config(data)
    run_stages(config, tmp_path / "engines", ("convert", "build"))
    engine = json.loads((tmp_path / "engines" / "auto-dtype" / "target" / "build" / "engine.json").read_text())
    assert engine["dtype"] == "float32"  # the tiny pair is saved in float32
    manifest = json.loads((tmp_path / "engines" / "auto-dtype" / "target" / "build" / "manifest.json").read_text())
    assert manifest["config"]["model"]["dtype"] == "float32"
