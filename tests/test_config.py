"""Typed config: every shipped YAML loads; bad configs fail with the field, the value and the fix."""

from pathlib import Path

import pytest
import yaml

from pipeline.config import MAX_DRAFT_LEN_LIMIT, json_schema, load_config, parse_config
from pipeline.errors import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def minimal(**overrides):
    data = {"name": "t", "target": {"model": "org/target"}, "draft": {"model": "org/draft"}}
    data.update(overrides)
    return data


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    config = load_config(path)
    assert config.name == path.stem or config.name  # named
    assert config.serve.bind_address == "127.0.0.1"  # safe default kept in every shipped config
    assert config.speculative.max_draft_len >= 1
    assert config.target.trust_remote_code is False and config.draft.trust_remote_code is False
    if config.backend == "trtllm":
        assert config.build.parallel.world_size == len(config.runtime.target_device_ids)


def test_shipped_configs_cover_the_required_pairs():
    names = {load_config(p).name for p in CONFIGS}
    assert "tiny" in names
    models = {(load_config(p).target.model, load_config(p).draft.model) for p in CONFIGS}
    assert ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct") in models
    assert ("meta-llama/Llama-3.3-70B-Instruct", "meta-llama/Llama-3.2-1B-Instruct") in models
    assert ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct") in models
    tp4 = [load_config(p) for p in CONFIGS if "70b" in p.name.lower()]
    assert tp4 and tp4[0].build.parallel.tp == 4


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
    ({"name": "t", "target": {"model": "a/b"}}, ["draft", "missing", "add it"]),
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
