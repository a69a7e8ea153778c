"""pipeline/models.py: finding a model's files and loading them safely.

Hostile or broken model folders (issue 12, items h, j, k), missing folders, uncached hub ids and pickle weights are
refused with one line naming the role and the file, never a traceback and never an engine that then fails every request.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipeline.checks import check_pair
from pipeline.config import load_config
from pipeline.errors import ModelError
from pipeline.stages import run_stages
from tests.conftest import one_error_line, run_cli, tiny_config_dict, write_config


@pytest.fixture
def pair(pair_copy) -> Path:
    return pair_copy


def _config(pair: Path, tmp_path: Path, **overrides) -> Path:
    data = tiny_config_dict(pair, name="models", **overrides)
    return write_config(tmp_path, data)


def _one_error_line(result) -> str:
    return one_error_line(result, ignore_warnings=True)


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


def test_trust_remote_code_warns(tiny_pair, tmp_path):
    config = write_config(tmp_path, tiny_config_dict(tiny_pair, name="remote", target={"trust_remote_code": True}))
    result = run_cli("check", str(config))
    assert result.returncode == 0
    assert "target.trust_remote_code is true" in result.stderr


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
