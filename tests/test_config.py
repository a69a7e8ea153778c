"""Typed config: every shipped YAML loads; bad configs fail with the field, the value and the fix."""

import json
from pathlib import Path

import pytest
import yaml

from pipeline.checks import resolve_build_limits
from pipeline.config import DEFAULT_MAX_SEQ_LEN_CAP, MAX_DRAFT_LEN_LIMIT, json_schema, load_config, parse_config
from pipeline.errors import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def minimal(**overrides):
    data = {"name": "t", "target": {"model": "org/target"}, "draft": {"model": "org/draft"}}
    data.update(overrides)
    return data


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    config = load_config(path)
    assert config.name == path.stem  # engines/<name>/ is found from the file name
    assert config.serve.bind_address == "127.0.0.1"  # safe default kept in every shipped config
    assert config.speculative.max_draft_len >= 1
    assert config.target.trust_remote_code is False
    assert config.draft is None or config.draft.trust_remote_code is False  # ngram configs have no draft
    if config.backend == "trtllm":
        assert config.build.parallel.world_size == len(config.runtime.target_device_ids)


def test_shipped_configs_cover_the_required_pairs():
    names = {load_config(p).name for p in CONFIGS}
    assert "tiny" in names
    models = {(c.target.model, c.draft.model if c.draft else None) for c in map(load_config, CONFIGS)}
    assert ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct") in models
    assert ("meta-llama/Llama-3.3-70B-Instruct", "meta-llama/Llama-3.2-1B-Instruct") in models
    assert ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct") in models
    tp4 = [load_config(p) for p in CONFIGS if "70b" in p.name.lower()]
    assert tp4 and tp4[0].build.parallel.tp == 4


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.stem.startswith("smollm2-135m")], ids=lambda p: p.name)
def test_real_model_configs_make_their_models_first(path):
    """`make build-engines CONFIG=...` runs `make real-model` first (dry run, every rule taken as out of date)."""
    import subprocess

    repo = path.parents[1]
    plan = subprocess.run(["make", "-n", "-B", "build-engines", f"CONFIG=configs/{path.name}"], cwd=repo,
                          capture_output=True, text=True, check=True).stdout.splitlines()
    made = next(i for i, line in enumerate(plan) if "scripts/make_real_model.py" in line)
    assert made < next(i for i, line in enumerate(plan) if "-m pipeline build" in line)


def test_defaults():
    config = parse_config(minimal())
    assert config.backend == "torch"
    assert config.speculative.max_draft_len == 4 and config.speculative.acceptance == "rejection"
    assert config.build.parallel.tp == 1 and config.build.kv_cache.paged
    assert config.serve.bind_address == "127.0.0.1"
    assert config.target.allow_pickle is False


@pytest.mark.parametrize("data, expected", [
    (minimal(speculative={"max_draft_len": 0}), ["speculative.max_draft_len", "0", f"between 1 and {MAX_DRAFT_LEN_LIMIT}"]),
    (minimal(speculative={"max_draft_len": 99}), ["speculative.max_draft_len", "99"]),
    (minimal(speculative={"max_draft_len": "four"}), ["speculative.max_draft_len", "'four'"]),
    (minimal(speculative={"acceptance": "fuzzy"}), ["speculative.acceptance", "'fuzzy'", "greedy", "rejection"]),
    (minimal(backend="onnx"), ["backend", "'onnx'", "torch", "trtllm"]),
    (minimal(target={"model": "x/y", "dtype": "int3"}), ["target.dtype", "'int3'"]),
    (minimal(target={"model": "x/y", "modle": 1}), ["target.modle", "unknown key", "spelling"]),
    (minimal(colour="red"), ["colour", "unknown key"]),
    ({"name": "t", "target": {"model": "a/b"}}, ["draft", "required", "add"]),
    (minimal(build={"max_input_len": 4096, "max_seq_len": 2048}), ["build.max_input_len", "4096", "max_seq_len"]),
    (minimal(build={"parallel": {"tp": 0}}), ["build.parallel.tp", "0"]),
    (minimal(build={"kv_cache": {"tokens_per_block": 48}}), ["build.kv_cache.tokens_per_block", "48",
                                                             "power of two"]),
    (minimal(serve={"http_port": 8001}), ["serve ports must differ"]),
    (minimal(serve={"http_port": 70000}), ["serve.http_port", "70000"]),
    (minimal(name="bad name/with slash"), ["name", "bad name/with slash"]),
    (minimal(target={"model": "  "}), ["target.model"]),
])
def test_bad_configs_name_field_value_and_fix(data, expected):
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    message = str(err.value)
    assert "\n" not in message
    for part in expected:
        assert part in message, (part, message)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as err:
        parse_config(minimal(backend="x", speculative={"max_draft_len": 0}))
    assert "backend" in str(err.value) and "max_draft_len" in str(err.value)


def test_malformed_yaml_names_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\ntarget: {model: a/b\ndraft: [\n")
    with pytest.raises(ConfigError, match=r"malformed YAML at line \d+"):
        load_config(path)


def test_not_a_mapping_and_missing_file(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(path)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_relative_model_paths_resolve_against_config_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "c.yaml"
    path.write_text(yaml.safe_dump(minimal(target={"model": "../models/t"}, draft={"model": "../models/d"})))
    config = load_config(path)
    assert config.base_dir == (tmp_path / "sub").resolve()


def test_json_schema_lists_sections():
    schema = json_schema()
    assert {"name", "backend", "target", "draft", "speculative", "build", "serve"} <= set(schema["properties"])
    assert schema["additionalProperties"] is False


# ---- build limits the config leaves out come from the models -------------------------------------------------------

def test_schema_documents_the_derived_build_limits():
    build = json_schema()["$defs"]["BuildSpec"]["properties"]
    for key in ("max_seq_len", "max_input_len"):
        assert build[key]["default"] is None  # optional: no fixed number that could exceed a model's limit
    assert "max_position_embeddings" in build["max_seq_len"]["description"]
    assert str(DEFAULT_MAX_SEQ_LEN_CAP) in build["max_seq_len"]["description"]
    assert "half of max_seq_len" in build["max_input_len"]["description"]


@pytest.mark.parametrize("build, limits, expected", [
    ({}, {"target": 512, "draft": 1024}, (512, 256)),  # the smaller model's limit
    ({}, {"target": 131072, "draft": 131072}, (DEFAULT_MAX_SEQ_LEN_CAP, DEFAULT_MAX_SEQ_LEN_CAP // 2)),  # capped
    ({}, {"target": None, "draft": None}, (DEFAULT_MAX_SEQ_LEN_CAP, DEFAULT_MAX_SEQ_LEN_CAP // 2)),  # unknown
    ({"max_seq_len": 300}, {"target": 512, "draft": 512}, (300, 150)),  # set: kept, input derived from it
    ({"max_input_len": 100}, {"target": 512, "draft": 2048}, (512, 100)),
    ({"max_input_len": 100, "max_seq_len": 4096}, {"target": 512, "draft": 512}, (4096, 100)),  # kept as written
])
def test_build_limits_left_out_are_derived_from_the_models(build, limits, expected):
    config = parse_config(minimal(build=build))
    resolved, notes = resolve_build_limits(config.build, limits)
    assert (resolved.max_seq_len, resolved.max_input_len) == expected
    # every derived value is announced with where it came from; values the config sets are not
    assert len(notes) == 2 - len({"max_seq_len", "max_input_len"} & set(build))
    assert all(("not set" in line) for line in notes)
    assert ("max_seq_len" not in build) == any(line.startswith(f"build.max_seq_len: {expected[0]} ") for line in notes)


def _tiny_model(folder: Path, max_positions: int, tokenizer) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
                      eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pair_512(tmp_path_factory) -> Path:
    """An untrained target/draft pair whose models allow 512 positions (GPT-2 allows 1024, many small ones 512)."""
    from pipeline.tinymodels import train_tokenizer

    root = tmp_path_factory.mktemp("pair_512")
    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n" * 20], 300)
    _tiny_model(root / "target", 512, tokenizer)
    _tiny_model(root / "draft", 512, tokenizer)
    return root


def _five_key_config(folder: Path, backend: str) -> Path:
    path = folder / f"five-{backend}.yaml"
    path.write_text(yaml.safe_dump({"name": f"five-{backend}", "backend": backend, "target": {"model": "target"},
                                    "draft": {"model": "draft"}, "speculative": {"max_draft_len": 3}}))
    return path


def test_five_key_config_over_a_512_position_pair_checks_and_builds(pair_512, capsys):
    from pipeline.executor import SpeculativeExecutor
    from pipeline.stages import run_check, run_stages, verify_engines

    config = load_config(_five_key_config(pair_512, "torch"))
    assert config.build.max_seq_len is None and config.build.max_input_len is None
    report = run_check(config)
    out = capsys.readouterr().out
    assert "default  build.max_seq_len: 512 (not set: the models' position limit (target 512, draft 512)" in out
    assert "default  build.max_input_len: 256 (not set: half of max_seq_len)" in out
    assert (report.build.max_seq_len, report.build.max_input_len) == (512, 256)

    engines = pair_512 / "engines"
    run_stages(config, engines, ("convert", "build"))
    root = engines / config.name
    for role in ("target", "draft"):
        engine = json.loads((root / role / "build" / "engine.json").read_text())
        assert (engine["max_seq_len"], engine["max_input_len"]) == (512, 256)
        manifest = json.loads((root / role / "build" / "manifest.json").read_text())
        assert (manifest["config"]["build"]["max_seq_len"], manifest["config"]["build"]["max_input_len"]) == \
            (512, 256)
    verify_engines(config, engines)  # the same five-key config matches the engines built from it
    executor = SpeculativeExecutor.from_engines(root, device="cpu")
    assert (executor.max_seq_len, executor.max_input_len, executor.max_draft_len) == (512, 256, 3)
    assert len(executor.generate([[5, 6, 7]], max_new_tokens=4)[0].token_ids) == 4


def test_five_key_trtllm_config_gets_concrete_limits_in_the_build_command(pair_512):
    from pipeline.stages import Layout, build_role

    config = load_config(_five_key_config(pair_512, "trtllm"))
    plan = build_role(config, Layout.for_config(config, pair_512 / "engines"), "target", dry_run=True)
    argv, engine_json = plan[0], plan[-1]  # the trtllm-build command, then the engine.json it leads to
    assert "--max_seq_len 512" in argv and "None" not in argv
    assert '"max_seq_len": 512' in engine_json and '"max_input_len": 256' in engine_json  # what the build writes


def test_set_limits_are_still_checked_against_the_models(pair_512, tmp_path):
    from pipeline.checks import check_pair

    data = yaml.safe_load(_five_key_config(pair_512, "torch").read_text())
    for build, message in [({"max_seq_len": 1024}, "build.max_seq_len: 1024 exceeds target max_position_embeddings"),
                           ({"max_input_len": 600}, "build.max_input_len: 600 must be below build.max_seq_len (512")]:
        path = pair_512 / "limits.yaml"
        path.write_text(yaml.safe_dump({**data, "build": build}))
        report = check_pair(load_config(path))
        assert any(message in error for error in report.errors), report.errors
