"""pipeline/stages.py: convert and build for both roles: manifests, caching ("up to date"), what a config change
rebuilds, nothing written outside engines/ and no secret in what is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.artifacts import read_manifest
from pipeline.config import load_config
from pipeline.errors import EngineError
from pipeline.executor import SpeculativeExecutor, row_kernels
from pipeline.kv_settings import KVSettings
from pipeline.stages import run_stages
from tests.conftest import run_cli, tiny_config_dict, write_config


def test_build_writes_manifests_and_is_up_to_date(tiny_config, tmp_path, monkeypatch, capsys):
    config = load_config(tiny_config)
    engines = tmp_path / "engines"
    asked = []  # a CPU engine's build readies the row kernels' library (here: asks for it, once per build)
    monkeypatch.setattr(row_kernels, "unavailable", lambda: asked.append(1) or "needs a test's permission")
    first = run_stages(config, engines, ("convert", "build"))
    assert [r.status for r in first] == ["built"] * 4
    assert len(asked) == 1 and "row kernels: needs a test's permission" in capsys.readouterr().err
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


def test_kv_cache_settings_reach_the_engine_and_an_edit_rebuilds(tiny_pair, tmp_path):
    """The paged cache's settings travel in engine.json (the executor never reads the YAML); editing them rebuilds."""
    engines = tmp_path / "engines"
    config = load_config(write_config(tmp_path, tiny_config_dict(tiny_pair)))
    run_stages(config, engines, ("convert", "build"))
    assert SpeculativeExecutor.from_engines(engines / config.name).engine.kv == KVSettings()
    changed = tiny_config_dict(tiny_pair, build={"max_num_tokens": 32, "kv_cache": {
        "tokens_per_block": 16, "enable_block_reuse": False, "max_tokens": 4096}})
    results = run_stages(load_config(write_config(tmp_path, changed)), engines, ("convert", "build"))
    assert [r.status for r in results if r.stage == "build"] == ["built", "built"]
    engine = SpeculativeExecutor.from_engines(engines / config.name).engine
    assert engine.kv == KVSettings(block_size=16, max_tokens=4096, prefix_reuse=False, step_tokens=32)
    assert engine.target.cache.pool.max_blocks == 4096 // 16 and not engine.target.cache.pool.reuse


def test_quantization_reaches_the_engine_with_its_measured_error(tiny_pair, tmp_path):
    """int8 weights: engine.json records the mode per role and the build's measured error against float32; the
    executor quantizes on load (the engine folder keeps full weights); turning it off rebuilds and loads plain."""
    from pipeline.quantize import Int8WeightOnlyLinear

    engines = tmp_path / "engines"
    data = tiny_config_dict(tiny_pair, build={"quantization": {"mode": "int8_weight_only"}})
    config = load_config(write_config(tmp_path, data))
    run_stages(config, engines, ("convert", "build"))
    target = json.loads((engines / config.name / "target" / "build" / "engine.json").read_text())
    draft = json.loads((engines / config.name / "draft" / "build" / "engine.json").read_text())
    assert (target["quantization"], draft["quantization"]) == ("int8_weight_only", "none")
    assert (target["runner"], draft["runner"]) == ("lean", "lean")  # int8 layers are fused like float ones
    error = target["quantization_error"]
    assert error["mode"] == "int8_weight_only" and error["weight_bytes_after"] < error["weight_bytes_before"]
    assert 0 < error["max_abs_logit_error"] < 1 and error["top1_agreement"] >= 0.8 and error["positions"] > 8
    assert "quantization_error" not in draft
    executor = SpeculativeExecutor.from_engines(engines / config.name)
    assert isinstance(executor.target.model.get_output_embeddings(), Int8WeightOnlyLinear)
    assert not any(isinstance(m, Int8WeightOnlyLinear) for m in executor.draft.model.modules())
    results = run_stages(load_config(write_config(tmp_path, tiny_config_dict(tiny_pair))), engines, ("build",))
    assert [r.status for r in results] == ["built", "built"]  # engine.json changed: both rebuilt
    plain = SpeculativeExecutor.from_engines(engines / config.name)
    assert not any(isinstance(m, Int8WeightOnlyLinear) for m in plain.target.model.modules())
    assert (executor.target.runner, executor.draft.runner, plain.target.runner) == ("lean", "lean", "lean")


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


def test_build_before_convert_is_a_clear_error(tiny_config, tmp_path):
    from pipeline.stages import Layout, build_role

    config = load_config(tiny_config)
    with pytest.raises(EngineError, match="no completed convert output"):
        build_role(config, Layout.for_config(config, tmp_path / "e"), "target")


def test_ngram_config_builds_only_the_target_and_swapping_method_rebuilds_nothing(tiny_pair, tmp_path, capsys):
    from tests.conftest import tiny_config_dict, write_config

    from pipeline.cli import main
    from pipeline.config import load_config
    from pipeline.run_cmd import load_executor

    data = tiny_config_dict(tiny_pair, name="lookup")
    draft = data.pop("draft")
    path = write_config(tmp_path, {**data, "speculative": {"method": "ngram", "max_draft_len": 4}})
    engines = tmp_path / "engines"
    assert main(["build", str(path), "--engines-dir", str(engines)]) == 0
    assert (engines / "lookup" / "target" / "build").is_dir() and not (engines / "lookup" / "draft").exists()
    executor = load_executor(load_config(path), engines)
    (result,) = executor.generate(REPEATING[:1], 16)
    assert set(result.stats.by_proposer) <= {"ngram"} and executor.engine.draft is None
    built = SpeculativeExecutor.from_engines(engines / "lookup")  # the folder records its method: none to repeat
    assert built.method == "ngram" and built.engine.draft is None

    # method: ngram+draft with the draft added: the target is up to date, only the draft is converted and built
    path = write_config(tmp_path, {**data, "draft": draft, "speculative": {"method": "ngram+draft", "max_draft_len": 4}})
    capsys.readouterr()
    assert main(["build", str(path), "--engines-dir", str(engines)]) == 0
    out = capsys.readouterr().out
    assert out.count("up to date") == 2 and out.count("built") >= 2, out  # target convert+build kept
    hybrid = load_executor(load_config(path), engines)
    assert hybrid.method == "ngram+draft" and hybrid.engine.draft is not None

    # and back to draft_model: nothing to rebuild at all
    path = write_config(tmp_path, {**data, "draft": draft, "speculative": {"method": "draft_model", "max_draft_len": 4}})
    capsys.readouterr()
    assert main(["build", str(path), "--engines-dir", str(engines)]) == 0
    assert capsys.readouterr().out.count("up to date") == 4


REPEATING = ["x = compute(a, b)\ny = compute(a, b)\nz = compute(", "def f(self):\n    return self.value\n"
             "def g(self):\n    return self.", "import os\nimport sys\nimport "]


def snapshot(folder: Path) -> dict[str, float]:
    if not folder.exists():
        return {}
    return {p.relative_to(folder).as_posix(): p.stat().st_mtime for p in folder.rglob("*")}


def test_no_secret_in_manifests_or_logs(tiny_pair, tmp_path):
    secret = "hf_SECRETtokenVALUE123456"
    config = write_config(tmp_path, tiny_config_dict(tiny_pair, name="secret"))
    engines = tmp_path / "engines"
    result = run_cli("build", str(config), "--engines-dir", str(engines), env={"HF_TOKEN": secret})
    assert result.returncode == 0
    assert secret not in result.stdout + result.stderr
    for path in engines.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_nothing_written_outside_engines(tiny_pair, tmp_path):
    work = tmp_path / "cwd"
    work.mkdir()
    config = write_config(tmp_path, tiny_config_dict(tiny_pair, name="contained"))
    pair_before = snapshot(tiny_pair)
    result = run_cli("build", str(config), "--engines-dir", str(tmp_path / "engines"), cwd=work)
    assert result.returncode == 0, result.stderr
    assert list(work.iterdir()) == []
    assert snapshot(tiny_pair) == pair_before


def test_medusa_heads_beside_a_draft_serve_both_methods_from_one_build(tiny_pair, tmp_path):
    """On torch a config with a draft and a speculative.medusa section builds both: the heads travel with the
    target's engine, requests pick draft_model (the configured method) or medusa, and their greedy output is the
    target's. The heads' files are an input of the target's convert: retrained heads rebuild it."""
    import torch

    from pipeline.medusa_heads import MedusaHeads
    from tests.conftest import load_tiny_models

    target, _, _ = load_tiny_models(tiny_pair)
    torch.manual_seed(0)
    MedusaHeads.from_target(target, 2, 1).save(tmp_path / "heads")
    data = tiny_config_dict(tiny_pair, name="both", speculative={
        "medusa": {"model": str(tmp_path / "heads"), "heads": 2, "layers": 1, "choices": [[0], [1], [0, 0]]}})
    config = load_config(write_config(tmp_path, data))
    engines = tmp_path / "engines"
    run_stages(config, engines, ("convert", "build"))
    executor = SpeculativeExecutor.from_engines(engines / "both")
    assert executor.method == "draft_model" and executor.has_draft_model and executor.has_medusa_heads
    prompt = "def f(x):\n    return"
    plain = executor.generate([prompt], 20, max_draft_len=0)[0].token_ids
    for method in ("draft_model", "medusa"):
        result = executor.generate([prompt], 20, method=method)[0]
        assert result.token_ids == plain and set(result.stats.by_proposer) <= {method}
    retrained = MedusaHeads.from_target(target, 2, 1)
    with torch.no_grad():
        retrained[0][0].linear.bias.fill_(0.01)
    retrained.save(tmp_path / "heads")
    results = run_stages(config, engines, ("convert", "build"))
    assert {(r.stage, r.role, r.status) for r in results} == {
        ("convert", "target", "built"), ("build", "target", "built"),
        ("convert", "draft", "up to date"), ("build", "draft", "up to date")}
