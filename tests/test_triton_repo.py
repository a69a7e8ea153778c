"""Fast tests of the Triton repository generators (no server, no engines needed for the trtllm layout).

Every generated config.pbtxt is parsed back into tritonclient's ModelConfig message.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli, tiny_config_dict, write_config
from tritonclient.grpc import model_config_pb2 as mc

from pipeline.config import parse_config
from pipeline.errors import EngineError
from pipeline.executor import RequestError
from pipeline.triton import torch_repo, trtllm_repo
from pipeline.triton.pbtxt import parse, to_text
from pipeline.triton.repository import deploy
from pipeline.triton.request_inputs import parse_request


def trtllm_config_dict(name: str = "big-tp4") -> dict:
    return {
        "name": name, "backend": "trtllm",
        # dtype written: auto would read each model's config.json, which this offline test has no copy of
        "target": {"model": "meta-llama/Llama-3.3-70B-Instruct", "dtype": "bfloat16"},
        "draft": {"model": "meta-llama/Llama-3.2-1B-Instruct", "dtype": "bfloat16"},
        "speculative": {"max_draft_len": 5, "acceptance": "rejection"},
        "build": {"max_batch_size": 8, "max_input_len": 4096, "max_seq_len": 8192, "parallel": {"tp": 4, "pp": 1},
                  "kv_cache": {"free_gpu_mem_fraction": 0.85}},
        "runtime": {"target_device_ids": [0, 1, 2, 3], "draft_device_ids": [0]},
        "serve": {"http_port": 9000, "grpc_port": 9001, "metrics_port": 9002, "max_queue_delay_us": 100},
    }


def read_repo(repo: Path) -> dict[str, mc.ModelConfig]:
    configs = {}
    for path in sorted(repo.glob("*/config.pbtxt")):
        config = parse(path.read_text())
        assert config.name == path.parent.name, f"{path}: name {config.name!r} differs from its folder"
        assert (path.parent / "1").is_dir(), f"{path.parent}: Triton needs a version folder"
        configs[config.name] = config
    return configs


def params(config: mc.ModelConfig) -> dict[str, str]:
    return {key: value.string_value for key, value in config.parameters.items()}


@pytest.fixture(scope="module")
def trtllm_repo_dir(tmp_path_factory) -> tuple[Path, object]:
    engines = tmp_path_factory.mktemp("trtllm") / "engines"
    config = parse_config(trtllm_config_dict())
    result = deploy(config, engines)
    return result.path, config


def test_trtllm_layout_has_the_six_models(trtllm_repo_dir):
    repo, _ = trtllm_repo_dir
    configs = read_repo(repo)
    assert set(configs) == {"preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_draft",
                            "tensorrt_llm_bls", "ensemble"}
    assert configs["tensorrt_llm"].backend == configs["tensorrt_llm_draft"].backend == "tensorrtllm"
    assert {configs[m].backend for m in ("preprocessing", "postprocessing", "tensorrt_llm_bls")} == {"python"}
    assert configs["ensemble"].platform == "ensemble"
    assert all(c.max_batch_size == 8 for c in configs.values())


def test_trtllm_engine_parameters_come_from_the_config(trtllm_repo_dir):
    repo, _ = trtllm_repo_dir
    configs = read_repo(repo)
    engines = repo.parent
    target, draft = params(configs["tensorrt_llm"]), params(configs["tensorrt_llm_draft"])
    assert target["gpt_model_path"] == str(engines / "target" / "build")
    assert draft["gpt_model_path"] == str(engines / "draft" / "build")
    # GPU 0 holds target rank 0 and the draft: the two KV fractions split the configured 0.85.
    assert (target["kv_cache_free_gpu_mem_fraction"], draft["kv_cache_free_gpu_mem_fraction"]) == ("0.68", "0.17")
    for p in (target, draft):
        assert p["gpt_model_type"] == "inflight_fused_batching"
        assert p["max_beam_width"] == "1"
        assert p["enable_kv_cache_reuse"] == "true"
        assert p["speculative_decoding_fast_logits"] == "true"
        assert p["decoding_mode"] == "top_k_top_p"
        assert "${" not in to_text(configs["tensorrt_llm"])
    assert target["gpu_device_ids"] == "0,1,2,3" and draft["gpu_device_ids"] == "0"
    assert target["participant_ids"] == "1,2,3,4" and draft["participant_ids"] == "5"
    assert configs["tensorrt_llm"].dynamic_batching.max_queue_delay_microseconds == 100
    bls = params(configs["tensorrt_llm_bls"])
    assert bls["tensorrt_llm_model_name"] == "tensorrt_llm"
    assert bls["tensorrt_llm_draft_model_name"] == "tensorrt_llm_draft"
    # The tokenizer copy that build puts in the target engine folder, not the gated hub id.
    for name in ("preprocessing", "postprocessing"):
        assert params(configs[name])["tokenizer_dir"] == str(engines / "target" / "build" / "tokenizer")
    assert target["tokenizer_dir"] == str(engines / "target" / "build" / "tokenizer")
    assert draft["tokenizer_dir"] == str(engines / "draft" / "build" / "tokenizer")


def _tensors(config, kind):
    return {t.name: t for t in getattr(config, kind)}


def test_trtllm_tensor_names_and_dtypes_match_upstream(trtllm_repo_dir):
    repo, _ = trtllm_repo_dir
    configs = read_repo(repo)
    llm_in = _tensors(configs["tensorrt_llm"], "input")
    assert llm_in["input_ids"].data_type == mc.TYPE_INT32 and list(llm_in["input_ids"].dims) == [-1]
    assert llm_in["draft_input_ids"].optional and llm_in["draft_input_ids"].allow_ragged_batch
    assert llm_in["draft_logits"].data_type == mc.TYPE_FP32 and list(llm_in["draft_logits"].dims) == [-1, -1]
    assert llm_in["draft_acceptance_threshold"].data_type == mc.TYPE_FP32
    assert llm_in["seed"].data_type == mc.TYPE_UINT64
    assert llm_in["request_output_len"].HasField("reshape") and list(llm_in["request_output_len"].reshape.shape) == []
    llm_out = _tensors(configs["tensorrt_llm"], "output")
    for stat in ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"):
        assert stat in llm_out
    bls_in = _tensors(configs["tensorrt_llm_bls"], "input")
    assert bls_in["num_draft_tokens"].data_type == mc.TYPE_INT32
    assert bls_in["use_draft_logits"].data_type == mc.TYPE_BOOL
    assert bls_in["text_input"].data_type == mc.TYPE_STRING and not bls_in["text_input"].optional
    assert not configs["tensorrt_llm_bls"].model_transaction_policy.decoupled


def test_ensemble_steps_are_wired_consistently(trtllm_repo_dir):
    repo, _ = trtllm_repo_dir
    configs = read_repo(repo)
    ensemble = configs["ensemble"]
    available = {t.name for t in ensemble.input}
    for step in ensemble.ensemble_scheduling.step:
        model = configs[step.model_name]
        inputs, outputs = _tensors(model, "input"), _tensors(model, "output")
        for model_input, tensor in step.input_map.items():
            assert model_input in inputs, f"{step.model_name} has no input {model_input}"
            assert tensor in available, f"{step.model_name}.{model_input} reads {tensor}, produced by no one"
        for model_output, tensor in step.output_map.items():
            assert model_output in outputs, f"{step.model_name} has no output {model_output}"
            available.add(tensor)
    assert {t.name for t in ensemble.output} <= available


def test_trtllm_launch_script_and_world_size(trtllm_repo_dir):
    repo, config = trtllm_repo_dir
    assert trtllm_repo.RankPlan.for_config(config).world_size == 6  # orchestrator + 4 target + 1 draft
    script = (repo / "launch.sh").read_text()
    assert "launch_triton_server.py" in script and "/app/all_models/inflight_batcher_llm" in script
    assert "--world_size 6" in script and '--model_repo "$HERE"' in script
    assert "--tensorrt_llm_model_name tensorrt_llm,tensorrt_llm_draft --multi-model" in script
    assert "--http_port 9000 --grpc_port 9001 --metrics_port 9002" in script
    assert all(f"$UPSTREAM/{m}/1/." in script for m in trtllm_repo.UPSTREAM_PYTHON_MODELS)
    assert (repo / "launch.sh").stat().st_mode & 0o111
    readme = (repo / "README.md").read_text()
    assert f"python3 scripts/launch_triton_server.py --world_size 6 --model_repo {repo}" in readme


def test_deploy_is_atomic_and_up_to_date(trtllm_repo_dir):
    repo, config = trtllm_repo_dir
    again = deploy(config, repo.parent.parent)
    assert again.status == "up to date"
    assert not [p for p in repo.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


@pytest.mark.parametrize("instances, proxies", [(2, 4), (6, 6)])
def test_torch_model_configs(tmp_path, instances, proxies):
    config = parse_config(tiny_config_dict(tmp_path, serve={"instances": instances, "max_queue_delay_us": 50}))
    for name, engine in (("speculative", False), ("speculative_stream", True)):
        model = parse(to_text(torch_repo.model_config(config, name, engine, tmp_path / "engines" / "x")))
        assert model.backend == "python" and model.max_batch_size == 4
        assert model.model_transaction_policy.decoupled is engine
        # one engine instance (the models load once and batch together); proxies enough to fill its batch
        assert model.instance_group[0].count == (1 if engine else proxies)
        assert model.dynamic_batching.max_queue_delay_microseconds == 50
        inputs, outputs = _tensors(model, "input"), _tensors(model, "output")
        # the engine model also takes cancel-only requests, so it checks max_tokens itself
        assert inputs["max_tokens"].optional is engine
        assert inputs["text_input"].optional and inputs["input_ids"].optional
        assert ("request_key" in inputs and "cancel_request" in inputs) is engine
        assert inputs["seed"].data_type == mc.TYPE_UINT64
        for stat in ("draft_tokens", "accepted_tokens", "target_steps", "acceptance_rate", "mean_accepted_len"):
            assert stat in outputs
        p = params(model)
        assert Path(p["engines_dir"]).is_absolute() and (Path(p["pipeline_root"]) / "pipeline").is_dir()
        assert p["device"] == "cpu" and p["role"] == ("engine" if engine else "proxy")
        assert p["engine_model"] == "speculative_stream"


def test_torch_deploy_needs_built_engines(tmp_path):
    config = parse_config(tiny_config_dict(tmp_path))
    with pytest.raises(EngineError, match="no completed target engine.*pipeline build"):
        deploy(config, tmp_path / "engines")
    assert not (tmp_path / "engines" / config.name / "triton").exists()


def test_deploy_and_serve_cli_for_trtllm(tmp_path):
    path = write_config(tmp_path, trtllm_config_dict("cli-tp4"))
    engines = tmp_path / "engines"
    done = run_cli("deploy", str(path), "--engines-dir", str(engines), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "deploy built" in done.stdout
    served = run_cli("serve", str(path), "--engines-dir", str(engines), timeout=120)
    assert served.returncode == 0, served.stderr
    assert "repository up to date" in served.stdout
    assert "python3 scripts/launch_triton_server.py --world_size 6" in served.stdout
    assert "not available here" in served.stdout


# ---- request validation (the rules the Python model applies) ------------------------------------------------------

def _get(**tensors):
    values = {k: np.asarray(v) for k, v in tensors.items()}
    return values.get


def test_parse_request_defaults_and_values():
    args = parse_request(_get(text_input=[[b"hello"]], max_tokens=np.array([[8]], np.int32)), 4)
    assert args.prompt == "hello" and args.max_new_tokens == 8
    assert (args.temperature, args.top_k, args.top_p, args.seed, args.max_draft_len) == (0.0, 0, 1.0, None, None)
    args = parse_request(_get(input_ids=np.array([[1, 2, 3]], np.int32), max_tokens=np.array([[2]], np.int32),
                              temperature=np.array([[0.7]], np.float32), seed=np.array([[2**63]], np.uint64),
                              num_draft_tokens=np.array([[0]], np.int32)), 4)
    assert args.prompt == [1, 2, 3] and args.seed == 2**63 and args.max_draft_len == 0
    assert args.temperature == pytest.approx(0.7)


@pytest.mark.parametrize("tensors, field", [
    (dict(text_input=[[b"x"]], max_tokens=np.array([[-1]], np.int32)), "max_tokens: -1"),
    (dict(text_input=[[b"x"]]), "max_tokens: required"),
    (dict(max_tokens=np.array([[1]], np.int32)), "text_input / input_ids"),
    (dict(text_input=[[b"x"]], input_ids=[[1]], max_tokens=np.array([[1]], np.int32)), "text_input / input_ids"),
    (dict(text_input=[[b"x"]], max_tokens=np.array([[1]], np.int32), top_p=np.array([[0.0]], np.float32)),
     "top_p: 0.0"),
    (dict(text_input=[[b"x"]], max_tokens=np.array([[1]], np.int32), temperature=np.array([[-1.0]], np.float32)),
     "temperature: -1.0"),
    (dict(text_input=[[b"x"]], max_tokens=np.array([[1]], np.int32), top_k=np.array([[-2]], np.int32)),
     "top_k: -2"),
    (dict(text_input=[[b"x"]], max_tokens=np.array([[1]], np.int32), num_draft_tokens=np.array([[9]], np.int32)),
     "num_draft_tokens: 9 is larger than the 4 the target engine was built for"),
    (dict(text_input=[[b"a"], [b"b"]], max_tokens=np.array([[1]], np.int32)), "text_input: expected one string"),
    (dict(text_input=[[b"x"]], max_tokens=np.array([[1.5]], np.float32)), "max_tokens: dtype float32"),
    (dict(text_input=[[b"\xff"]], max_tokens=np.array([[1]], np.int32)), "text_input: not valid UTF-8"),
])
def test_parse_request_rejects_bad_values(tensors, field):
    with pytest.raises(RequestError, match=field):
        parse_request(_get(**tensors), 4)
