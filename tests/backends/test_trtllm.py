"""pipeline/backends/trtllm.py without TensorRT-LLM: convert and build say in one line what is missing, and the build
plan refuses what the release cannot build."""

from __future__ import annotations

import sys

import pytest

from pipeline.backends import trtllm
from pipeline.backends.trtllm_api import INSTALL_HINT, PINNED_VERSION, TRITON_CONTAINER
from pipeline.config import load_config
from pipeline.errors import BackendUnavailable, ConfigError
from pipeline.models import ResolvedModel
from tests.conftest import REPO


CONFIG = REPO / "configs" / "llama3.1-8b_llama3.2-1b.yaml"


def _one_line(exc: BaseException) -> str:
    message = str(exc)
    assert "\n" not in message and message
    return message


@pytest.fixture
def no_trtllm(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # `import tensorrt_llm` raises ImportError
    monkeypatch.setenv("PATH", str(tmp_path))  # and no trtllm-build on PATH


def test_convert_without_trtllm_is_one_clear_line(no_trtllm, tmp_path):
    config = load_config(CONFIG)
    model = ResolvedModel("target", config.target, tmp_path, "local", None)
    with pytest.raises(BackendUnavailable) as err:
        trtllm.convert(config, "target", model, tmp_path / "out")
    message = _one_line(err.value)
    assert f"TensorRT-LLM {PINNED_VERSION}" in message and TRITON_CONTAINER in message
    assert "pip install .[trtllm]" in message


def test_build_without_trtllm_build_is_one_clear_line(no_trtllm, tmp_path):
    with pytest.raises(BackendUnavailable) as err:
        trtllm.build(load_config(CONFIG), "target", tmp_path / "ckpt", tmp_path / "out")
    message = _one_line(err.value)
    assert "trtllm-build" in message and "not on PATH" in message and INSTALL_HINT in message


def test_unpaged_kv_cache_is_refused_at_plan_time(tmp_path):
    config = load_config(CONFIG)
    config.build.kv_cache.paged = False
    with pytest.raises(ConfigError, match="build.kv_cache.paged"):
        trtllm.build_plan(config, "target", tmp_path, tmp_path)
