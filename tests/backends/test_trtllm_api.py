"""Contract tests of pipeline/backends/trtllm_api.py: every trtllm-build argv we generate parses against the recorded
API of the pinned TensorRT-LLM (tests/data/trtllm_<release>_api.json), the converter calls fit the release, and `python
-m pipeline build CONFIG --dry-run` matches a reviewed golden file for each shipped GPU config. Tests marked gpu repeat
the checks against the installed release (they skip without CUDA or TensorRT-LLM).

Regenerate the goldens after an intended change with: UPDATE_GOLDEN=1 .venv/bin/pytest -q
tests/backends/test_trtllm_api.py
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shlex
from pathlib import Path

import pytest
import torch
import yaml
from tritonclient.grpc import model_config_pb2 as mc

from pipeline.backends.trtllm_api import (PINNED_VERSION, TRITON_CONTAINER, build_argv, convert_calls,
                                          kv_cache_fractions, require_cuda_gpu)
from pipeline.checks import TRTLLM_ARCHITECTURES
from pipeline.config import load_config, parse_config
from pipeline.errors import BackendUnavailable
from pipeline.triton import trtllm_repo
from tests.conftest import PY, REPO, run_cli

API_FILE = REPO / "tests" / "data" / f"trtllm_{PINNED_VERSION}_api.json"
API = json.loads(API_FILE.read_text())
OPTIONS = API["trtllm_build"]["options"]
GOLDEN = REPO / "tests" / "golden"
GPU_CONFIGS = sorted(p for p in (REPO / "configs").glob("*.yaml") if yaml.safe_load(p.read_text())["backend"] ==
                     "trtllm")
# The shipped pairs of a target and a draft engine (the Medusa config builds one engine: tests/backends/test_trtllm_medusa.py)
PAIR_CONFIGS = [p for p in GPU_CONFIGS if load_config(p).draft is not None]


class ContractError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage and exit; a test wants the reason
        raise ContractError(message)


def _enum_parser(members: list[str]):
    def parse(value: str):  # enum_type(...) -> Enum.from_string: upper-cases, then looks the member up
        if value.upper() not in members:
            raise argparse.ArgumentTypeError(f"invalid choice {value!r} (choose from {members})")
        return value.upper()
    return parse


def trtllm_build_parser() -> argparse.ArgumentParser:
    """An argparse parser with the options, types, choices and actions recorded for the pinned trtllm-build."""
    parser = _Parser(prog="trtllm-build", allow_abbrev=False)
    enums = API["trtllm_build"]["enums"]
    for flag, spec in OPTIONS.items():
        kwargs: dict = {}
        if "action" in spec:
            kwargs["action"] = spec["action"]
        if "dest" in spec:
            kwargs["dest"] = spec["dest"]
        if "nargs" in spec:
            kwargs["nargs"] = spec["nargs"]
        kind = spec.get("type")
        if kind in ("str", "int"):
            kwargs["type"] = {"str": str, "int": int}[kind]
        elif kind and kind.startswith("enum_type("):
            kwargs["type"] = _enum_parser(enums[kind.removeprefix("enum_type(").rstrip(")")]["members"])
        if "choices" in spec:
            kwargs["choices"] = spec["choices"]
        # choices given by an expression (severity_map.keys(), ...) are unknown here: we never pass those options
        parser.add_argument(flag, *spec.get("aliases", []), **kwargs)
    return parser


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


def _all_argvs():
    for config_path in PAIR_CONFIGS:
        for tp in (1, 4):
            for variant in VARIANTS:
                config = _apply(config_path, tp, variant)
                for role in ("target", "draft"):
                    yield config, role, build_argv(config, role, Path("/ckpt") / role, Path("/out") / role)


def test_the_goldens_are_exactly_the_shipped_gpu_configs():
    """Every shipped trtllm config has a reviewed dry-run golden and every golden a config: a golden left behind by a
    renamed or removed config would be checked by nothing, and a configs folder not found would silently leave the
    parametrized tests below with nothing to check."""
    assert len(GPU_CONFIGS) >= 3
    assert {p.name for p in GOLDEN.glob("build_dry_run_*.txt")} == {f"build_dry_run_{p.stem}.txt" for p in GPU_CONFIGS}


def test_the_pinned_release_is_the_same_everywhere():
    """One release, named in five places: the code's pin, the recorded API, the recorded Triton templates, the
    container the error messages send users to, and the `trtllm` extra in pyproject.toml. A bump that misses one
    (the extra still installing the old wheel, a message naming the old container) fails here."""
    import tomllib

    from pipeline.backends.trtllm_api import TRITON_CONTAINER

    assert API["release"] == PINNED_VERSION and API["triton_container"] == TRITON_CONTAINER
    assert (REPO / "tests" / "data" / f"trtllm_{PINNED_VERSION}_triton" / "tensorrt_llm" / "config.pbtxt").is_file()
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["trtllm"]
    assert extra == [f"tensorrt-llm=={PINNED_VERSION}"]
    # Options that exist in this release and that we rely on; --gather_generation_logits is still a build flag.
    for flag in ("--speculative_decoding_mode", "--max_draft_len", "--use_paged_context_fmha",
                 "--gather_generation_logits", "--kv_cache_type", "--gemm_plugin"):
        assert flag in OPTIONS


@pytest.mark.parametrize("config_path", PAIR_CONFIGS, ids=lambda p: p.stem)
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
        assert args.kv_cache_type == "PAGED" and args.tokens_per_block == config.build.kv_cache.tokens_per_block
        # the loop re-submits prompt + generated tokens as the context every step: the engine must take contexts
        # up to max_seq_len - 1, not only prompts up to build.max_input_len
        assert (args.max_batch_size, args.max_input_len, args.max_seq_len) == (
            config.build.max_batch_size, config.build.max_seq_len - 1, config.build.max_seq_len)
        # build.py raises on gather_context_logits with max_draft_len > 0; we never pass it.
        assert not args.gather_context_logits and not args.gather_all_token_logits
        assert args.gather_generation_logits == (config.speculative.acceptance == "rejection")
        if role == "target":
            assert args.speculative_decoding_mode == "draft_tokens_external"
            assert args.max_draft_len == config.speculative.max_draft_len
        else:
            assert args.speculative_decoding_mode is None and not args.max_draft_len


def test_recorded_parser_refuses_what_the_release_refuses():
    """The recorded parser is a real check: an unknown flag, a bad choice or a bad enum value fails."""
    parser = trtllm_build_parser()
    with pytest.raises(ContractError, match="unrecognized"):
        parser.parse_args(["--max_draft_length", "4"])
    with pytest.raises(ContractError, match="invalid choice"):
        parser.parse_args(["--speculative_decoding_mode", "draft_target"])
    with pytest.raises(ContractError, match="kv_cache_type"):
        parser.parse_args(["--kv_cache_type", "blocks"])
    assert parser.parse_args(["--max_decoder_seq_len", "9"]).max_seq_len == 9  # alias of --max_seq_len


@pytest.mark.parametrize("config_path", PAIR_CONFIGS, ids=lambda p: p.stem)
@pytest.mark.parametrize("tp", [1, 4])
def test_one_checkpoint_per_rank(config_path, tp):
    config = _apply(config_path, tp, {})
    target = convert_calls(config, "target")
    assert [c.rank for c in target] == list(range(tp)) and {c.world_size for c in target} == {tp}
    assert [c.rank for c in convert_calls(config, "draft")] == [0]  # the draft always runs on one GPU


def test_quantized_target_uses_calibrating_converter_and_draft_stays_unquantized():
    config = _apply(PAIR_CONFIGS[0], 4, VARIANTS[2])
    (call,) = convert_calls(config, "target")
    assert call.method == "quantize" and call.quant_algo == "FP8" and call.kv_cache_quant_algo == "FP8"
    assert call.world_size == 4 and call.rank is None
    names = API["converter"]["quant_algo"]["names_used"]
    assert {call.quant_algo, call.kv_cache_quant_algo} <= set(names)
    assert all(c.quant_algo is None and c.kv_cache_quant_algo is None for c in convert_calls(config, "draft"))
    woq = _apply(PAIR_CONFIGS[0], 1, VARIANTS[3])
    assert [(c.method, c.quant_algo) for c in convert_calls(woq, "target")] == [("from_hugging_face", "W8A16")]


def test_architectures_match_the_pinned_model_map():
    assert TRTLLM_ARCHITECTURES == set(API["converter"]["model_map_causal_lm"])


# ---- dry-run goldens ----------------------------------------------------------------------------------------------

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
    # Where the plan runs a script (the Medusa converter) it names this checkout and its interpreter: not the golden's
    portable = proc.stdout.replace(PY, "<python>").replace(str(REPO), "<repo>")
    _golden_check(f"build_dry_run_{config_path.stem}.txt", portable)
    assert f"TensorRT-LLM {PINNED_VERSION}" in proc.stdout and '"trtllm_version": "1.1.0"' in proc.stdout
    parser = trtllm_build_parser()
    commands = [line for line in proc.stdout.splitlines() if line.startswith("trtllm-build ")]
    config = load_config(config_path)
    assert len(commands) == len(config.roles)  # a Medusa config builds the target alone
    for line in commands:
        parser.parse_args(shlex.split(line)[1:])
    assert all(getattr(config, role).model in proc.stdout for role in config.roles)


# ---- on a GPU box: the same checks against the installed release -------------------------------------------------

@pytest.mark.gpu
def test_installed_trtllm_is_the_pinned_release():
    trtllm = pytest.importorskip("tensorrt_llm", reason="TensorRT-LLM is not installed (runs inside the container)")
    assert trtllm.__version__ == PINNED_VERSION, (f"installed TensorRT-LLM {trtllm.__version__}, pinned "
                                                  f"{PINNED_VERSION}: use {API['triton_container']}")


@pytest.mark.gpu
def test_every_argv_parses_with_the_installed_trtllm_build():
    pytest.importorskip("tensorrt_llm", reason="TensorRT-LLM is not installed (runs inside the container)")
    from tensorrt_llm.commands.build import parse_arguments

    real = parse_arguments()
    for config, role, argv in _all_argvs():
        args = real.parse_args(argv[1:])  # exits with the release's own message on an unknown option or choice
        assert args.gather_generation_logits == (config.speculative.acceptance == "rejection"), (role, argv)
    recorded = {flag: spec for flag, spec in OPTIONS.items()}
    actions = {a.option_strings[0]: a for a in real._actions if a.option_strings}
    assert set(recorded) == set(actions) - {"-h"}, "recorded option list differs from the installed trtllm-build"
    for flag, spec in recorded.items():
        if "choices" in spec:
            assert list(actions[flag].choices) == spec["choices"], flag
        if "default" in spec:
            assert actions[flag].default == spec["default"], flag


@pytest.mark.gpu
def test_model_runner_signatures_match_the_installed_release():
    pytest.importorskip("tensorrt_llm", reason="TensorRT-LLM is not installed (runs inside the container)")
    from tensorrt_llm.runtime import ModelRunnerCpp

    for name in ("from_dir", "generate"):
        real = inspect.signature(getattr(ModelRunnerCpp, name))
        spec = API["runtime"][f"ModelRunnerCpp.{name}"]
        named = {p.name: p for p in real.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD}
        named.pop("self", None)
        named.pop("cls", None)
        assert set(named) == set(spec["positional"]) | set(spec["keyword_only"]), name
        for param, default in spec["keyword_only"].items():
            assert named[param].default == default, (name, param)
        has_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in real.parameters.values())
        assert has_kwargs == spec["var_keyword"], name
    source = inspect.getsource(ModelRunnerCpp.generate)
    for key in ("random_seed", "draft_tokens_list", "draft_logits_list", "temperature", "top_k", "top_p"):
        assert f'"{key}"' in source or f"'{key}'" in source, f"generate() no longer reads **kwargs[{key!r}]"


def test_no_gpu_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailable) as err:
        require_cuda_gpu("build (target)")
    assert "NVIDIA GPU" in _one_line(err.value) and TRITON_CONTAINER in str(err.value)


def _one_line(exc: BaseException) -> str:
    message = str(exc)
    assert "\n" not in message and message
    return message


def params(config: mc.ModelConfig) -> dict[str, str]:
    return {key: value.string_value for key, value in config.parameters.items()}


def test_kv_fractions_one_function_for_both_paths():
    assert kv_cache_fractions(0.9, [0], [1]) == (0.9, 0.9)  # separate GPUs: each takes the configured fraction
    assert kv_cache_fractions(0.9, [0, 1, 2, 3], [3]) == (0.72, 0.18)
    for fraction in (0.05, 0.5, 0.85, 1.0):
        target, draft = kv_cache_fractions(fraction, [0], [0])
        assert target + draft <= fraction + 1e-9 and target > draft > 0
    config = parse_config(yaml.safe_load((REPO / "configs" / "llama3.1-8b_llama3.2-1b.yaml").read_text())
                          | {"runtime": {"target_device_ids": [0], "draft_device_ids": [1]}})
    configs = {c.name: c for c in trtllm_repo.repository_configs(
        config, trtllm_repo.TrtllmPaths.for_engines(Path("/e/t"), Path("/e/d")))}
    assert params(configs["tensorrt_llm"])["kv_cache_free_gpu_mem_fraction"] == "0.85"
    assert params(configs["tensorrt_llm_draft"])["kv_cache_free_gpu_mem_fraction"] == "0.85"
