"""A .gguf file as a model source: dequantized once (cached by content hash) into an ordinary HF folder that every
stage reads; the convert manifest records the GGUF's sha256; a broken GGUF is a clear error."""

from __future__ import annotations

import json
import shutil

import pytest

from pipeline.config import ModelSpec, parse_config
from pipeline.errors import ModelError
from pipeline.gguf import loadable_types, sha256_file
from pipeline.models import resolve_model

from conftest import write_config


@pytest.fixture(scope="module")
def gguf_file(real_model_dir, tmp_path_factory):
    source = json.loads((real_model_dir / "source.json").read_text())
    from pipeline.gguf import cache_root

    path = cache_root() / "gguf" / source["gguf_file"]
    assert path.is_file(), "scripts/make_real_model.py keeps the GGUF it dequantized in the cache"
    return path


@pytest.fixture()
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_loadable_types_cover_the_common_quantizations():
    types = loadable_types()
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"):
        assert name in types


def test_gguf_source_runs_check_convert_build_and_records_its_hash(gguf_file, tmp_path, isolated_cache):
    from pipeline.stages import run_check, run_stages

    config = parse_config({
        "name": "gguf-src", "backend": "torch", "target": {"model": str(gguf_file)},
        "speculative": {"method": "ngram", "max_draft_len": 4},
        "build": {"max_batch_size": 2, "max_input_len": 256, "max_seq_len": 512}, "runtime": {"device": "cpu"}})
    report = run_check(config)
    assert "target.dtype: float32 (auto: checkpoint float32 on CPU)" in report.defaults
    run_stages(config, tmp_path / "engines", ("convert", "build"))
    manifest = json.loads((tmp_path / "engines/gguf-src/target/convert/manifest.json").read_text())
    source = manifest["source"]
    assert source["gguf_sha256"] == sha256_file(gguf_file)
    assert source["kind"] == "gguf"
    cached = list((isolated_cache / "gguf").iterdir())
    assert len(cached) == 1 and (cached[0] / "model.safetensors").is_file()  # dequantized once, reused by build

    from pipeline.executor import SpeculativeExecutor

    ex = SpeculativeExecutor.from_engines(tmp_path / "engines/gguf-src", method="ngram")
    out = ex.generate(["The capital of France is"], max_new_tokens=4)[0]
    assert len(out.token_ids) == 4 and out.text.strip()


def test_truncated_gguf_is_a_clear_error(gguf_file, tmp_path, isolated_cache):
    broken = tmp_path / "broken.gguf"
    with open(gguf_file, "rb") as src, open(broken, "wb") as dst:
        dst.write(src.read(4096))
    with pytest.raises(ModelError, match=r"^target\.model: .*broken\.gguf: not a readable GGUF file"):
        resolve_model(ModelSpec(model=str(broken)), "target", tmp_path)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(ModelError, match="is a file; point target.model at a Hugging Face model folder"):
        resolve_model(ModelSpec(model=str(other)), "target", tmp_path)
