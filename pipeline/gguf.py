"""GGUF files as model sources: dequantized into a Hugging Face folder by transformers' GGUF loader.

transformers reads the GGUF's metadata (architecture, sizes, tokenizer, chat template) and dequantizes its tensors
with the `gguf` package; nothing here does arithmetic on quantized blocks. The folder it writes is an ordinary
float32 checkpoint that every later stage (and TensorRT-LLM's converters) reads like any other.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .errors import ModelError

def loadable_types() -> tuple[str, ...]:
    """The GGUF tensor types that load: transformers' GGUF loader dequantizes every tensor with the installed
    `gguf` package, which handles F32, F16 and every type it has a dequantizer for (gguf 0.19: BF16, Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0, Q2_K-Q6_K, IQ1_S-IQ4_XS, TQ1_0, TQ2_0, MXFP4, NVFP4)."""
    from gguf.quants import _type_traits  # the registry of gguf's dequantizers

    return tuple(sorted({"F32", "F16", *(t.name for t in _type_traits)}))


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def tensor_types(gguf_path: Path) -> list[str]:
    """The distinct tensor types in a GGUF file (reads the header and tensor index only)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf_path))
    except Exception as exc:  # a truncated or foreign file: gguf raises ValueError, struct/numpy errors, OSError
        raise ModelError(f"{gguf_path}: not a readable GGUF file ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:160] if str(exc) else ''}); re-download it") from None
    return sorted({t.tensor_type.name for t in reader.tensors})


def check_loadable(gguf_path: Path) -> None:
    known = loadable_types()
    unknown = [t for t in tensor_types(gguf_path) if t not in known]
    if unknown:
        raise ModelError(f"{gguf_path}: tensor types {', '.join(unknown)} cannot be dequantized by transformers' "
                         f"GGUF loader (it reads {', '.join(known)}); use a GGUF of one of those types or the "
                         f"original Hugging Face checkpoint")


def load_gguf(gguf_path: Path, dtype=None):
    """(model, tokenizer) from a GGUF file, dequantized; the model is a plain, savable transformers model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_loadable(gguf_path)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype or torch.float32)
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


def cache_root() -> Path:
    """Where fetched and dequantized models are kept: $SPECPIPE_CACHE, else ~/.cache/specpipe."""
    return Path(os.environ.get("SPECPIPE_CACHE") or Path.home() / ".cache" / "specpipe")


def dequantized_folder(gguf_path: Path) -> tuple[Path, str]:
    """(HF folder, GGUF sha256): the GGUF dequantized once into the cache, keyed by its content hash, so every
    stage reads an ordinary checkpoint and an edited GGUF is a new source."""
    digest = sha256_file(gguf_path)
    folder = cache_root() / "gguf" / f"{gguf_path.stem}-{digest[:16]}"
    if (folder / "source.json").is_file():  # written last
        return folder, digest
    check_loadable(gguf_path)
    print(f"dequantizing {gguf_path} to float32 (once; cached in {folder})", file=sys.stderr, flush=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}.tmp-") as tmp:
        dequantize_to_folder(gguf_path, Path(tmp) / "model")
        if folder.exists():
            shutil.rmtree(folder)  # an attempt killed after its rename started
        (Path(tmp) / "model").rename(folder)
    return folder, digest
