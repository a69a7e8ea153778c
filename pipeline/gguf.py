"""GGUF files as model sources: dequantized into a Hugging Face folder by transformers' GGUF loader.

transformers reads the GGUF's metadata (architecture, sizes, tokenizer, chat template) and dequantizes its tensors
with the `gguf` package; nothing here does arithmetic on quantized blocks. The folder it writes is an ordinary
float32 checkpoint that every later stage (and TensorRT-LLM's converters) reads like any other.
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
import tempfile
from pathlib import Path

from .artifacts import cache_root, exclusive_lock, sha256_file
from .errors import ModelError

# Values read per tensor by nonfinite_sample: SAMPLE_ROWS rows, evenly spaced (quantized rows dequantize whole).
SAMPLE_ROWS = 8


def loadable_types() -> tuple[str, ...]:
    """The GGUF tensor types that load: transformers' GGUF loader dequantizes every tensor with the installed
    `gguf` package, which handles F32, F16 and every type it has a dequantizer for (gguf 0.19: BF16, Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0, Q2_K-Q6_K, IQ1_S-IQ4_XS, TQ1_0, TQ2_0, MXFP4, NVFP4)."""
    from gguf.quants import _type_traits  # the registry of gguf's dequantizers

    return tuple(sorted({"F32", "F16", *(t.name for t in _type_traits)}))


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def _reader(gguf_path: Path):
    """gguf's GGUFReader over the file (memory-mapped: the header and tensor index are parsed, no tensor read)."""
    stat = gguf_path.stat()
    return _cached_reader(str(gguf_path), stat.st_size, stat.st_mtime_ns)


# Parsing a header takes seconds (every tokenizer entry is a field), and `check` reads it up to three times.
@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, size: int, mtime_ns: int):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as exc:  # a truncated or foreign file: gguf raises ValueError, struct/numpy errors, OSError
        raise ModelError(f"{path}: not a readable GGUF file ({_first_line(exc)}); re-download it") from None


def tensor_types(gguf_path: Path) -> list[str]:
    """The distinct tensor types in a GGUF file (reads the header and tensor index only)."""
    return sorted({t.tensor_type.name for t in _reader(gguf_path).tensors})


def check_loadable(gguf_path: Path) -> None:
    known = loadable_types()
    unknown = [t for t in tensor_types(gguf_path) if t not in known]
    if unknown:
        raise ModelError(f"{gguf_path}: tensor types {', '.join(unknown)} cannot be dequantized by transformers' "
                         f"GGUF loader (it reads {', '.join(known)}); use a GGUF of one of those types or the "
                         f"original Hugging Face checkpoint")


def read_config(gguf_path: Path) -> dict:
    """config.json as the dequantized folder holds it, from the GGUF metadata alone (transformers' GGUF config
    parser; no tensor is dequantized): what `check` reads before anything expensive runs."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # an architecture transformers' GGUF loader does not read: ValueError
        raise ModelError(f"{gguf_path}: transformers cannot read its configuration ({_first_line(exc)}); use a "
                         f"GGUF of an architecture transformers loads from GGUF, or the Hugging Face "
                         f"checkpoint") from None
    data = config.to_dict()
    data.pop("quantization_config", None)
    data["dtype"] = "float32"  # what the loader dequantizes to
    if not data.get("architectures") and data.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        data["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[data["model_type"]]]
    return data


def load_tokenizer(gguf_path: Path):
    """The tokenizer (with its chat template) that transformers rebuilds from the GGUF metadata."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # a tokenizer model transformers does not rebuild from GGUF metadata
        raise ModelError(f"{gguf_path}: transformers cannot rebuild its tokenizer ({_first_line(exc)}); use the "
                         f"Hugging Face checkpoint") from None


def nonfinite_sample(gguf_path: Path) -> str | None:
    """The first tensor whose sampled rows (SAMPLE_ROWS of each, dequantized by gguf) hold NaN or inf, or None."""
    import numpy as np
    from gguf.quants import dequantize

    for tensor in _reader(gguf_path).tensors:
        data = tensor.data
        rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
        picked = sorted({round(i * (len(rows) - 1) / (SAMPLE_ROWS - 1)) for i in range(SAMPLE_ROWS)})
        values = dequantize(np.ascontiguousarray(rows[picked]), tensor.tensor_type)
        if not np.isfinite(values).all():
            what = "NaN" if np.isnan(values).any() else "inf"
            return f"{tensor.name} in {gguf_path.name} holds {what} values"
    return None


def load_gguf(gguf_path: Path, dtype=None):
    """(model, tokenizer) from a GGUF file, dequantized; the model is a plain, savable transformers model."""
    import torch
    from transformers import AutoModelForCausalLM

    check_loadable(gguf_path)
    tokenizer = load_tokenizer(gguf_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=dtype or torch.float32)
    except Exception as exc:  # an architecture transformers' GGUF loader does not read
        raise ModelError(f"{gguf_path}: transformers' GGUF loader cannot load it ({_first_line(exc)}); use a GGUF "
                         f"of an architecture transformers loads from GGUF, or the Hugging Face checkpoint") from None
    # The loaded weights are already dequantized; what is left of the GGUF "quantization" is a marker that makes
    # save_pretrained refuse. Dropping it leaves an ordinary checkpoint.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = gguf_path.stem
    return model.eval(), tokenizer


def dequantize_to_folder(gguf_path: Path, out_dir: Path) -> dict:
    """Write ``gguf_path`` as a float32 HF folder (safetensors, tokenizer, chat template, generation config);
    returns the provenance written to ``source.json`` beside the weights."""
    model, tokenizer = load_gguf(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    source = {"gguf_file": gguf_path.name, "gguf_sha256": sha256_file(gguf_path),
              "tensor_types": tensor_types(gguf_path), "dequantized_to": "float32"}
    (out_dir / "source.json").write_text(json.dumps(source, indent=2) + "\n")
    return source


def _folder_for(gguf_path: Path, digest: str) -> Path:
    return cache_root() / "gguf" / f"{gguf_path.stem}-{digest[:16]}"


def dequantized_folder_label(gguf_path: Path) -> str:
    """Where dequantized_folder puts a GGUF, for plans that must not hash or read it."""
    return str(_folder_for(gguf_path, "<sha256>")).replace("<sha256>", "<sha256[:16]>")


def dequantized_folder(gguf_path: Path) -> tuple[Path, str]:
    """(HF folder, GGUF sha256): the GGUF dequantized once into the cache, keyed by its content hash, so every
    stage reads an ordinary checkpoint and an edited GGUF is a new source."""
    digest = sha256_file(gguf_path)
    folder = _folder_for(gguf_path, digest)
    if (folder / "source.json").is_file():  # written last
        return folder, digest
    check_loadable(gguf_path)
    # Two processes (two stages, parallel test workers) must not both write it: the second waits, then finds it.
    with exclusive_lock(folder.parent / f".{folder.name}.lock", f"another dequantization of {gguf_path.name}"):
        if (folder / "source.json").is_file():
            return folder, digest
        print(f"dequantizing {gguf_path} to float32 (once; cached in {folder})", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}.tmp-") as tmp:
            dequantize_to_folder(gguf_path, Path(tmp) / "model")
            if folder.exists():
                shutil.rmtree(folder)  # an attempt killed after its rename started
            (Path(tmp) / "model").rename(folder)
    return folder, digest
