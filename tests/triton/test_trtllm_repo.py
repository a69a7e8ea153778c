"""pipeline/triton/trtllm_repo.py: the tensorrtllm_backend model repository (no server, no engines needed).

Its layout (six models, parameters from the config, tensors, ensemble wiring, the launch script), parsed back into
tritonclient's ModelConfig; and every generated config.pbtxt against the recorded upstream template of the pinned
release (tests/data/trtllm_1.1.0_triton), for every shipped trtllm config deployed with `python -m pipeline deploy` and
no engines: each template parameter and tensor is present (or listed with a written reason), the values make sense
(local tokenizer, KV memory split on a shared GPU), and a pair whose vocabularies differ never forwards draft logits.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from tritonclient.grpc import model_config_pb2 as mc

from pipeline.backends.trtllm_api import DRAFT_KV_SHARE, PINNED_VERSION
from pipeline.config import load_config, parse_config
from pipeline.triton import trtllm_repo, trtllm_tensors as T
from pipeline.triton.pbtxt import parse, to_text
from pipeline.triton.repository import deploy
from tests.conftest import REPO, run_cli
from tests.triton_helpers import trtllm_config_dict

TEMPLATES = REPO / "tests" / "data" / f"trtllm_{PINNED_VERSION}_triton"
MODELS = {"tensorrt_llm": "tensorrt_llm", "tensorrt_llm_draft": "tensorrt_llm", "tensorrt_llm_bls": "tensorrt_llm_bls",
          "preprocessing": "preprocessing", "postprocessing": "postprocessing", "ensemble": "ensemble"}
# The shipped target + draft pairs (the Medusa config's one-engine layout: tests/triton/test_trtllm_medusa_repo.py)
SHIPPED = sorted(p for p in (REPO / "configs").glob("*.yaml") if yaml.safe_load(p.read_text())["backend"] == "trtllm"
                 and "draft" in yaml.safe_load(p.read_text()))
HEADER = re.compile(r"# recorded-from: repository=NVIDIA/TensorRT-LLM "
                    r"path=triton_backend/all_models/inflight_batcher_llm/(\w+)/config.pbtxt commit=[0-9a-f]{40}\n")

# Parameters of a template we do not write, with why (tensorrt_llm_draft uses the tensorrt_llm template).
UNSET = {"tensorrt_llm": trtllm_repo.TENSORRT_LLM_UNSET, "tensorrt_llm_draft": trtllm_repo.TENSORRT_LLM_UNSET,
         "preprocessing": trtllm_repo.PREPROCESSING_UNSET}
# Template variables in data_type and the value we fill in.
TEMPLATED_DTYPES = {"logits_datatype": T.LOGITS_DTYPE, "prompt_embedding_table_data_type": T.PROMPT_TABLE_DTYPE,
                    "encoder_input_features_data_type": T.ENCODER_FEATURES_DTYPE}


# ---- reading the recorded templates ------------------------------------------------------------------------------

def template_text(model: str) -> str:
    return (TEMPLATES / model / "config.pbtxt").read_text()


def load_template(text: str) -> tuple[mc.ModelConfig, dict[str, str]]:
    """The template as a ModelConfig (placeholders outside strings replaced so protobuf parses it), and for each
    tensor whose data_type is a template variable, that variable's name."""
    templated = {m.group(1): m.group(2) for m in re.finditer(r'name: "(\w+)"[,\s]+data_type: \$\{(\w+)\}', text)}
    text = re.sub(r"data_type: \$\{\w+\}", "data_type: TYPE_INVALID", text)
    text = re.sub(r"decoupled: \$\{\w+\}", "decoupled: false", text)
    text = re.sub(r'(?<!")\$\{\w+\}(?!")', "1", text)  # counts, sizes, delays
    return parse(text), templated


def template(model: str) -> tuple[mc.ModelConfig, dict[str, str]]:
    return load_template(template_text(model))


def tensor_key(tensor, templated: dict[str, str] | None = None) -> dict:
    dtype = mc.DataType.Name(tensor.data_type).removeprefix("TYPE_")
    if templated and tensor.name in templated:
        dtype = TEMPLATED_DTYPES[templated[tensor.name]]
    key = {"dtype": dtype, "dims": list(tensor.dims)}
    if isinstance(tensor, mc.ModelInput):
        key |= {"optional": tensor.optional, "ragged": tensor.allow_ragged_batch,
                "reshape": list(tensor.reshape.shape) if tensor.HasField("reshape") else None}
    return key


def params(config: mc.ModelConfig) -> dict[str, str]:
    return {key: value.string_value for key, value in config.parameters.items()}


def test_recorded_templates_name_their_source_and_parse():
    for model in set(MODELS.values()):
        text = template_text(model)
        header = HEADER.match(text)
        assert header and header.group(1) == model, f"{model}: first line must name repository, path and commit"
        config, _ = load_template(text)
        assert config.name == model and (config.input or model == "ensemble")


# ---- deploy every shipped config, no engines ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def shipped_repos(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """`python -m pipeline deploy` of each shipped trtllm config into an engines folder that holds nothing."""
    engines = tmp_path_factory.mktemp("deploy") / "engines"
    repos = {}
    for path in SHIPPED:
        done = run_cli("deploy", str(path), "--engines-dir", str(engines), timeout=120)
        assert done.returncode == 0, done.stderr
        config = load_config(path)
        repos[path.stem] = (engines.resolve() / config.name / "triton", config)
    return repos


def read_repo(repo: Path) -> dict[str, mc.ModelConfig]:
    return {p.parent.name: parse(p.read_text()) for p in repo.glob("*/config.pbtxt")}


def test_deploy_writes_every_model_for_every_shipped_config(shipped_repos):
    assert len(shipped_repos) >= 3
    for repo, _ in shipped_repos.values():
        assert set(read_repo(repo)) == set(MODELS)


def test_every_template_parameter_is_written_or_has_a_reason(shipped_repos):
    for stem, (repo, _) in shipped_repos.items():
        for name, config in read_repo(repo).items():
            expected = set(template(MODELS[name])[0].parameters)
            unset = UNSET.get(name, {})
            ours = set(params(config))
            assert all(reason.strip() for reason in unset.values())
            assert not (ours & set(unset)), f"{stem}/{name}: written and also listed as unset"
            missing = expected - ours - set(unset)
            assert not missing, f"{stem}/{name}: template parameters neither written nor explained: {missing}"
            assert not (set(unset) - expected), f"{stem}/{name}: reasons for parameters the template lacks"
            assert not (ours - expected), f"{stem}/{name}: parameters the release does not know: {ours - expected}"
            assert not any("${" in v for v in params(config).values()), f"{stem}/{name}: unfilled placeholder"


def test_parameters_the_backend_reads_without_default_are_present(shipped_repos):
    """model_instance_state.cc reads these with no fallback: a missing key stops the model from loading."""
    for repo, _ in shipped_repos.values():
        configs = read_repo(repo)
        for name in ("tensorrt_llm", "tensorrt_llm_draft"):
            p = params(configs[name])
            assert {"tokenizer_dir", "xgrammar_tokenizer_info_path", "guided_decoding_backend", "gpt_model_type",
                    "gpt_model_path"} <= set(p)
            assert p["guided_decoding_backend"] == "" and p["xgrammar_tokenizer_info_path"] == ""  # no grammar


def test_every_template_tensor_is_declared_alike(shipped_repos):
    repo, _ = shipped_repos["llama3.1-8b_llama3.2-1b"]
    for name, config in read_repo(repo).items():
        upstream, templated = template(MODELS[name])
        for kind in ("input", "output"):
            theirs = {}
            for t in getattr(upstream, kind):
                theirs.setdefault(t.name, tensor_key(t, templated))  # upstream's ensemble repeats one output
            ours = {t.name: tensor_key(t) for t in getattr(config, kind)}
            assert len(ours) == len(getattr(config, kind)), f"{name}: a {kind} is declared twice"
            assert ours == theirs, f"{name} {kind}s differ from the template: " + str(
                {n: (ours.get(n), theirs.get(n)) for n in set(ours) | set(theirs) if ours.get(n) != theirs.get(n)})


def test_ensemble_wiring_matches_the_template(shipped_repos):
    repo, _ = shipped_repos["qwen2.5-7b_qwen2.5-0.5b"]
    ours = read_repo(repo)["ensemble"].ensemble_scheduling.step
    theirs = template("ensemble")[0].ensemble_scheduling.step
    assert [s.model_name for s in ours] == [s.model_name for s in theirs]
    for a, b in zip(ours, theirs):
        assert dict(a.input_map) == dict(b.input_map) and dict(a.output_map) == dict(b.output_map), a.model_name


def test_tokenizer_is_the_local_copy_in_the_engine_folder(shipped_repos):
    for repo, config in shipped_repos.values():
        configs = read_repo(repo)
        engines = repo.parent
        target_tok = str(engines / "target" / "build" / "tokenizer")
        for name in ("preprocessing", "postprocessing"):
            assert params(configs[name])["tokenizer_dir"] == target_tok
            assert config.target.model not in params(configs[name])["tokenizer_dir"]  # not the (gated) hub id
        assert params(configs["tensorrt_llm"])["tokenizer_dir"] == target_tok
        assert params(configs["tensorrt_llm_draft"])["tokenizer_dir"] == str(engines / "draft" / "build" / "tokenizer")
        assert params(configs["preprocessing"])["gpt_model_path"] == str(engines / "target" / "build")


def test_kv_memory_is_split_on_a_shared_gpu(shipped_repos):
    for repo, config in shipped_repos.values():
        configs = read_repo(repo)
        target = float(params(configs["tensorrt_llm"])["kv_cache_free_gpu_mem_fraction"])
        draft = float(params(configs["tensorrt_llm_draft"])["kv_cache_free_gpu_mem_fraction"])
        fraction = config.build.kv_cache.free_gpu_mem_fraction
        # every shipped config puts the draft on GPU 0 beside the target (rank 0)
        assert set(config.runtime.draft_device_ids) & set(config.runtime.target_device_ids)
        assert target + draft <= fraction + 1e-9 and 0 < draft < target
        assert draft == pytest.approx(fraction * DRAFT_KV_SHARE)


# ---- item 7: vocabularies of different widths never meet in draft logits -----------------------------------------

def fake_engine(folder: Path, vocab: int) -> None:
    """The two fields deploy and launch.sh read from a trtllm-build config.json (a FAKE engine: no weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"version": PINNED_VERSION, "pretrained_config": {
        "architecture": "Qwen2ForCausalLM", "vocab_size": vocab, "mapping": {"world_size": 1}}, "build_config": {}}))


def qwen_config():
    return load_config(REPO / "configs" / "qwen2.5-7b_qwen2.5-0.5b.yaml")


def test_built_pair_with_different_widths_gets_no_draft_logits(tmp_path, capsys):
    config = qwen_config()
    engines = tmp_path / "engines"
    root = engines / config.name
    fake_engine(root / "target" / "build", 152064)
    fake_engine(root / "draft" / "build", 151936)
    result = deploy(config, engines)
    configs = read_repo(result.path)
    bls_inputs = {t.name for t in configs["tensorrt_llm_bls"].input}
    assert "use_draft_logits" not in bls_inputs and "num_draft_tokens" in bls_inputs
    for name in ("tensorrt_llm", "tensorrt_llm_draft"):
        assert params(configs[name])["speculative_decoding_fast_logits"] == "false"
    assert "152064 target rows, 151936 draft rows" in (result.path / "README.md").read_text()
    assert "vocab_size 151936 differs from the target's 152064" in capsys.readouterr().err
    assert "vocab_size" not in (result.path / "launch.sh").read_text()  # nothing left to check at launch
    # the same widths: draft logits are forwarded again (and deploy notices that the engines changed)
    fake_engine(root / "draft" / "build", 152064)
    again = deploy(config, engines)
    assert again.status != "up to date"
    assert "use_draft_logits" in {t.name for t in read_repo(again.path)["tensorrt_llm_bls"].input}


def _fake_upstream(folder: Path) -> tuple[Path, Path]:
    for model in trtllm_repo.UPSTREAM_PYTHON_MODELS:
        (folder / model / "1").mkdir(parents=True)
        (folder / model / "1" / "model.py").write_text(f"# FAKE upstream {model}\n")
    launcher = folder / "launcher.py"
    launcher.write_text("import sys\nprint('LAUNCH', *sys.argv[1:])\n")
    return folder, launcher


def _launch(repo: Path, upstream: Path, launcher: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRTLLM_TRITON_MODELS": str(upstream), "TRTLLM_TRITON_LAUNCHER": str(launcher)}
    return subprocess.run([str(repo / "launch.sh")], capture_output=True, text=True, env=env, timeout=60)


def test_launch_refuses_engines_of_different_widths_when_deployed_before_build(tmp_path):
    config = qwen_config()
    engines = tmp_path / "engines"
    result = deploy(config, engines)  # no engines yet: widths unknown, the repository forwards draft logits
    assert "use_draft_logits" in {t.name for t in read_repo(result.path)["tensorrt_llm_bls"].input}
    upstream, launcher = _fake_upstream(tmp_path / "upstream")
    root = engines / config.name
    assert result.path.stat().st_mode & stat.S_IXUSR
    missing = _launch(result.path, upstream, launcher)
    assert missing.returncode != 0 and "config.json: missing; build the engines first" in missing.stderr
    fake_engine(root / "target" / "build", 152064)
    fake_engine(root / "draft" / "build", 151936)
    refused = _launch(result.path, upstream, launcher)
    assert refused.returncode != 0 and "LAUNCH" not in refused.stdout
    (line,) = [x for x in refused.stderr.splitlines() if x.startswith("error:")]
    assert "vocab_size is 151936 but the target's is 152064" in line and "deploy CONFIG --force" in line
    fake_engine(root / "draft" / "build", 152064)
    started = _launch(result.path, upstream, launcher)
    assert started.returncode == 0, started.stderr
    assert "LAUNCH --world_size 3" in started.stdout and "--tensorrt_llm_model_name tensorrt_llm,tensorrt_llm_draft" \
        in started.stdout
    assert (result.path / "tensorrt_llm_bls" / "1" / "model.py").read_text() == "# FAKE upstream tensorrt_llm_bls\n"


def test_launch_names_the_missing_upstream_models(tmp_path):
    result = deploy(qwen_config(), tmp_path / "engines")
    done = _launch(result.path, tmp_path / "nowhere", tmp_path / "launcher.py")
    assert done.returncode != 0 and "TRTLLM_TRITON_MODELS" in done.stderr and PINNED_VERSION in done.stderr


# ---- on a GPU box: the recorded templates are the container's ----------------------------------------------------

CONTAINER_MODELS = Path(os.environ.get("TRTLLM_TRITON_MODELS", "/app/all_models/inflight_batcher_llm"))


@pytest.mark.gpu
@pytest.mark.skipif(not (CONTAINER_MODELS / "tensorrt_llm" / "config.pbtxt").is_file(),
                    reason=f"no Triton model templates at {CONTAINER_MODELS} (run in the TRT-LLM container)")
@pytest.mark.parametrize("model", sorted(set(MODELS.values())))
def test_recorded_templates_match_the_container(model):
    recorded, recorded_dtypes = template(model)
    installed, installed_dtypes = load_template((CONTAINER_MODELS / model / "config.pbtxt").read_text())
    assert set(recorded.parameters) == set(installed.parameters), model
    for kind in ("input", "output"):
        assert [t.name for t in getattr(recorded, kind)] == [t.name for t in getattr(installed, kind)], (model, kind)
        assert ({t.name: tensor_key(t, recorded_dtypes) for t in getattr(recorded, kind)}
                == {t.name: tensor_key(t, installed_dtypes) for t in getattr(installed, kind)}), (model, kind)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_generated_launch_script_and_smoke_script_are_shellcheck_clean(tmp_path):
    result = deploy(qwen_config(), tmp_path / "engines")
    done = subprocess.run(["shellcheck", str(result.path / "launch.sh"), str(REPO / "scripts" / "gpu_smoke.sh")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def read_checked_repo(repo: Path) -> dict[str, mc.ModelConfig]:
    configs = {}
    for path in sorted(repo.glob("*/config.pbtxt")):
        config = parse(path.read_text())
        assert config.name == path.parent.name, f"{path}: name {config.name!r} differs from its folder"
        assert (path.parent / "1").is_dir(), f"{path.parent}: Triton needs a version folder"
        configs[config.name] = config
    return configs


@pytest.fixture(scope="module")
def trtllm_repo_dir(tmp_path_factory) -> tuple[Path, object]:
    engines = tmp_path_factory.mktemp("trtllm") / "engines"
    config = parse_config(trtllm_config_dict())
    result = deploy(config, engines)
    return result.path, config


def test_trtllm_layout_has_the_six_models(trtllm_repo_dir):
    repo, _ = trtllm_repo_dir
    configs = read_checked_repo(repo)
    assert set(configs) == {"preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_draft",
                            "tensorrt_llm_bls", "ensemble"}
    assert configs["tensorrt_llm"].backend == configs["tensorrt_llm_draft"].backend == "tensorrtllm"
    assert {configs[m].backend for m in ("preprocessing", "postprocessing", "tensorrt_llm_bls")} == {"python"}
    assert configs["ensemble"].platform == "ensemble"
    assert all(c.max_batch_size == 8 for c in configs.values())


def test_trtllm_engine_parameters_come_from_the_config(trtllm_repo_dir):
    repo, _ = trtllm_repo_dir
    configs = read_checked_repo(repo)
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
    configs = read_checked_repo(repo)
    llm_in = _tensors(configs["tensorrt_llm"], "input")
    assert llm_in["input_ids"].data_type == mc.TYPE_INT32 and list(llm_in["input_ids"].dims) == [-1]
    assert llm_in["draft_input_ids"].optional and llm_in["draft_input_ids"].allow_ragged_batch
    assert llm_in["draft_logits"].data_type == mc.TYPE_FP32 and list(llm_in["draft_logits"].dims) == [-1, -1]
    assert llm_in["draft_acceptance_threshold"].data_type == mc.TYPE_FP32
    assert llm_in["seed"].data_type == mc.TYPE_UINT64
    assert llm_in["request_output_len"].HasField("reshape") and list(llm_in["request_output_len"].reshape.shape) == []
    llm_out = _tensors(configs["tensorrt_llm"], "output")
    for name in ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"):
        assert name in llm_out
    bls_in = _tensors(configs["tensorrt_llm_bls"], "input")
    assert bls_in["num_draft_tokens"].data_type == mc.TYPE_INT32
    assert bls_in["use_draft_logits"].data_type == mc.TYPE_BOOL
    assert bls_in["text_input"].data_type == mc.TYPE_STRING and not bls_in["text_input"].optional
    assert not configs["tensorrt_llm_bls"].model_transaction_policy.decoupled


def test_ensemble_steps_are_wired_consistently(trtllm_repo_dir):
    repo, _ = trtllm_repo_dir
    configs = read_checked_repo(repo)
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
