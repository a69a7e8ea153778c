"""Contract tests: every trtllm-build argv we generate parses against the recorded API of TensorRT-LLM 1.2.1,
and `python -m pipeline build CONFIG --dry-run` matches a reviewed golden file for each shipped GPU config.

Regenerate the goldens after an intended change with: UPDATE_GOLDEN=1 .venv/bin/pytest -q tests/test_trtllm_contract.py
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from pathlib import Path

import pytest
import yaml

from conftest import REPO, run_cli
from pipeline.backends.trtllm_api import PINNED_VERSION, build_argv, convert_calls
from pipeline.checks import TRTLLM_ARCHITECTURES
from pipeline.config import load_config, parse_config

API = json.loads((REPO / "tests" / "data" / f"trtllm_{PINNED_VERSION}_api.json").read_text())
GOLDEN = REPO / "tests" / "golden"
GPU_CONFIGS = sorted(p for p in (REPO / "configs").glob("*.yaml") if yaml.safe_load(p.read_text())["backend"] ==
                     "trtllm")


class ContractError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage and exit; a test wants the reason
        raise ContractError(message)


def trtllm_build_parser() -> argparse.ArgumentParser:
    """An argparse parser with the options, types and choices recorded for the pinned trtllm-build."""
    parser = _Parser(prog="trtllm-build", allow_abbrev=False)
    types = {"str": str, "int": int}
    for flag, spec in API["trtllm_build"]["options"].items():
        names = [flag, *spec.get("aliases", [])]
        if spec.get("action") == "store_true":
            parser.add_argument(*names, action="store_true")
            continue
        kwargs = {"type": types[spec["type"]]}
        if "choices" in spec:
            kwargs["choices"] = spec["choices"]
        if "choices_ci" in spec:  # the release upper-cases before matching (KVCacheType.from_string)
            allowed = spec["choices_ci"]
            kwargs["type"] = lambda v, allowed=allowed: v if v.lower() in allowed else _bad(v, allowed)
        parser.add_argument(*names, **kwargs)
    return parser


def _bad(value, allowed):
    raise argparse.ArgumentTypeError(f"invalid choice {value!r} (choose from {allowed})")


VARIANTS = [{}, {"speculative": {"acceptance": "greedy"}},
            {"build": {"quantization": {"mode": "fp8", "kv_cache": "fp8"}}},
            {"build": {"quantization": {"mode": "int8_weight_only", "kv_cache": "none"}}},
            {"build": {"quantization": {"mode": "int4_awq", "kv_cache": "none"}}}]


def _apply(path: Path, tp: int, variant: dict):
    data = yaml.safe_load(path.read_text())
    for section, values in variant.items():
        for key, value in values.items():
            data[section][key] = value
    data["build"]["parallel"] = {"tp": tp, "pp": 1}
    data["runtime"]["target_device_ids"] = list(range(tp))
    return parse_config(data, source=str(path), base_dir=path.parent)


def test_there_are_gpu_configs():
    assert len(GPU_CONFIGS) >= 3


@pytest.mark.parametrize("config_path", GPU_CONFIGS, ids=lambda p: p.stem)
@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_every_argv_parses_against_pinned_trtllm_build(config_path, tp, variant):
    config = _apply(config_path, tp, VARIANTS[variant])
    parser = trtllm_build_parser()
    for role in ("target", "draft"):
        argv = build_argv(config, role, Path("/ckpt") / role, Path("/out") / role)
        assert argv[0] == "trtllm-build"
        args = parser.parse_args(argv[1:])
        assert args.checkpoint_dir == f"/ckpt/{role}" and args.output_dir == f"/out/{role}"
        assert args.use_paged_context_fmha == "enable" and args.context_fmha == "enable"
        assert args.gemm_plugin == getattr(config, role).dtype
        assert args.kv_cache_type == "paged" and args.tokens_per_block == config.build.kv_cache.tokens_per_block
        assert (args.max_batch_size, args.max_input_len, args.max_seq_len) == (
            config.build.max_batch_size, config.build.max_input_len, config.build.max_seq_len)
        # build.py raises on gather_context_logits with max_draft_len > 0; we never pass it.
        assert not args.gather_context_logits and not args.gather_all_token_logits
        assert args.gather_generation_logits == (config.speculative.acceptance == "rejection")
        if role == "target":
            assert args.speculative_decoding_mode == "draft_tokens_external"
            assert args.max_draft_len == config.speculative.max_draft_len
        else:
            assert args.speculative_decoding_mode is None and not args.max_draft_len


@pytest.mark.parametrize("config_path", GPU_CONFIGS, ids=lambda p: p.stem)
@pytest.mark.parametrize("tp", [1, 4])
def test_one_checkpoint_per_rank(config_path, tp):
    config = _apply(config_path, tp, {})
    target = convert_calls(config, "target")
    assert [c.rank for c in target] == list(range(tp)) and {c.world_size for c in target} == {tp}
    assert [c.rank for c in convert_calls(config, "draft")] == [0]  # the draft always runs on one GPU


def test_quantized_target_uses_calibrating_converter_and_draft_stays_unquantized():
    config = _apply(GPU_CONFIGS[0], 4, VARIANTS[2])
    (call,) = convert_calls(config, "target")
    assert call.method == "quantize" and call.quant_algo == "FP8" and call.kv_cache_quant_algo == "FP8"
    assert call.world_size == 4 and call.rank is None
    names = API["converter"]["quant_algo"]["names_used"]
    assert {call.quant_algo, call.kv_cache_quant_algo} <= set(names)
    assert all(c.quant_algo is None and c.kv_cache_quant_algo is None for c in convert_calls(config, "draft"))
    woq = _apply(GPU_CONFIGS[0], 1, VARIANTS[3])
    assert [(c.method, c.quant_algo) for c in convert_calls(woq, "target")] == [("from_hugging_face", "W8A16")]


def test_architectures_match_the_pinned_model_map():
    assert TRTLLM_ARCHITECTURES == set(API["converter"]["model_map_causal_lm"])


def _golden_check(name: str, text: str):
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.is_file(), f"{path} missing; run with UPDATE_GOLDEN=1 to create it, then review it"
    assert text == path.read_text(), f"{path} differs; review the change and rerun with UPDATE_GOLDEN=1"


@pytest.mark.parametrize("config_path", GPU_CONFIGS, ids=lambda p: p.stem)
def test_dry_run_golden(config_path, tmp_path):
    # No TensorRT-LLM, no network: HF_HUB_OFFLINE is set by conftest and the plan never resolves hub ids.
    proc = run_cli("build", str(config_path.relative_to(REPO)), "--dry-run", "--engines-dir", "engines",
                   timeout=120)
    assert proc.returncode == 0, proc.stderr
    _golden_check(f"build_dry_run_{config_path.stem}.txt", proc.stdout)
    parser = trtllm_build_parser()
    commands = [line for line in proc.stdout.splitlines() if line.startswith("trtllm-build ")]
    assert len(commands) == 2
    for line in commands:
        parser.parse_args(shlex.split(line)[1:])
    config = load_config(config_path)
    assert config.target.model in proc.stdout and config.draft.model in proc.stdout


def test_contract_matches_installed_trtllm():
    """On a GPU box with the pinned release: the recorded options are the real ones."""
    pytest.importorskip("tensorrt_llm", reason="TensorRT-LLM is not installed (runs inside the Triton container)")
    from tensorrt_llm.commands.build import parse_arguments

    real = {a for action in parse_arguments()._actions for a in action.option_strings}
    assert set(API["trtllm_build"]["options"]) <= real
