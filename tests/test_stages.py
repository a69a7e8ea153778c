"""check / convert / build: manifests, caching ("up to date"), atomic outputs, pair validation."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoModelForCausalLM

from conftest import run_cli, tiny_config_dict, write_config
from pipeline.artifacts import read_manifest, run_stage
from pipeline.checks import check_pair
from pipeline.config import load_config
from pipeline.errors import CompatibilityError, EngineError, ModelError
from pipeline.stages import run_stages
from pipeline.tinymodels import train_tokenizer


def test_check_accepts_the_tiny_pair(tiny_config):
    report = check_pair(load_config(tiny_config))
    assert not report.errors
    assert "tokenizers identical" in report.ok


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


def test_check_says_kv_cache_settings_do_nothing_on_torch(tiny_pair, tmp_path):
    assert not any("kv_cache" in w for w in check_pair(load_config(write_config(
        tmp_path, tiny_config_dict(tiny_pair)))).warnings)
    cfg = write_config(tmp_path, tiny_config_dict(tiny_pair, build={"kv_cache": {"enable_block_reuse": True}}))
    report = check_pair(load_config(cfg))
    assert any(w.startswith("build.kv_cache: set, but only backend trtllm uses it") for w in report.warnings)
    assert not report.errors


def test_check_refuses_too_long_max_seq_len(tiny_pair, tmp_path):
    cfg = write_config(tmp_path, tiny_config_dict(tiny_pair, build={"max_input_len": 100, "max_seq_len": 4096}))
    with pytest.raises(CompatibilityError, match=r"build.max_seq_len: 4096 exceeds target max_position_embeddings"):
        check_pair(load_config(cfg)).raise_if_failed()


def test_missing_model_folder(tiny_pair, tmp_path):
    cfg = write_config(tmp_path, tiny_config_dict(tiny_pair, target={"model": "./no/such/folder"}))
    with pytest.raises(ModelError, match=r"target.model: folder .* does not exist"):
        check_pair(load_config(cfg))


def test_offline_uncached_hub_id(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    cfg = write_config(tmp_path, tiny_config_dict(tiny_pair, draft={"model": "someorg/not-cached-model"}))
    result = run_cli("check", str(cfg), env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert result.returncode == 2
    assert "draft.model: 'someorg/not-cached-model' is not in the local Hugging Face cache" in result.stderr


def test_build_writes_manifests_and_is_up_to_date(tiny_config, tmp_path):
    config = load_config(tiny_config)
    engines = tmp_path / "engines"
    first = run_stages(config, engines, ("convert", "build"))
    assert [r.status for r in first] == ["built"] * 4
    for role in ("target", "draft"):
        for stage in ("convert", "build"):
            folder = engines / config.name / role / stage
            manifest = read_manifest(folder)
            assert manifest["stage"] == stage and manifest["role"] == role
            assert manifest["versions"]["torch"] and manifest["versions"]["transformers"]
            assert manifest["config"]["model"]["model"] == getattr(config, role).model
            assert "model.safetensors" in manifest["outputs"]
        engine = json.loads((engines / config.name / role / "build" / "engine.json").read_text())
        assert engine["max_draft_len"] == (4 if role == "target" else 0)
    assert "model_files" in read_manifest(engines / config.name / "target" / "convert")["inputs"]
    second = run_stages(config, engines, ("convert", "build"))
    assert [r.status for r in second] == ["up to date"] * 4
    forced = run_stages(config, engines, ("build",), force=True)
    assert [r.status for r in forced] == ["built"] * 2


def test_changing_k_rebuilds_only_the_build_stage(tiny_pair, tmp_path):
    engines = tmp_path / "engines"
    run_stages(load_config(write_config(tmp_path, tiny_config_dict(tiny_pair))), engines, ("convert", "build"))
    changed = tiny_config_dict(tiny_pair, speculative={"max_draft_len": 6})
    results = run_stages(load_config(write_config(tmp_path, changed)), engines, ("convert", "build"))
    assert [(r.stage, r.role, r.status) for r in results] == [
        ("convert", "target", "up to date"), ("convert", "draft", "up to date"),
        ("build", "target", "built"), ("build", "draft", "built")]


def test_changed_source_weights_invalidate_convert(tiny_pair, tmp_path):
    pair = tmp_path / "pair"
    shutil.copytree(tiny_pair, pair)
    cfg = load_config(write_config(tmp_path, tiny_config_dict(pair)))
    engines = tmp_path / "engines"
    run_stages(cfg, engines, ("convert",))
    (pair / "draft" / "generation_config.json").write_text(
        (pair / "draft" / "generation_config.json").read_text().replace("}", ', "max_length": 77}', 1))
    results = run_stages(cfg, engines, ("convert",))
    assert [r.status for r in results] == ["up to date", "built"]


def test_failed_stage_leaves_nothing_that_looks_complete(tmp_path):
    out = tmp_path / "engines" / "x" / "target" / "build"

    def explode(tmp):
        (tmp / "half-written.bin").write_bytes(b"\0" * 10)
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        run_stage("build", "target", out, {"a": 1}, {}, explode)
    assert not out.exists()
    assert list(out.parent.iterdir()) == []  # the temp folder is gone too


def test_failed_rebuild_keeps_previous_output(tmp_path):
    out = tmp_path / "stage"
    run_stage("build", "target", out, {"a": 1}, {}, lambda tmp: (tmp / "w").write_text("v1") and None)

    def explode(tmp):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        run_stage("build", "target", out, {"a": 2}, {}, explode)
    assert (out / "w").read_text() == "v1" and read_manifest(out)["inputs"] == {"a": 1}


def test_hand_edited_manifest_is_refused(tmp_path):
    out = tmp_path / "stage"
    run_stage("build", "target", out, {"a": 1}, {}, lambda tmp: None)
    data = json.loads((out / "manifest.json").read_text())
    data["inputs"]["a"] = 2
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(EngineError, match="modified after it was written"):
        read_manifest(out)


def test_build_before_convert_is_a_clear_error(tiny_config, tmp_path):
    from pipeline.stages import Layout, build_role

    config = load_config(tiny_config)
    with pytest.raises(EngineError, match="no completed convert output"):
        build_role(config, Layout.for_config(config, tmp_path / "e"), "target")


def test_pickle_weights_refused_unless_allowed(tiny_pair, tmp_path):
    import torch

    folder = tmp_path / "pickled"
    shutil.copytree(tiny_pair / "draft", folder)
    from safetensors.torch import load_file

    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    cfg = load_config(write_config(tmp_path, tiny_config_dict(tiny_pair, draft={"model": str(folder)})))
    with pytest.raises(ModelError, match=r"draft.model: .* only pickle weights .* draft.allow_pickle: true"):
        run_stages(cfg, tmp_path / "engines", ("convert",))
