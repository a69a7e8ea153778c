"""Hostile or broken model folders (issue 12, items h, j, k): refused by `check`/`build` with one line naming the
role and the file, never a traceback and never an engine that then fails every request."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import run_cli, tiny_config_dict, write_config


@pytest.fixture
def pair(tiny_pair, tmp_path) -> Path:
    copy = tmp_path / "pair"
    shutil.copytree(tiny_pair, copy)
    return copy


def _config(pair: Path, tmp_path: Path, **overrides) -> Path:
    data = tiny_config_dict(pair, name="models", **overrides)
    return write_config(tmp_path, data)


def _one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("  warning")]
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return lines[0]


def test_symlink_loop_as_model_path(pair, tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    line = _one_error_line(run_cli("check", str(_config(pair, tmp_path, target={"model": str(loop)}))))
    assert "target.model" in line and "symlink loop" in line, line


@pytest.mark.parametrize("content", [b"[]", b'"text"', b"\xff\xfe{}"], ids=["list", "string", "not-utf8"])
def test_model_config_json_that_is_not_an_object(pair, tmp_path, content):
    (pair / "draft" / "config.json").write_bytes(content)
    line = _one_error_line(run_cli("check", str(_config(pair, tmp_path))))
    assert "draft.model" in line and "config.json" in line, line


def _poison(folder: Path, name: str, value: float, rows: slice) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors[name][rows] = value
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("stage", ["check", "build"])
@pytest.mark.parametrize("where", ["nan-layer", "inf-embedding-row"])
def test_nan_or_inf_weights_are_refused(pair, tmp_path, stage, where):
    if where == "nan-layer":  # a whole layer lost: what a bad fp16 conversion or a corrupt download gives
        _poison(pair / "target", "model.layers.1.mlp.down_proj.weight", float("nan"), slice(None))
        role, tensor = "target", "model.layers.1.mlp.down_proj.weight"
    else:  # one row of the embeddings: greedy `run` then emitted EOS at once
        _poison(pair / "draft", "model.embed_tokens.weight", float("inf"), slice(511, 512))
        role, tensor = "draft", "model.embed_tokens.weight"
    engines = tmp_path / "engines"
    line = _one_error_line(run_cli(stage, str(_config(pair, tmp_path)), "--engines-dir", str(engines)))
    assert f"{role}.model" in line and tensor in line and ("NaN" in line or "inf" in line), line
    assert not engines.exists() or not list(engines.rglob("manifest.json"))


def test_draft_with_fewer_embedding_rows_than_the_tokenizer(pair, tmp_path):
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(pair / "draft")
    draft.resize_token_embeddings(300)  # the probe's draft: ids 300-511 of the shared tokenizer have no row
    draft.save_pretrained(pair / "draft")
    assert json.loads((pair / "draft" / "config.json").read_text())["vocab_size"] == 300
    line = _one_error_line(run_cli("check", str(_config(pair, tmp_path))))
    assert line.startswith("error: draft.model:") and "300" in line and "512" in line, line
