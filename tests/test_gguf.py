"""A .gguf file as a model source: `check` reads its header and metadata only; convert dequantizes it once (cached
by content hash) into an ordinary HF folder that every later stage reads; the convert manifest records the GGUF's
sha256; a broken GGUF is a clear error. The file is the real model's Q4_1 GGUF (tests/conftest.py)."""

from __future__ import annotations

import json

import pytest

from pipeline.config import ModelSpec, parse_config
from pipeline.errors import ModelError
from pipeline.gguf import loadable_types, nonfinite_sample, sha256_file
from pipeline.models import load_tokenizer, read_hf_config, resolve_model, validate_weights, weights_nonfinite
from tests.conftest import cache_sharing_kernels, run_cli


@pytest.fixture()
def isolated_cache(tmp_path, monkeypatch):
    """A cache of its own for the dequantized models (cache_sharing_kernels)."""
    cache = cache_sharing_kernels(tmp_path / "cache")
    monkeypatch.setenv("SPECPIPE_CACHE", str(cache))
    return cache


def _cached(cache) -> list:
    """What the cache holds besides the lock files that let two processes take turns."""
    folder = cache / "gguf"
    return sorted(p for p in folder.iterdir() if p.suffix != ".lock") if folder.is_dir() else []


def test_loadable_types_cover_the_common_quantizations():
    types = loadable_types()
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q4_K", "Q6_K", "IQ4_XS"):
        assert name in types


@pytest.mark.slow
def test_gguf_source_runs_check_convert_build_and_records_its_hash(real_gguf_file, real_model_dir, tmp_path,
                                                                    isolated_cache):
    from safetensors.torch import load_file

    from pipeline.stages import run_check, run_stages

    config = parse_config({
        "name": "gguf-src", "backend": "torch", "target": {"model": str(real_gguf_file)},
        "speculative": {"method": "ngram", "max_draft_len": 4},
        "build": {"max_batch_size": 2, "max_input_len": 256, "max_seq_len": 512}, "runtime": {"device": "cpu"}})
    report = run_check(config)
    assert "target.dtype: float32 (auto: checkpoint float32 on CPU)" in report.defaults
    assert _cached(isolated_cache) == []  # check read the header and metadata: nothing dequantized yet
    run_stages(config, tmp_path / "engines", ("convert", "build"))
    manifest = json.loads((tmp_path / "engines/gguf-src/target/convert/manifest.json").read_text())
    digest = sha256_file(real_gguf_file)
    assert manifest["inputs"]["model_files"] == {real_gguf_file.name: digest}  # the file is the input
    assert manifest["source"]["gguf_sha256"] == digest and manifest["source"]["kind"] == "gguf"
    cached = _cached(isolated_cache)
    assert len(cached) == 1 and (cached[0] / "model.safetensors").is_file()  # dequantized once
    # the same bytes `make real-model` wrote: dequantization is deterministic, the folder is an ordinary checkpoint
    converted = load_file(tmp_path / "engines/gguf-src/target/convert/model.safetensors")
    made = load_file(real_model_dir / "model.safetensors")
    assert converted.keys() == made.keys() and all(converted[k].equal(made[k]) for k in made)

    from pipeline.executor import SpeculativeExecutor

    ex = SpeculativeExecutor.from_engines(tmp_path / "engines/gguf-src", method="ngram")
    out = ex.generate(["The capital of France is"], max_new_tokens=4)[0]
    assert len(out.token_ids) == 4 and out.text.strip()


@pytest.mark.slow  # transformers parses the real GGUF's header and tokenizer: about 13 s
def test_config_tokenizer_and_weights_read_from_the_file_without_dequantizing(real_gguf_file, real_model_dir,
                                                                              tmp_path, isolated_cache):
    from transformers import AutoTokenizer

    model = resolve_model(ModelSpec(model=str(real_gguf_file)), "target", tmp_path, with_weights=False)
    assert model.raw_gguf and model.source == "gguf"
    found = read_hf_config(model)
    made = json.loads((real_model_dir / "config.json").read_text())
    for key in ("architectures", "model_type", "vocab_size", "num_hidden_layers", "max_position_embeddings",
                "eos_token_id", "dtype"):
        assert found[key] == made[key], key
    tokenizer, saved = load_tokenizer(model), AutoTokenizer.from_pretrained(real_model_dir)
    assert tokenizer.get_vocab() == saved.get_vocab() and tokenizer.chat_template == saved.chat_template
    validate_weights(model)
    assert weights_nonfinite(model) is None
    assert _cached(isolated_cache) == []


def _write_gguf(path, tensors: dict):
    """A minimal GGUF (llama metadata only) holding ``tensors``: name -> (array, raw GGML type or None)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_type_the_loader_cannot_dequantize_is_refused_naming_it_and_the_list(tmp_path):
    import numpy as np
    from gguf import GGMLQuantizationType

    odd = _write_gguf(tmp_path / "odd.gguf", {
        "token_embd.weight": (np.zeros((2, 40), dtype=np.uint8), GGMLQuantizationType.Q8_1),  # 2 rows of 32
        "output_norm.weight": (np.ones(32, dtype=np.float32), None)})
    with pytest.raises(ModelError, match=r"^draft\.model: .*odd\.gguf: tensor types Q8_1 cannot be dequantized by "
                                         r"transformers' GGUF loader \(it reads BF16, F16, F32, .*Q4_1.*\)"):
        resolve_model(ModelSpec(model=str(odd)), "draft", tmp_path, with_weights=False)


def test_nan_weights_are_found_in_the_sample(tmp_path):
    import numpy as np

    rows = np.ones((16, 32), dtype=np.float32)
    rows[15, 3] = np.nan  # the last row is always sampled
    bad = _write_gguf(tmp_path / "bad.gguf", {"blk.0.attn_q.weight": (rows, None)})
    assert nonfinite_sample(bad) == "blk.0.attn_q.weight in bad.gguf holds NaN values"


def test_truncated_gguf_is_a_clear_error(real_gguf_file, tmp_path, isolated_cache):
    broken = tmp_path / "broken.gguf"
    with open(real_gguf_file, "rb") as src, open(broken, "wb") as dst:
        dst.write(src.read(4096))
    for with_weights in (False, True):
        with pytest.raises(ModelError, match=r"^target\.model: .*broken\.gguf: not a readable GGUF file"):
            resolve_model(ModelSpec(model=str(broken)), "target", tmp_path, with_weights=with_weights)
    # cut inside the tensor data: the header parses, the tensor index points past the end of the file
    with open(real_gguf_file, "rb") as src, open(broken, "wb") as dst:
        dst.write(src.read(real_gguf_file.stat().st_size // 2))
    with pytest.raises(ModelError, match=r"broken\.gguf: not a readable GGUF file"):
        resolve_model(ModelSpec(model=str(broken)), "target", tmp_path, with_weights=False)
    assert _cached(isolated_cache) == []


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(ModelError, match="is a file; point target.model at a Hugging Face model folder"):
        resolve_model(ModelSpec(model=str(other)), "target", tmp_path)


@pytest.mark.slow  # transformers parses the real GGUF's header and tokenizer: about 13 s
def test_trtllm_plan_converts_the_dequantized_folder(real_gguf_file, tmp_path, isolated_cache):
    """TensorRT-LLM's converters read HF folders: the dry-run says the GGUF is dequantized first and that
    from_hugging_face reads that folder (trtllm.convert gets it from resolve_model, like every source)."""
    config = tmp_path / "gguf-trt.yaml"
    config.write_text(json.dumps({
        "name": "gguf-trt", "backend": "trtllm", "target": {"model": str(real_gguf_file)},
        "speculative": {"method": "ngram", "max_draft_len": 4},
        "build": {"max_batch_size": 2, "max_input_len": 256, "max_seq_len": 512}}))
    proc = run_cli("build", str(config), "--dry-run", "--engines-dir", str(tmp_path / "engines"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    folder = f"{isolated_cache}/gguf/{real_gguf_file.stem}-<sha256[:16]>"
    assert f"# {real_gguf_file} is dequantized first (transformers' GGUF loader, float32, once) into {folder}" \
        in proc.stdout
    assert f".from_hugging_face('{folder}', 'float16'," in proc.stdout  # dtype auto: a GGUF counts as float32
    assert _cached(isolated_cache) == []  # planning dequantizes nothing
