"""pipeline/triton/trtllm_repo.py for speculative.method: medusa (no server, no engines): the repository has no draft
engine and no BLS, requests go through the ensemble to a `tensorrt_llm` model whose decoding config, read by the
recorded upstream tensorrt_llm/1/model.py's own functions (tests/data/trtllm_1.1.0_medusa), is Medusa with exactly
the config's tree; every parameter of the recorded template is written or explained; launch.sh starts it without
upstream's BLS model.
"""

from __future__ import annotations

import json
import os
import subprocess
import types
from pathlib import Path

import pytest
from google.protobuf import json_format

from pipeline.config import load_config, parse_config
from pipeline.speculative.tree import TokenTree
from pipeline.triton import trtllm_repo
from pipeline.triton.repository import deploy
from tests.conftest import REPO
from tests.recorded_source import TRITON_LLM_MODEL, load_functions
from tests.triton.test_trtllm_repo import params, read_repo, template, tensor_key

# Leaves only, with a prefix ([0, 0]) the config does not list: the server must still get every node.
LEAVES = [[0, 0, 1], [1], [0, 2]]


def medusa_dict(choices=LEAVES) -> dict:
    return {"name": "medusa-tp2", "backend": "trtllm",
            "target": {"model": "meta-llama/Llama-3.1-8B-Instruct", "dtype": "bfloat16"},
            "speculative": {"method": "medusa", "acceptance": "rejection",
                            "medusa": {"model": "heads", "heads": 3, "choices": choices}},
            "build": {"max_batch_size": 8, "max_input_len": 4096, "max_seq_len": 8192, "parallel": {"tp": 2, "pp": 1},
                      "kv_cache": {"free_gpu_mem_fraction": 0.85}},
            "runtime": {"target_device_ids": [0, 1], "draft_device_ids": [0]},
            "serve": {"http_port": 9000, "grpc_port": 9001, "metrics_port": 9002}}


@pytest.fixture(scope="module")
def medusa_repo(tmp_path_factory):
    config = parse_config(medusa_dict())
    result = deploy(config, tmp_path_factory.mktemp("medusa") / "engines")
    return result.path, config


@pytest.fixture(scope="module")
def shipped_repo(tmp_path_factory):
    """The shipped configs/vicuna-7b-medusa.yaml (FasterDecoding's public heads on Vicuna 7B), deployed."""
    config = load_config(REPO / "configs" / "vicuna-7b-medusa.yaml")
    return deploy(config, tmp_path_factory.mktemp("vicuna") / "engines").path, config


# ---- upstream's tensorrt_llm/1/model.py reads our parameters ----------------------------------------------------

class TritonModelException(Exception):
    pass


class FakeDecodingMode:
    """FAKE tensorrt_llm.bindings.executor.DecodingMode: each factory returns its own name."""

    def __getattr__(self, name):
        return lambda: f"DecodingMode.{name}"


def recorded_decoding_config(model: object) -> dict:
    """What upstream's TritonPythonModel.get_decoding_config builds from our config.pbtxt: the keyword arguments of
    trtllm.DecodingConfig (FAKE stand-ins for tensorrt_llm's bindings and Triton's pb_utils)."""
    fake_trtllm = types.SimpleNamespace(DecodingMode=FakeDecodingMode(), DecodingConfig=lambda **kwargs: kwargs,
                                        EagleConfig=lambda choices: ("EagleConfig", choices))
    fake_pb_utils = types.SimpleNamespace(TritonModelException=TritonModelException,
                                          Logger=types.SimpleNamespace(log_warning=print))
    namespace = load_functions(
        TRITON_LLM_MODEL, ["read_parameter_as_type", "get_parameter", "parse_medusa_choices", "parse_eagle_choices",
                           "convert_decoding_mode", "get_decoding_config"],
        {"json": json, "trtllm": fake_trtllm, "pb_utils": fake_pb_utils, "print": lambda *a: None})
    model_config = json_format.MessageToDict(model, preserving_proto_field_name=True)
    return namespace["get_decoding_config"](types.SimpleNamespace(), model_config)  # self: a FAKE model instance


def test_upstream_reads_medusa_with_exactly_the_configs_tree(medusa_repo):
    repo, config = medusa_repo
    decoding = recorded_decoding_config(read_repo(repo)["tensorrt_llm"])
    assert set(decoding) == {"decoding_mode", "medusa_choices"}
    assert decoding["decoding_mode"] == "DecodingMode.Medusa"
    choices = decoding["medusa_choices"]
    assert TokenTree.from_choices(choices).paths == config.speculative.medusa.tree().paths
    # every node once (the leaves' prefixes included: [0], [0, 0]), each after its parent
    assert len(choices) == config.speculative.medusa.tree().size - 1 == 5
    assert all(path[:-1] in choices[:i] for i, path in enumerate(choices) if len(path) > 1)


def test_the_recorded_reader_is_a_real_check(medusa_repo):
    repo, _ = medusa_repo
    model = read_repo(repo)["tensorrt_llm"]
    model.parameters["medusa_choices"].string_value = "[[0], [0, 0]"  # our bracket slip: refused upstream
    with pytest.raises(TritonModelException, match="medusa_choices"):
        recorded_decoding_config(model)
    model.parameters["medusa_choices"].string_value = "${medusa_choices}"  # unfilled: the server's default tree
    assert "medusa_choices" not in recorded_decoding_config(model)
    del model.parameters["medusa_choices"]
    model.parameters["decoding_mode"].string_value = "top_k_top_p"  # the draft-engine repository's mode
    assert recorded_decoding_config(model) == {"decoding_mode": "DecodingMode.TopKTopP"}


# ---- the repository --------------------------------------------------------------------------------------------

def test_no_draft_engine_and_no_bls(medusa_repo):
    repo, _ = medusa_repo
    configs = read_repo(repo)
    assert set(configs) == {"preprocessing", "postprocessing", "tensorrt_llm", "ensemble"}
    assert not (repo / "tensorrt_llm_draft").exists() and not (repo / "tensorrt_llm_bls").exists()
    assert [s.model_name for s in configs["ensemble"].ensemble_scheduling.step] == [
        "preprocessing", "tensorrt_llm", "postprocessing"]  # the request path goes straight to the Medusa engine
    target = params(configs["tensorrt_llm"])
    engines = repo.parent
    assert target["gpt_model_path"] == str(engines / "target" / "build")
    assert target["kv_cache_free_gpu_mem_fraction"] == "0.85"  # no draft on GPU 0 to share it with
    assert target["speculative_decoding_fast_logits"] == "false"
    assert (target["gpu_device_ids"], target["participant_ids"]) == ("0,1", "1,2")
    assert "draft" not in json.dumps({name: params(c) for name, c in configs.items()})


def test_every_template_parameter_and_tensor_is_written_or_explained(medusa_repo):
    repo, config = medusa_repo
    unset = {"tensorrt_llm": trtllm_repo.tensorrt_llm_unset(config), "preprocessing": trtllm_repo.PREPROCESSING_UNSET}
    assert "medusa_choices" not in unset["tensorrt_llm"] and "medusa_choices" in trtllm_repo.TENSORRT_LLM_UNSET
    for name, model in read_repo(repo).items():
        upstream, templated = template(name)
        ours, skipped = set(params(model)), set(unset.get(name, {}))
        assert set(upstream.parameters) == ours | skipped and not ours & skipped, name
        assert not any("${" in value for value in params(model).values()), name
        for kind in ("input", "output"):
            theirs = {}
            for tensor in getattr(upstream, kind):
                theirs.setdefault(tensor.name, tensor_key(tensor, templated))
            assert {t.name: tensor_key(t) for t in getattr(model, kind)} == theirs, (name, kind)


def _upstream_without_bls(folder: Path) -> tuple[Path, Path]:
    for model in ("preprocessing", "postprocessing"):
        (folder / model / "1").mkdir(parents=True)
        (folder / model / "1" / "model.py").write_text(f"# FAKE upstream {model}\n")
    launcher = folder / "launcher.py"
    launcher.write_text("import sys\nprint('LAUNCH', *sys.argv[1:])\n")
    return folder, launcher


def test_launch_script_and_readme_say_medusa(medusa_repo, tmp_path):
    repo, config = medusa_repo
    upstream, launcher = _upstream_without_bls(tmp_path / "upstream")
    env = {**os.environ, "TRTLLM_TRITON_MODELS": str(upstream), "TRTLLM_TRITON_LAUNCHER": str(launcher)}
    started = subprocess.run([str(repo / "launch.sh")], capture_output=True, text=True, env=env, timeout=60)
    assert started.returncode == 0, started.stderr
    # orchestrator + the two target ranks; one TensorRT-LLM model
    assert "LAUNCH --world_size 3 " in started.stdout
    assert "--tensorrt_llm_model_name tensorrt_llm --multi-model" in started.stdout
    assert (repo / "preprocessing" / "1" / "model.py").read_text() == "# FAKE upstream preprocessing\n"
    assert "Medusa" in (repo / "launch.sh").read_text().splitlines()[1]
    readme = (repo / "README.md").read_text()
    assert "Medusa" in readme.splitlines()[0] and "Greedy only" in readme
    assert "5 nodes, depth" in readme and "/v2/models/ensemble/generate" in readme
    assert "tensorrt_llm_bls" not in readme and "tensorrt_llm_draft" not in readme and "num_draft_tokens" not in readme


def test_the_shipped_medusa_config_deploys_the_default_tree_on_one_engine(shipped_repo):
    repo, config = shipped_repo
    configs = read_repo(repo)
    assert set(configs) == {"preprocessing", "postprocessing", "tensorrt_llm", "ensemble"}
    decoding = recorded_decoding_config(configs["tensorrt_llm"])
    assert decoding["decoding_mode"] == "DecodingMode.Medusa"
    assert TokenTree.from_choices(decoding["medusa_choices"]).paths == config.speculative.medusa.tree().paths
    assert len(decoding["medusa_choices"]) == 63  # mc_sim_7b_63, TensorRT-LLM's own default tree
    unset = trtllm_repo.tensorrt_llm_unset(config)
    upstream, _ = template("tensorrt_llm")
    assert set(upstream.parameters) == set(params(configs["tensorrt_llm"])) | set(unset)
