"""pipeline/config.py: every shipped YAML loads; bad configs fail with the field, the value and the fix; any input is a
config or a ConfigError, never a crash."""

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

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
    (minimal(target={"model": "x/y", "modle": 1}), ["target.modle: unknown key; did you mean 'model'?"]),
    (minimal(colour="red"), ["colour: unknown key; remove it (the keys of the top level: name, backend, target,"]),
    ({"name": "t", "target": {"model": "a/b"}}, ["draft", "required", "add"]),
    (minimal(build={"max_input_len": 4096, "max_seq_len": 2048}), ["build.max_input_len", "4096", "max_seq_len"]),
    (minimal(build={"parallel": {"tp": 0}}), ["build.parallel.tp", "0"]),
    (minimal(build={"kv_cache": {"tokens_per_block": 48}}), ["build.kv_cache.tokens_per_block", "48",
                                                             "power of two"]),
    (minimal(serve={"http_port": 8001}), ["serve ports must differ"]),
    (minimal(serve={"http_port": 70000}), ["serve.http_port", "70000"]),
    (minimal(name="bad name/with slash"), ["name", "bad name/with slash"]),
    (minimal(target={"model": "  "}), ["target.model"]),
    (minimal(build={"quantization": {"mode": "fp8"}}), ["build.quantization.mode", "'fp8'", "backend trtllm",
                                                         "int8_weight_only"]),
    (minimal(build={"quantization": {"kv_cache": "int8"}}), ["build.quantization.kv_cache", "kv_cache: none"]),
    (minimal(backend="trtllm", build={"quantization": {"draft_mode": "int8_weight_only"}}),
     ["build.quantization.draft_mode", "draft_mode: none"]),
])
def test_bad_configs_name_field_value_and_fix(data, expected):
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    message = str(err.value)
    assert "\n" not in message
    for part in expected:
        assert part in message, (part, message)


@pytest.mark.parametrize("data, expected", [
    (minimal(specualtive={"max_draft_len": 4}), "specualtive: unknown key; did you mean 'speculative'?"),
    (minimal(Name="t"), "Name: unknown key; did you mean 'name'?"),
    (minimal(draft={"model": "a/c", "dtyp": "auto"}), "draft.dtyp: unknown key; did you mean 'dtype'?"),
    (minimal(speculative={"ngram": {"max_mtch": 3}}), "speculative.ngram.max_mtch: unknown key; did you mean "
                                                      "'max_match'?"),
    (minimal(speculative={"method": "medusa", "medusa": {"model": "h", "head": 3}}),
     "speculative.medusa.head: unknown key; did you mean 'heads'?"),
    (minimal(build={"kv_cache": {"tokens_per_blok": 64}}), "build.kv_cache.tokens_per_blok: unknown key; did you "
                                                           "mean 'tokens_per_block'?"),
    (minimal(serve={"metrics_prt": 9000}), "serve.metrics_prt: unknown key; did you mean 'metrics_port'?"),
    (minimal(build={"parallel": {"ep": 2}}), "build.parallel.ep: unknown key; remove it (the keys of build.parallel: "
                                             "tp, pp)"),
])
def test_unknown_key_suggests_the_closest_key_of_its_own_section(data, expected):
    """A typo names the closest key of the section it sits in (top level and every nested section, optional ones
    such as draft and speculative.medusa included), and a key like no other lists that section's keys; a
    suggestion taken from the wrong section ('tp' for a top-level key) or none at all fails here."""
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert str(err.value) == f"<config>: {expected}"


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


def test_config_method_rules(tiny_pair):
    from tests.conftest import tiny_config_dict

    from pipeline.config import parse_config
    from pipeline.errors import ConfigError

    data = tiny_config_dict(tiny_pair)
    del data["draft"]
    with pytest.raises(ConfigError, match="draft: required for speculative.method 'draft_model'.*method: ngram"):
        parse_config(data)
    with pytest.raises(ConfigError, match="'ngram\\+draft'"):
        parse_config({**data, "speculative": {"method": "ngram+draft"}})
    config = parse_config({**data, "speculative": {"method": "ngram", "ngram": {"min_match": 2, "max_match": 3}}})
    assert config.roles == ("target",) and config.speculative.ngram.min_match == 2
    with pytest.raises(ConfigError, match="speculative.ngram.min_match: 5 is above max_match"):
        parse_config({**data, "speculative": {"method": "ngram", "ngram": {"min_match": 5}}})
    with pytest.raises(ConfigError, match="speculative.method"):
        parse_config({**data, "speculative": {"method": "lookahead"}})
    suffix = parse_config({**data, "speculative": {"method": "suffix", "suffix": {"max_cached_requests": 0}}})
    assert suffix.roles == ("target",) and suffix.speculative.suffix.settings().max_cached_requests == 0
    for key, value in (("max_tree_depth", 1), ("min_token_prob", 1.5), ("max_spec_factor", 0)):
        with pytest.raises(ConfigError, match=f"speculative.suffix.{key}: {value} is invalid"):
            parse_config({**data, "speculative": {"method": "suffix", "suffix": {key: value}}})


yaml_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                         st.text(max_size=20))


yaml_values = st.recursive(yaml_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)), max_leaves=12)


section_keys = st.sampled_from(["name", "backend", "target", "draft", "speculative", "build", "serve", "runtime",
                                "model", "max_draft_len", "acceptance", "dtype", "parallel", "tp", "bogus"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(yaml_values, st.dictionaries(section_keys, yaml_values, max_size=8)))
def test_config_loader_never_crashes(data):
    try:
        config = parse_config(data)
    except ConfigError as exc:
        assert str(exc) and "\n" not in str(exc)
    else:
        assert config.speculative.max_draft_len >= 1


@settings(max_examples=150, deadline=None)
@given(st.fixed_dictionaries({}, optional={
    "speculative": st.fixed_dictionaries({}, optional={"max_draft_len": st.integers(-5, 40),
                                                       "acceptance": st.sampled_from(["greedy", "rejection", "x"])}),
    "build": st.fixed_dictionaries({}, optional={"max_input_len": st.integers(-5, 5000),
                                                 "max_seq_len": st.integers(-5, 5000),
                                                 "parallel": st.fixed_dictionaries({}, optional={
                                                     "tp": st.integers(-1, 9), "pp": st.integers(-1, 9)})}),
}))
def test_valid_looking_configs_validate_or_explain(overrides):
    data = {"name": "p", "target": {"model": "a/b"}, "draft": {"model": "a/c"}, **overrides}
    try:
        config = parse_config(data)
    except ConfigError as exc:
        assert any(f in str(exc) for f in ("speculative", "build", "serve")), str(exc)
    else:
        assert 1 <= config.speculative.max_draft_len <= 16
        build = config.build  # a limit left out is derived from the models by `check`
        assert None in (build.max_input_len, build.max_seq_len) or build.max_input_len < build.max_seq_len
        assert yaml.safe_load(yaml.safe_dump(config.resolved()))  # round-trips as plain data


VALID = """\
name: ok
target: {model: a/b}
draft: {model: a/c}
"""


def test_long_name_is_refused_at_load_naming_the_limit(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(VALID.replace("ok", "n" * 300))
    with pytest.raises(ConfigError, match=r"name: .* at most 100 characters"):
        load_config(path)  # refused before `build` tries to make a folder the file system cannot hold


def test_bad_values_are_printed_truncated():
    huge = "x" * 5_000_000
    with pytest.raises(ConfigError) as exc:
        parse_config({"name": "ok", "backend": huge, "target": {"model": "a/b"}, "draft": {"model": "a/c"},
                      huge: 1, "speculative": {"max_draft_len": [1] * 100_000}})
    message = str(exc.value)
    assert "backend: 'xxxx" in message and "speculative.max_draft_len: [1, 1" in message, message[:500]
    assert "unknown key" in message
    assert len(message) < 1500 and "\n" not in message, len(message)


def test_code_pair_config_reads_the_folders_make_trains():
    """configs/code-pair.yaml names the target and draft folders that `make train-pair` writes, and `make
    build-engines` with it trains the pair before building (dry run, every rule taken as out of date)."""
    import shlex
    import subprocess

    repo = CONFIGS[0].parents[1]
    config = load_config(repo / "configs" / "code-pair.yaml")
    assert config.backend == "torch" and config.runtime.device == "cpu"
    plan = subprocess.run(["make", "-n", "-B", "build-engines", "CONFIG=configs/code-pair.yaml"], cwd=repo,
                          capture_output=True, text=True, check=True).stdout.splitlines()
    train = next(i for i, line in enumerate(plan) if "scripts/train_code_pair.py" in line)
    assert train < next(i for i, line in enumerate(plan) if "-m pipeline build" in line)
    argv = shlex.split(plan[train])
    out = repo / argv[argv.index("--out") + 1]
    for role in ("target", "draft"):
        assert (config.base_dir / getattr(config, role).model).resolve() == (out / role).resolve(), role


def test_medusa_needs_its_heads_and_a_tree_that_fits_them():
    base = minimal(speculative={"method": "medusa", "medusa": {"model": "heads"}})
    base.pop("draft")
    config = parse_config(base)
    assert config.roles == ("target",) and config.speculative.medusa.paths()[:2] == [[0], [0, 0]]
    assert config.speculative.medusa.tree().size == 64  # mc_sim_7b_63 by default, as TensorRT-LLM
    problems = {
        "required for speculative.method 'medusa'": {"method": "medusa"},
        "4 deep but there are 2 heads": {"method": "medusa", "medusa": {"model": "h", "heads": 2,
                                                                        "choices": "mc_sim_7b_63"}},
        "is not a named tree": {"method": "medusa", "medusa": {"model": "h", "choices": "tree9"}},
        "is not a path": {"method": "medusa", "medusa": {"model": "h", "choices": [[0], [0, -1]]}},
        "above 63": {"method": "medusa", "medusa": {"model": "h", "choices": [[i] for i in range(64)]}},
    }
    for message, speculative in problems.items():
        data = minimal(speculative=speculative)
        data.pop("draft")
        with pytest.raises(ConfigError, match=message):
            parse_config(data)


def test_eagle3_needs_its_heads_and_the_torch_backend():
    base = minimal(speculative={"method": "eagle3", "eagle3": {"model": "heads"}})
    base.pop("draft")
    config = parse_config(base)
    assert config.roles == ("target",) and config.has_eagle3_heads
    assert config.eagle3_dir() == config.base_dir / "heads"
    for message, data in (("required for speculative.method 'eagle3'", {"speculative": {"method": "eagle3"}}),
                          ("is not built for backend trtllm", {"backend": "trtllm", "speculative": {
                              "method": "eagle3", "eagle3": {"model": "h"}}})):
        data = minimal(**data)
        data.pop("draft")
        with pytest.raises(ConfigError, match=message):
            parse_config(data)


def test_the_eagle3_configs_train_their_heads_before_building():
    """`make build-engines` with the EAGLE-3 configs trains the heads the config names, first."""
    import re
    import subprocess

    repo = CONFIGS[0].parents[1]
    for name in ("smollm2-135m-eagle3.yaml", "smollm2-135m-drafters.yaml"):
        config = load_config(repo / "configs" / name)
        plan = subprocess.run(["make", "-n", "-B", "build-engines", f"CONFIG=configs/{name}"], cwd=repo,
                              capture_output=True, text=True, check=True).stdout.splitlines()
        train = next(i for i, line in enumerate(plan) if "--kind eagle3" in line)
        assert train < next(i for i, line in enumerate(plan) if "-m pipeline build" in line)
        trained = load_config(repo / re.search(r"train-draft (configs/\S+\.yaml)", plan[train]).group(1))
        assert trained.eagle3_dir() == config.eagle3_dir(), name


def test_medusa_default_tree_is_cut_to_the_heads_but_a_written_tree_is_not():
    """medusa: {heads: 3} without choices: the default tree (4 deep) loses its depth-4 nodes instead of being
    refused; a tree the user wrote that is deeper than the heads is still an error naming the fix."""
    def medusa(**values):
        return parse_config(minimal(speculative={"method": "medusa", "medusa": {"model": "heads", **values}})
                            ).speculative.medusa

    full = medusa()
    cut = medusa(heads=3)
    assert (full.default_cut, cut.default_cut) == (False, True)
    assert full.tree().max_depth == 4 and cut.tree().max_depth == 3
    assert cut.paths() == [path for path in full.paths() if len(path) <= 3] and cut.tree().size < full.tree().size
    assert medusa(heads=1).paths() == [path for path in full.paths() if len(path) == 1]
    with pytest.raises(ConfigError, match="leave choices out"):
        medusa(heads=3, choices="mc_sim_7b_63")
