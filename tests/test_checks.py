"""pipeline/checks.py: the `check` stage refuses a pair or a config that cannot work (tokenizers, lengths, vocabularies,
bind address), and derives the build limits a config leaves out from the models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from transformers import AutoModelForCausalLM

from pipeline.checks import check_pair, resolve_build_limits
from pipeline.config import DEFAULT_MAX_SEQ_LEN_CAP, load_config, parse_config
from pipeline.errors import CompatibilityError
from pipeline.tinymodels import train_tokenizer
from tests.conftest import one_error_line, run_cli, tiny_config_dict, write_config


@pytest.fixture
def pair(pair_copy) -> Path:
    return pair_copy


def _config(pair: Path, tmp_path: Path, **overrides) -> Path:
    data = tiny_config_dict(pair, name="models", **overrides)
    return write_config(tmp_path, data)


def _one_error_line(result) -> str:
    return one_error_line(result, ignore_warnings=True)


def test_ipv6_bind_address_is_refused_by_check(tiny_pair, tmp_path):
    # tritonserver 2.51 binds gRPC to '::1' only with brackets and HTTP with them to every address: refuse it.
    config = write_config(tmp_path, tiny_config_dict(tiny_pair, name="v6", serve={"bind_address": "::1"}))
    line = _one_error_line(run_cli("check", str(config)))
    assert "serve.bind_address: '::1'" in line and "127.0.0.1" in line, line


def test_draft_with_fewer_embedding_rows_than_the_tokenizer(pair, tmp_path):
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(pair / "draft")
    draft.resize_token_embeddings(300)  # the probe's draft: ids 300-511 of the shared tokenizer have no row
    draft.save_pretrained(pair / "draft")
    assert json.loads((pair / "draft" / "config.json").read_text())["vocab_size"] == 300
    line = _one_error_line(run_cli("check", str(_config(pair, tmp_path))))
    assert line.startswith("error: draft.model:") and "300" in line and "512" in line, line


def test_check_accepts_the_tiny_pair(tiny_config):
    report = check_pair(load_config(tiny_config))
    assert not report.errors
    assert "tokenizers identical" in report.ok
    assert "target: runs on the lean Llama-family decoder" in report.ok
    assert "draft: runs on the lean Llama-family decoder" in report.ok


@pytest.fixture
def other_tokenizer_draft(tiny_pair, tmp_path):
    """The tiny draft with a tokenizer of the SAME vocab size but a different token-to-id map."""
    folder = tmp_path / "draft-other-tok"
    AutoModelForCausalLM.from_pretrained(tiny_pair / "draft").save_pretrained(folder)
    from transformers import AutoTokenizer

    size = len(AutoTokenizer.from_pretrained(tiny_pair / "target"))
    texts = ["lorem ipsum dolor sit amet " * 200, "the quick brown fox jumps over the lazy dog " * 200]
    train_tokenizer(texts, size).save_pretrained(folder)
    return folder


def test_check_refuses_a_different_tokenizer(tiny_pair, tmp_path, other_tokenizer_draft):
    cfg = write_config(tmp_path, tiny_config_dict(tiny_pair, draft={"model": str(other_tokenizer_draft)}))
    report = check_pair(load_config(cfg))
    assert any("draft.model: tokenizer differs from target" in e and "same model family" in e
               for e in report.errors), report.errors
    result = run_cli("check", str(cfg))
    assert result.returncode == 2
    assert "tokenizer differs" in result.stderr and "Traceback" not in result.stderr


def test_check_says_which_kv_cache_settings_do_nothing_on_torch(tiny_pair, tmp_path):
    assert not any("kv_cache" in w for w in check_pair(load_config(write_config(
        tmp_path, tiny_config_dict(tiny_pair)))).warnings)
    cfg = write_config(tmp_path, tiny_config_dict(tiny_pair, build={"kv_cache": {"enable_block_reuse": False,
                                                                                "tokens_per_block": 16}}))
    assert not any("kv_cache" in w for w in check_pair(load_config(cfg)).warnings)  # the torch cache reads both
    cfg = write_config(tmp_path, tiny_config_dict(tiny_pair, build={"kv_cache": {"free_gpu_mem_fraction": 0.5}}))
    report = check_pair(load_config(cfg))
    assert any(w.startswith("build.kv_cache.free_gpu_mem_fraction: set, but only backend trtllm uses it")
               for w in report.warnings)
    assert not report.errors
    data = tiny_config_dict(tiny_pair, build={"max_num_tokens": 512, "kv_cache": {"max_tokens": 8192}})
    report = check_pair(load_config(write_config(tmp_path, {**data, "backend": "trtllm"})))
    assert any(w.startswith("build.max_num_tokens, build.kv_cache.max_tokens: set, but only the torch backend")
               for w in report.warnings), report.warnings


def test_check_says_what_int8_weights_cost_in_exactness(tiny_pair, tmp_path):
    data = tiny_config_dict(tiny_pair, target={"dtype": "auto"}, draft={"dtype": "auto"},
                            build={"quantization": {"mode": "int8_weight_only", "draft_mode": "int8_weight_only"}})
    report = check_pair(load_config(write_config(tmp_path, data)))
    assert report.dtypes["target"].dtype == report.dtypes["draft"].dtype == "bfloat16"
    target_line = next(line for line in report.ok if line.startswith("target weights int8"))
    assert "quantized target's own target-only output, not the unquantized model's" in target_line
    assert any(line.startswith("draft weights int8") and "acceptance rate" in line for line in report.ok)
    assert "target: runs on the lean Llama-family decoder" in report.ok
    assert not report.warnings and not report.errors
    data["target"]["dtype"] = "float32"
    warned = check_pair(load_config(write_config(tmp_path, data))).warnings
    assert any(w.startswith("target.dtype: float32 with int8 weights") and "bfloat16" in w for w in warned)


def test_check_refuses_too_long_max_seq_len(tiny_pair, tmp_path):
    cfg = write_config(tmp_path, tiny_config_dict(tiny_pair, build={"max_input_len": 100, "max_seq_len": 4096}))
    with pytest.raises(CompatibilityError, match=r"build.max_seq_len: 4096 exceeds target max_position_embeddings"):
        check_pair(load_config(cfg)).raise_if_failed()


def minimal(**overrides):
    data = {"name": "t", "target": {"model": "org/target"}, "draft": {"model": "org/draft"}}
    data.update(overrides)
    return data


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


def test_serving_beyond_loopback_without_a_key_or_host_names_is_warned_about():
    from pipeline.checks import serve_exposure_warnings
    from tests.test_config import minimal

    assert serve_exposure_warnings(parse_config(minimal())) == []  # loopback: nothing to say
    exposed = serve_exposure_warnings(parse_config(minimal(serve={"bind_address": "0.0.0.0"})))
    assert len(exposed) == 2 and "serve.api_key_env" in exposed[0] and "serve.allowed_hosts" in exposed[1], exposed
    named = parse_config(minimal(serve={"bind_address": "0.0.0.0", "api_key_env": "KEY",
                                        "allowed_hosts": ["models.example:8000"]}))
    assert serve_exposure_warnings(named) == []


def test_check_says_when_the_default_medusa_tree_is_cut_to_the_heads(tiny_pair, tmp_path):
    from pipeline.medusa_heads import MedusaHeads

    target = json.loads((tiny_pair / "target" / "config.json").read_text())
    MedusaHeads(3, 1, target["hidden_size"], target["vocab_size"]).save(tmp_path / "heads")
    data = tiny_config_dict(tiny_pair, name="medusa3")
    data.pop("draft")
    data["speculative"] = {"method": "medusa", "medusa": {"model": str(tmp_path / "heads"), "heads": 3}}
    report = check_pair(load_config(write_config(tmp_path, data)))
    assert not report.errors, report.errors
    line = next(line for line in report.ok if "speculative.method: medusa" in line)
    assert "mc_sim_7b_63 cut to the 3 heads" in line and "61 nodes, depth 3" in line, line


def test_check_warns_when_a_sliding_window_is_shorter_than_max_seq_len(tiny_pair, tmp_path):
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    folder = tmp_path / "mistral"
    MistralForCausalLM(MistralConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                     sliding_window=128)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_pair / "target").save_pretrained(folder)

    def warnings(max_seq_len: int) -> list[str]:
        data = tiny_config_dict(tiny_pair, target={"model": str(folder)}, speculative={"method": "ngram"},
                                build={"max_input_len": 64, "max_seq_len": max_seq_len})
        del data["draft"]
        report = check_pair(load_config(write_config(tmp_path, data)))
        assert not report.errors, report.errors
        return report.warnings

    assert any(w.startswith("target.model: a 128-token sliding window, shorter than the 256 positions") and
               "set build.max_seq_len to the window or less" in w for w in warnings(256))
    assert warnings(128) == []
