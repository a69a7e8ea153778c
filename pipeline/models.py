"""Find a model's files (local folder or Hugging Face hub) and load its config, tokenizer and weights safely."""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from .config import ModelSpec
from .errors import ModelError, short_repr

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
METADATA_PATTERNS = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.py"]
SAFE_WEIGHTS = ["*.safetensors"]
PICKLE_WEIGHTS = ["*.bin", "*.pt", "*.pth"]


@dataclass(frozen=True)
class ResolvedModel:
    role: str  # "target" or "draft": names the config field in every error
    spec: ModelSpec
    path: Path  # folder holding config.json, tokenizer and weights; a GGUF source's file until dequantized
    source: str  # "local", "hub" or "gguf"
    revision: str | None  # hub commit the files came from; None for local folders
    gguf_file: Path | None = None  # a GGUF source: the file; ``path`` is its dequantized folder once resolved
    gguf_sha256: str | None = None  # with weights (set once the file has been hashed and dequantized)

    @property
    def field(self) -> str:
        return f"{self.role}.model"

    @property
    def raw_gguf(self) -> bool:
        """A GGUF source resolved without weights: config, tokenizer and weights are read from the file itself."""
        return self.gguf_file is not None and self.path == self.gguf_file

    def provenance(self) -> dict:
        """Where the weights came from, as convert manifests record it (a GGUF source with its sha256)."""
        found = {"model": self.spec.model, "resolved_path": str(self.path), "kind": self.source,
                 "revision": self.revision}
        if self.gguf_file is not None:
            found.update(gguf_file=str(self.gguf_file), gguf_sha256=self.gguf_sha256)
        return found


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _looks_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or not _HUB_ID.match(name)


def resolve_model(spec: ModelSpec, role: str, base_dir: Path, with_weights: bool = True) -> ResolvedModel:
    """Return the folder of a model; downloads from the hub (or reads its cache) for hub ids.

    ``with_weights=False`` fetches only config and tokenizer files, which is all the `check` stage needs.
    """
    name = spec.model
    try:
        local = (base_dir / os.path.expanduser(name)).resolve()
    except (RuntimeError, OSError) as exc:  # Python 3.11 reports a symlink loop as RuntimeError, 3.13 as OSError
        raise ModelError(f"{role}.model: {short_repr(name)} cannot be resolved ({exc}: a symlink loop?); point "
                         f"{role}.model at the model folder itself") from None
    if local.is_dir():
        return ResolvedModel(role, spec, local, "local", None)
    if local.is_file() and local.suffix.lower() == ".gguf":
        return _resolve_gguf(spec, role, local, with_weights)
    if local.is_file():
        raise ModelError(f"{role}.model: {local} is a file; point {role}.model at a Hugging Face model folder, a "
                         f"hub id or a .gguf file")
    if _looks_local(name):
        raise ModelError(f"{role}.model: folder {local} does not exist; fix the path (relative paths resolve "
                         f"against the config file's folder) or run the script that creates it")
    return _download(spec, role, with_weights)


def _resolve_gguf(spec: ModelSpec, role: str, file: Path, with_weights: bool) -> ResolvedModel:
    """A .gguf file. With weights it is dequantized once into a cached HF folder (keyed by its sha256) that every
    later stage reads like any checkpoint; without, only its header is read (`check` stays cheap)."""
    from . import gguf

    try:
        if not with_weights:
            gguf.check_loadable(file)
            return ResolvedModel(role, spec, file, "gguf", None, gguf_file=file)
        folder, digest = gguf.dequantized_folder(file)
    except ModelError as exc:
        raise ModelError(f"{role}.model: {exc}") from None
    return ResolvedModel(role, spec, folder, "gguf", None, gguf_file=file, gguf_sha256=digest)


def _download(spec: ModelSpec, role: str, with_weights: bool) -> ResolvedModel:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    patterns = list(METADATA_PATTERNS)
    if with_weights:
        patterns += SAFE_WEIGHTS + (PICKLE_WEIGHTS if spec.allow_pickle else [])
    offline = hub_offline()
    try:
        folder = snapshot_download(spec.model, revision=spec.revision, allow_patterns=patterns,
                                   local_files_only=offline)
    except LocalEntryNotFoundError:
        how = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise ModelError(f"{role}.model: {spec.model!r} is not in the local Hugging Face cache and {how}; "
                         f"download it on a connected machine (huggingface-cli download {spec.model}) "
                         f"or point {role}.model at a local folder") from None
    except GatedRepoError:
        raise ModelError(f"{role}.model: {spec.model!r} is gated; accept its licence on the hub and set HF_TOKEN "
                         f"in the environment (it is never written to manifests)") from None
    except RepositoryNotFoundError:
        raise ModelError(f"{role}.model: no hub repository {spec.model!r}; check the id or use a local "
                         f"folder") from None
    except RevisionNotFoundError:
        raise ModelError(f"{role}.revision: {spec.revision!r} does not exist in {spec.model}; use a branch, "
                         f"tag or commit of that repository") from None
    except (OSError, ValueError) as exc:  # connection errors surface as OSError subclasses
        raise ModelError(f"{role}.model: downloading {spec.model!r} failed ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200]}); check the network or pre-download it") from None
    path = Path(folder)
    return ResolvedModel(role, spec, path, "hub", path.name)


def _gguf_call(model: ResolvedModel, read):
    try:
        return read(model.gguf_file)
    except ModelError as exc:
        raise ModelError(f"{model.field}: {exc}") from None


def read_hf_config(model: ResolvedModel) -> dict:
    if model.raw_gguf:
        from .gguf import read_config

        return _gguf_call(model, read_config)
    cfg = model.path / "config.json"
    if not cfg.is_file():
        raise ModelError(f"{model.field}: {model.path} has no config.json; point it at a Hugging Face model "
                         f"folder (the one save_pretrained writes)")
    try:
        data = json.loads(cfg.read_bytes())
    except json.JSONDecodeError as exc:
        raise ModelError(f"{model.field}: {cfg} is not valid JSON ({exc.msg} at line {exc.lineno}); "
                         f"restore the file") from None
    except ValueError:  # bytes that are not UTF-8/16/32 text
        raise ModelError(f"{model.field}: {cfg} is not JSON text (not UTF-8); restore the file") from None
    except OSError as exc:
        raise ModelError(f"{model.field}: {cfg} cannot be read ({exc.strerror}); check the file") from None
    if not isinstance(data, dict):
        raise ModelError(f"{model.field}: {cfg} holds a JSON {type(data).__name__}, not the object "
                         f"save_pretrained writes; restore the file")
    return data


# Where config.json states the longest sequence the model was trained for, by the names model families use.
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def max_positions(hf_config: dict) -> int | None:
    text = hf_config.get("text_config") or hf_config
    for key in POSITION_KEYS:
        if isinstance(text.get(key), int):
            return text[key]
    return None


def weight_files(model: ResolvedModel) -> list[Path]:
    """The weight files that would be loaded; refuses pickle files unless the config allows them."""
    if model.raw_gguf:
        return [model.gguf_file]
    safe = sorted(model.path.glob("*.safetensors"))
    if safe:
        return safe
    pickles = sorted(p for pattern in PICKLE_WEIGHTS for p in model.path.glob(pattern))
    if pickles and not model.spec.allow_pickle:
        raise ModelError(f"{model.field}: {model.path} has only pickle weights ({pickles[0].name}), which can run "
                         f"code when loaded; convert them to safetensors or set {model.role}.allow_pickle: true")
    if not pickles:
        raise ModelError(f"{model.field}: {model.path} has no weights (*.safetensors); re-download or "
                         f"re-save the model")
    return pickles


def validate_weights(model: ResolvedModel) -> None:
    """Open every safetensors header: catches truncated or garbled files in milliseconds, before any build."""
    from safetensors import safe_open

    if model.raw_gguf:
        from .gguf import check_loadable

        return _gguf_call(model, check_loadable)

    for path in weight_files(model):
        if path.suffix != ".safetensors":
            continue
        try:
            with safe_open(path, "pt") as handle:
                handle.keys()
        except Exception as exc:  # SafetensorError, OSError: either way the file is unusable
            raise ModelError(f"{model.field}: weights file {path} is corrupt or truncated ({exc}); re-download "
                             f"or re-save the model") from None


# How much of each tensor weights_nonfinite reads: a NaN/inf scan of a bounded sample, not of every weight.
SCAN_ROWS = 8  # rows per tensor, evenly spaced along the first dimension, first and last included
SCAN_COLUMNS = 8192  # values read per row at most


def weights_nonfinite(model: ResolvedModel) -> str | None:
    """The first tensor found holding NaN or inf in a bounded sample (SCAN_ROWS rows of every tensor, at most
    SCAN_COLUMNS values each; 1-D tensors up to SCAN_ROWS * SCAN_COLUMNS values), or None. Catches a tensor or
    a row lost to a bad conversion or a corrupt download while reading a few MB even of an 8B model; a lone NaN
    between the sampled rows passes."""
    import torch
    from safetensors import safe_open

    if model.raw_gguf:  # rows of every tensor, dequantized by gguf
        from .gguf import nonfinite_sample

        return _gguf_call(model, nonfinite_sample)
    for path in weight_files(model):
        if path.suffix != ".safetensors":
            continue
        with safe_open(path, "pt") as handle:
            for name in handle.keys():
                tensor = handle.get_slice(name)
                shape = tensor.get_shape()
                if len(shape) <= 1:  # norms, biases, scalars: small, read whole (or their head)
                    sample = handle.get_tensor(name) if not shape else tensor[:SCAN_ROWS * SCAN_COLUMNS]
                else:
                    rows = sorted({round(i * (shape[0] - 1) / (SCAN_ROWS - 1)) for i in range(SCAN_ROWS)})
                    inner = tuple(slice(0, 1) for _ in shape[1:-1])  # [experts, rows, cols]: one row of each
                    sample = torch.cat([tensor[(slice(r, r + 1), *inner, slice(0, SCAN_COLUMNS))].reshape(-1)
                                        for r in rows])
                if sample.is_floating_point() and not torch.isfinite(sample.float()).all():  # fp8: no isfinite
                    what = "NaN" if torch.isnan(sample).any() else "inf"
                    return f"{name} in {path.name} holds {what} values"
    return None


def warn_remote_code(model: ResolvedModel) -> None:
    if model.spec.trust_remote_code:
        warnings.warn(f"{model.role}.trust_remote_code is true: Python code from {model.spec.model} will run "
                      f"on this machine", stacklevel=2)


def load_tokenizer(model: ResolvedModel):
    from transformers import AutoTokenizer

    warn_remote_code(model)
    if model.raw_gguf:
        from .gguf import load_tokenizer as gguf_tokenizer

        return _gguf_call(model, gguf_tokenizer)
    try:
        return AutoTokenizer.from_pretrained(model.path, trust_remote_code=model.spec.trust_remote_code)
    except Exception as exc:  # transformers raises many types for a broken tokenizer; all mean the same to a user
        raise ModelError(f"{model.field}: the tokenizer in {model.path} cannot be loaded "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}); "
                         f"the tokenizer files are missing or truncated: re-save them with "
                         f"tokenizer.save_pretrained") from None


def compare_tokenizers(target_tok, draft_tok) -> list[str]:
    """Differences that make draft token ids meaningless to the target; empty when the two are identical."""
    problems = []
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(t for t in set(target_vocab) | set(draft_vocab)
                           if target_vocab.get(t) != draft_vocab.get(t))
        example = differing[0] if differing else "?"
        problems.append(f"token-to-id maps differ (vocab {len(target_vocab)} vs {len(draft_vocab)}, "
                        f"{len(differing)} tokens differ, e.g. {example!r}: {target_vocab.get(example)} vs "
                        f"{draft_vocab.get(example)})")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if a != b:
            problems.append(f"{attr} differs ({a} vs {b})")
    if sorted(target_tok.all_special_tokens) != sorted(draft_tok.all_special_tokens):
        problems.append("special tokens differ")
    return problems


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def load_causal_lm(model: ResolvedModel, dtype: str, device: str = "cpu", progress: bool = False):
    """Load an HF causal LM from safetensors (pickle only when explicitly allowed), in eval mode.

    ``progress`` shows transformers' loading bar: worth it in convert/build on multi-GB checkpoints, noise when a
    server or benchmark loads the small engines again and again.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if progress:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    if model.raw_gguf:
        from .gguf import load_gguf

        return _gguf_call(model, lambda file: load_gguf(file, torch_dtype(dtype))[0]).to(device).eval()
    files = weight_files(model)
    warn_remote_code(model)
    use_safetensors = files[0].suffix == ".safetensors"
    try:
        lm = AutoModelForCausalLM.from_pretrained(
            model.path, dtype=torch_dtype(dtype), use_safetensors=use_safetensors,
            trust_remote_code=model.spec.trust_remote_code)
    except Exception as exc:  # corrupt safetensors, shape mismatch, unknown architecture...
        text = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise ModelError(f"{model.field}: loading weights from {model.path} failed ({type(exc).__name__}: "
                         f"{text}); the files may be corrupt or incomplete: re-download or re-save them") from None
    return lm.to(device).eval()
