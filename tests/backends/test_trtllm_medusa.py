"""speculative.method: medusa on the trtllm backend, against the recorded TensorRT-LLM 1.1.0 sources
(tests/data/trtllm_1.1.0_medusa, facts in its README) and the recorded trtllm-build option list: the converter's
command line parsed by the recorded converter's own argparse section, the build argv by the recorded trtllm-build
options, the plan `build --dry-run` prints, convert running the converter script (a FAKE one, standing in for the
release's), and the checks on a built Medusa engine. No TensorRT-LLM, no GPU.
"""

from __future__ import annotations

import argparse
import ast
import json
import shlex
import sys
import types
from pathlib import Path
from unittest import mock

import pytest
import yaml

from pipeline.backends import trtllm
from pipeline.backends.trtllm_api import (MEDUSA_CONVERTER, MEDUSA_MODEL_TYPES, PINNED_VERSION, SPEC_MODE_MEDUSA,
                                          build_argv, check_medusa_model_type, medusa_convert_argv)
from pipeline.backends.trtllm_preflight import check_medusa_mode, read_engine_config
from pipeline.config import parse_config
from pipeline.errors import BackendUnavailable, CompatibilityError, ConfigError, EngineError
from pipeline.medusa_heads import MedusaHeads
from pipeline.models import ResolvedModel
from tests.backends.test_trtllm_api import API, OPTIONS, trtllm_build_parser
from tests.backends.test_trtllm_loading import _tiny_tokenizer
from tests.conftest import PY, run_cli
from tests.fake_trtllm import fake_engine_config, seal_stage
from tests.recorded_source import MEDUSA_CONVERTER as RECORDED_CONVERTER, function_defs, load_functions

# A tree whose node count (7) is neither its depth (3) nor the converter's default (63), given as leaves only: the
# converter and the engine get every node.
LEAVES = [[0, 0, 0], [0, 1], [1, 0], [2]]
NODES = 7


def medusa_dict(heads_dir: Path, **overrides) -> dict:
    data = {"name": "medusa-tp2", "backend": "trtllm",
            "target": {"model": "meta-llama/Llama-3.1-8B-Instruct", "dtype": "bfloat16"},
            "speculative": {"method": "medusa", "acceptance": "rejection",
                            "medusa": {"model": str(heads_dir), "heads": 3, "layers": 2, "choices": LEAVES}},
            "build": {"max_batch_size": 8, "max_input_len": 4096, "max_seq_len": 8192, "parallel": {"tp": 2, "pp": 1},
                      "kv_cache": {"free_gpu_mem_fraction": 0.85}},
            "runtime": {"target_device_ids": [0, 1]}}
    for section, values in overrides.items():
        data[section] = {**data[section], **values}
    return data


@pytest.fixture
def heads_dir(tmp_path) -> Path:
    folder = tmp_path / "heads"
    MedusaHeads(3, 2, 16, 40).save(folder)
    return folder


@pytest.fixture
def config(heads_dir):
    return parse_config(medusa_dict(heads_dir))


# ---- the recorded converter's command line -----------------------------------------------------------------------

class ContractError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    made: list[argparse.ArgumentParser] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _Parser.made.append(self)

    def error(self, message):  # argparse would print usage and exit; a test wants the reason
        raise ContractError(message)


def recorded_converter_args(argv: list[str]) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """``argv`` (without the interpreter and script) parsed by parse_arguments() of the recorded
    examples/medusa/convert_checkpoint.py, and the parser it built."""
    shim = types.SimpleNamespace(ArgumentParser=_Parser)
    namespace = load_functions(RECORDED_CONVERTER, ["parse_arguments"], {"argparse": shim})
    with mock.patch.object(sys, "argv", ["convert_checkpoint.py", *argv]):
        args = namespace["parse_arguments"]()
    return args, _Parser.made[-1]


def test_converter_argv_parses_with_the_recorded_converter(config, heads_dir):
    argv = medusa_convert_argv(config, "/models/target", "llama", Path("/ckpt"), script=Path("/ex") / MEDUSA_CONVERTER)
    assert argv[:2] == [sys.executable, f"/ex/{MEDUSA_CONVERTER}"]
    args, parser = recorded_converter_args(argv[2:])
    # Every count differs from the converter's default, so each one reaches it only if we pass it: the head count
    # in particular is read from the command line, never from the heads' config.json (README fact 3).
    for dest, ours in (("num_medusa_heads", 3), ("num_medusa_layers", 2), ("max_medusa_token_len", NODES),
                       ("dtype", "bfloat16"), ("tp_size", 2)):
        assert getattr(args, dest) == ours and type(getattr(args, dest)) is type(ours), dest
        assert parser.get_default(dest) != ours, f"{dest}: the test config must differ from the default"
    assert args.max_medusa_token_len > 0  # the converter asserts it (fact 5)
    assert (args.model_dir, args.medusa_model_dir, args.output_dir) == ("/models/target", str(heads_dir), "/ckpt")
    assert args.model_type == "llama" and args.pp_size == 1
    # What we leave to the defaults converts an unquantized checkpoint, one rank after another.
    assert not args.use_weight_only and args.smoothquant is None and not args.int8_kv_cache
    assert args.workers == 1 and not args.load_by_shard and args.meta_ckpt_dir is None


def test_recorded_converter_parser_is_a_real_check(config):
    with pytest.raises(ContractError, match="unrecognized"):
        recorded_converter_args(["--medusa_num_heads", "3"])  # the heads' config.json key, not the flag
    with pytest.raises(ContractError, match="invalid choice"):
        recorded_converter_args(["--dtype", "auto"])
    with pytest.raises(ContractError, match="invalid int"):
        recorded_converter_args(["--max_medusa_token_len", "[[0]]"])


def test_model_types_are_those_the_recorded_converter_asserts():
    """convert_checkpoint.py asserts `args.model_type in [...]` before it reads the HF config."""
    (main,) = function_defs(RECORDED_CONVERTER)["main"]
    lists = [node.test.comparators[0] for node in ast.walk(main) if isinstance(node, ast.Assert)
             and isinstance(node.test, ast.Compare) and ast.unparse(node.test.left) == "args.model_type"]
    assert len(lists) == 1
    assert tuple(ast.literal_eval(lists[0])) == MEDUSA_MODEL_TYPES
    for model_type in MEDUSA_MODEL_TYPES:
        assert check_medusa_model_type(model_type) == model_type
    with pytest.raises(CompatibilityError, match="model_type 'mistral' has no Medusa converter"):
        check_medusa_model_type("mistral")


def test_heads_config_agrees_with_what_the_converter_is_told(config, heads_dir):
    """The converter lets keys of the heads' config.json override its flags (`config.get(key, args.flag)`):
    for every such key, the heads we hand it hold the value we pass, so weights and checkpoint config agree."""
    (main,) = function_defs(RECORDED_CONVERTER)["main"]
    overrides = {node.args[0].value: node.args[1].attr for node in ast.walk(main)
                 if isinstance(node, ast.Call) and ast.unparse(node.func) == "config.get" and len(node.args) == 2
                 and isinstance(node.args[1], ast.Attribute) and ast.unparse(node.args[1].value) == "args"}
    assert overrides == {"medusa_num_heads": "num_medusa_heads", "medusa_num_layers": "num_medusa_layers"}
    args, _ = recorded_converter_args(medusa_convert_argv(config, "/m", "llama", Path("/c"))[2:])
    heads_config = json.loads((Path(args.medusa_model_dir) / "config.json").read_text())
    for key, flag in overrides.items():
        assert heads_config[key] == getattr(args, flag), key


def test_quantized_medusa_target_is_refused_at_plan_time(heads_dir, tmp_path):
    for quant in ({"mode": "int8_weight_only", "kv_cache": "none"}, {"mode": "none", "kv_cache": "fp8"}):
        config = parse_config(medusa_dict(heads_dir, build={"quantization": quant}))
        with pytest.raises(ConfigError, match="build.quantization: .*Medusa converter"):
            trtllm.convert_plan(config, "target", tmp_path)
        with pytest.raises(ConfigError, match="build.quantization"):
            trtllm.build_plan(config, "target", tmp_path, tmp_path)


# ---- trtllm-build ------------------------------------------------------------------------------------------------

def test_build_argv_parses_against_the_recorded_trtllm_build(config):
    assert "medusa" in OPTIONS["--speculative_decoding_mode"]["choices"]
    argv = build_argv(config, "target", Path("/ckpt"), Path("/out"))
    args = trtllm_build_parser().parse_args(argv[1:])
    assert args.speculative_decoding_mode == "medusa"
    assert args.max_draft_len == NODES  # every node is one draft token of a step, not the tree's depth
    # Draft logits come from a draft engine: none here, although speculative.acceptance is 'rejection'.
    assert not args.gather_generation_logits and not args.gather_context_logits
    assert args.use_paged_context_fmha == "enable" and args.checkpoint_dir == "/ckpt"
    info = trtllm.engine_info(config, "target", PINNED_VERSION)
    assert info["gather_generation_logits"] is False and info["method"] == "medusa"


def test_dry_run_plans_the_medusa_converter_and_one_engine(heads_dir, tmp_path):
    path = tmp_path / "medusa.yaml"
    path.write_text(yaml.safe_dump(medusa_dict(heads_dir)))
    proc = run_cli("build", str(path), "--dry-run", "--engines-dir", str(tmp_path / "engines"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    builds = [shlex.split(line) for line in lines if line.startswith("trtllm-build ")]
    converters = [shlex.split(line) for line in lines if line.startswith(f"{PY} ")]
    assert len(builds) == 1 and len(converters) == 1, proc.stdout  # the target only: no draft engine
    assert trtllm_build_parser().parse_args(builds[0][1:]).speculative_decoding_mode == "medusa"
    args, _ = recorded_converter_args(converters[0][2:])
    assert args.medusa_model_dir == str(heads_dir) and args.max_medusa_token_len == NODES
    assert converters[0][1].endswith(MEDUSA_CONVERTER)
    assert "/draft/" not in proc.stdout and "convert draft" not in proc.stdout
    engine_json = json.loads(next(line for line in lines if "engine.json:" in line).split("engine.json: ", 1)[1])
    assert engine_json["medusa_choices"] == LEAVES


# ---- convert runs the release's converter script -----------------------------------------------------------------

FAKE_CONVERTER = """# FAKE examples/medusa/convert_checkpoint.py: records its arguments, fails when asked to
import json, sys
args = sys.argv[1:]
out = args[args.index("--output_dir") + 1]
if "FAIL" in open(args[args.index("--model_dir") + 1] + "/config.json").read():
    print("Traceback ...\\nAssertionError: Invalid model type")
    sys.exit(3)
open(out + "/config.json", "w").write(json.dumps({"architecture": "MedusaForCausalLM", "argv": args}))
"""


@pytest.fixture
def fake_release(monkeypatch, tmp_path):
    """tensorrt_llm importable (a FAKE module), a GPU reported, and a FAKE converter under $TRTLLM_EXAMPLES."""
    monkeypatch.setitem(sys.modules, "tensorrt_llm", types.SimpleNamespace(__version__=PINNED_VERSION))
    monkeypatch.setattr(trtllm, "require_cuda_gpu", lambda what: None)
    examples = tmp_path / "examples"
    (examples / "medusa").mkdir(parents=True)
    (examples / MEDUSA_CONVERTER).write_text(FAKE_CONVERTER)
    monkeypatch.setenv("TRTLLM_EXAMPLES", str(examples))
    return examples


def _target_folder(folder: Path, model_type: str) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["X"]}))
    _tiny_tokenizer(folder)
    return folder


def test_convert_runs_the_converter_with_the_planned_argv(fake_release, config, tmp_path):
    model = ResolvedModel("target", config.target, _target_folder(tmp_path / "llama", "llama"), "local", None)
    out = tmp_path / "out"
    out.mkdir()
    facts = trtllm.convert(config, "target", model, out)
    argv = facts["converter"]["argv"]
    assert argv == medusa_convert_argv(config, str(model.path), "llama", out, fake_release / MEDUSA_CONVERTER)
    assert json.loads((out / "config.json").read_text())["argv"] == argv[2:]
    assert (out / "tokenizer" / "tokenizer_config.json").is_file()  # the engine folder carries the tokenizer
    assert (out / trtllm.CONVERT_LOG).read_text().startswith(shlex.join(argv))

    failing = ResolvedModel("target", config.target, _target_folder(tmp_path / "bad", "qwen2"), "local", None)
    (failing.path / "config.json").write_text(json.dumps({"model_type": "qwen2", "FAIL": 1}))
    (tmp_path / "out2").mkdir()
    with pytest.raises(EngineError, match="exited with status 3: AssertionError: Invalid model type"):
        trtllm.convert(config, "target", failing, tmp_path / "out2")


def test_convert_refuses_before_running_anything(fake_release, config, tmp_path, monkeypatch):
    gpt2 = ResolvedModel("target", config.target, _target_folder(tmp_path / "gpt2", "gpt2"), "local", None)
    with pytest.raises(CompatibilityError, match="model_type 'gpt2'"):
        trtllm.convert(config, "target", gpt2, tmp_path)
    monkeypatch.setenv("TRTLLM_EXAMPLES", str(tmp_path / "nowhere"))
    llama = ResolvedModel("target", config.target, _target_folder(tmp_path / "llama", "llama"), "local", None)
    with pytest.raises(BackendUnavailable, match="TRTLLM_EXAMPLES") as err:
        trtllm.convert(config, "target", llama, tmp_path)
    assert "\n" not in str(err.value) and "/app/examples" in str(err.value)


# ---- a built Medusa engine ---------------------------------------------------------------------------------------

def test_medusa_mode_value_is_the_recorded_one():
    assert API["engine_config_json"]["speculative_decoding_mode_values"]["MEDUSA"] == SPEC_MODE_MEDUSA


def test_medusa_engine_checks(tmp_path):
    good = read_engine_config(fake_engine_config(tmp_path / "good", spec_mode=SPEC_MODE_MEDUSA, max_draft_len=NODES))
    assert check_medusa_mode(good, NODES) == []
    (problem,) = check_medusa_mode(read_engine_config(fake_engine_config(tmp_path / "dte", spec_mode=2)), NODES)
    assert "speculative_decoding_mode is 2, not medusa" in problem and "speculative.method: medusa" in problem
    (short,) = check_medusa_mode(read_engine_config(fake_engine_config(tmp_path / "short", spec_mode=SPEC_MODE_MEDUSA,
                                                                       max_draft_len=NODES - 1)), NODES)
    assert f"max_draft_len is {NODES - 1}, fewer than the {NODES} nodes" in short


def _medusa_engine_folder(root: Path, config, spec_mode: int = SPEC_MODE_MEDUSA) -> Path:
    folder = root / "target" / "build"
    fake_engine_config(folder, spec_mode=spec_mode, max_draft_len=NODES, tp=2)
    (folder / "engine.json").write_text(json.dumps(trtllm.engine_info(config, "target", PINNED_VERSION)))
    _tiny_tokenizer(folder / "tokenizer")
    seal_stage(folder, {"stage": "build", "role": "target"})
    return folder


@pytest.fixture
def recording_runner(monkeypatch):
    """FAKE ModelRunnerEngine: records what each engine would be opened with."""
    from pipeline.backends import trtllm_loading

    opened = []

    class RecordingEngine:
        vocab_size = 300

        def __init__(self, engine_dir, device_ids, kv_fraction, block_reuse, gather_logits, *args, **kwargs):
            opened.append({"role": Path(engine_dir).parent.name, "kv": kv_fraction, "logits": gather_logits,
                           "medusa_choices": kwargs.get("medusa_choices")})

    monkeypatch.setattr(trtllm_loading, "import_tensorrt_llm",
                        lambda what: types.SimpleNamespace(__version__=PINNED_VERSION))
    monkeypatch.setattr(trtllm_loading, "require_cuda_gpu", lambda what: None)
    monkeypatch.setattr(trtllm_loading, "ModelRunnerEngine", RecordingEngine)
    return opened


def test_opening_a_medusa_engine_passes_the_whole_tree(recording_runner, config, tmp_path):
    from pipeline.executor.trtllm_executor import TrtllmSpeculativeExecutor

    _medusa_engine_folder(tmp_path, config)
    executor = TrtllmSpeculativeExecutor.from_engines(tmp_path)
    (opened,) = recording_runner  # the target only
    assert executor.method == "medusa" and executor.draft is None
    # The runtime gets every node of the tree once, parents first (the C++ runtime does not expand leaves).
    assert opened["medusa_choices"] == [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    assert opened["kv"] == 0.85 and opened["logits"] is False  # no draft to share the GPU with, no draft logits
    assert executor.engine_draft_len == 3  # K is the tree's depth
    with pytest.raises(EngineError, match="built for Medusa"):
        TrtllmSpeculativeExecutor.from_engines(tmp_path, method="ngram")


def test_a_target_built_for_draft_tokens_is_not_opened_as_medusa(recording_runner, config, tmp_path):
    from pipeline.executor.trtllm_executor import TrtllmSpeculativeExecutor

    _medusa_engine_folder(tmp_path, config, spec_mode=2)
    with pytest.raises(EngineError, match="not medusa"):
        TrtllmSpeculativeExecutor.from_engines(tmp_path)
    assert recording_runner == []


def test_shipped_vicuna_config_converts_as_the_recorded_example_does():
    """configs/vicuna-7b-medusa.yaml: the public pair of TensorRT-LLM's Medusa example (recorded
    examples/medusa/README.md: vicuna-7b-v1.3 with FasterDecoding's medusa-vicuna-7b-v1.3, float16, 4 heads), its
    converter command accepted by the recorded converter's own parser."""
    from pipeline.config import load_config
    from tests.conftest import REPO
    from tests.recorded_source import MEDUSA_CONVERTER as RECORDED

    config = load_config(REPO / "configs" / "vicuna-7b-medusa.yaml")
    readme = (RECORDED.parents[0] / "README.md").read_text()
    assert "lmsys/vicuna-7b-v1.3" in readme and "FasterDecoding/medusa-vicuna-7b-v1.3" in readme
    assert "--dtype float16" in readme and "--num_medusa_heads 4" in readme
    args, _ = recorded_converter_args(medusa_convert_argv(config, config.target.model, "llama", Path("/ckpt"))[2:])
    assert (args.model_dir, args.dtype, args.num_medusa_heads, args.num_medusa_layers) == (
        "lmsys/vicuna-7b-v1.3", "float16", 4, 1)
    assert Path(args.medusa_model_dir).name == "medusa-vicuna-7b-v1.3"
    assert args.max_medusa_token_len == 63 and config.speculative.medusa.tree().max_depth == 4  # mc_sim_7b_63
    assert config.draft is None and config.roles == ("target",)
