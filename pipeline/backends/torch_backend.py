"""The torch backend: HF checkpoint -> dtype-cast safetensors checkpoint -> engine folder with engine.json.

The "engine" is the model in its build dtype plus the limits it was built for; the executor refuses requests
beyond those limits exactly as a TensorRT-LLM engine would.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..config import PipelineConfig
from ..decoder_support import runner_for
from ..dtypes import torch_device
from ..engine_info import ENGINE_FILE, engine_fields, write_engine_info
from .. import eagle3_heads
from ..medusa_heads import CONFIG_FILE, ENGINE_SUBDIR, HEADS_FILE
from ..models import ResolvedModel, load_causal_lm, load_tokenizer


def convert(config: PipelineConfig, role: str, model: ResolvedModel, out_dir: Path) -> dict:
    spec = getattr(config, role)
    lm = load_causal_lm(model, spec.dtype, progress=True)
    lm.save_pretrained(out_dir, safe_serialization=True)
    load_tokenizer(model).save_pretrained(out_dir)
    facts = {"source": model.provenance()}
    if role == "target" and config.has_medusa_heads:
        facts["medusa"] = _copy_heads(config.medusa_dir(), out_dir / ENGINE_SUBDIR)
    if role == "target" and config.has_eagle3_heads:
        facts["eagle3"] = _copy_heads(config.eagle3_dir(), out_dir / eagle3_heads.ENGINE_SUBDIR, EAGLE3_FILES)
    return facts


MEDUSA_FILES = (HEADS_FILE, CONFIG_FILE)
EAGLE3_FILES = (eagle3_heads.WEIGHTS_FILE, eagle3_heads.CONFIG_FILE)
HEADS = ((ENGINE_SUBDIR, MEDUSA_FILES, "Medusa"), (eagle3_heads.ENGINE_SUBDIR, EAGLE3_FILES, "EAGLE-3"))


def _copy_heads(src: Path, dst: Path, names: tuple[str, ...] = MEDUSA_FILES) -> str:
    """Heads (Medusa, EAGLE-3) travel with the target's checkpoint and engine, as files (checked by `check`
    beforehand)."""
    dst.mkdir(parents=True)
    for name in names:
        shutil.copy2(src / name, dst / name)
    return str(src)


def engine_limits(config: PipelineConfig, role: str) -> dict:
    return engine_fields(config, role, "torch")


def build_plan(config: PipelineConfig, role: str, checkpoint_dir: Path, out_dir: Path) -> list[str]:
    carried = {ENGINE_SUBDIR: config.has_medusa_heads, eagle3_heads.ENGINE_SUBDIR: config.has_eagle3_heads}
    heads = [f"copy the {kind} heads {checkpoint_dir / sub} to {out_dir / sub}" for sub, _, kind in HEADS
             if role == "target" and carried[sub]]
    mode = config.build.quantization.of(role)
    quantized = [f"measure the {mode} model's logit error against float32 (the engine keeps full weights; the "
                 f"executor quantizes them on load)"] if mode != "none" else []
    kernels = ["build the row kernels' C++ library for this CPU if it is not built yet (kept in the cache folder; "
               "a lean-decoder engine runs on it)"] if torch_device(config.runtime.device) == "cpu" else []
    return [f"load {checkpoint_dir} as {getattr(config, role).dtype}", *heads, *quantized,
            f"write {out_dir}/model.safetensors, tokenizer, {ENGINE_FILE} ({json.dumps(engine_limits(config, role))})",
            *kernels]


def build(config: PipelineConfig, role: str, checkpoint_dir: Path, out_dir: Path) -> dict:
    spec = getattr(config, role)
    checkpoint = ResolvedModel(role, spec, checkpoint_dir, "local", None)
    lm = load_causal_lm(checkpoint, spec.dtype, progress=True)
    lm.save_pretrained(out_dir, safe_serialization=True)
    load_tokenizer(checkpoint).save_pretrained(out_dir)
    for sub, names, _ in HEADS:
        if (checkpoint_dir / sub).is_dir():
            _copy_heads(checkpoint_dir / sub, out_dir / sub, names)
    limits = engine_limits(config, role)
    limits["architecture"] = type(lm).__name__
    limits["vocab_size"] = lm.get_output_embeddings().weight.shape[0]
    limits["runner"] = runner_for(lm.config.to_dict(), limits["max_seq_len"], limits["quantization"])[0]
    if limits["quantization"] != "none":  # lm is saved: it can be quantized in place for the measurement
        limits["quantization_error"] = quantization_error(checkpoint, lm, limits["quantization"],
                                                          load_tokenizer(checkpoint))
    write_engine_info(out_dir, limits)
    return {"engine": limits}


# What the build measures a quantized model's error on: ordinary prose and code, as the tokenizer splits them.
PROBE_TEXT = ("The committee met on Tuesday to review the budget, and after a long discussion it approved the plan "
              "with two changes. def mean(values):\n    return sum(values) / len(values)\n")


def quantization_error(checkpoint: ResolvedModel, lm, mode: str, tokenizer) -> dict:
    """The engine as it will run (``lm``, quantized in place with ``mode`` as the executor does on load) against
    the checkpoint in float32, on PROBE_TEXT: what the quantization costs, recorded in engine.json."""
    import torch

    from ..quantize import logit_error, quantize_model

    ids = torch.tensor([tokenizer(PROBE_TEXT)["input_ids"][:64]], dtype=torch.long)
    weights = quantize_model(lm, mode)
    return {**weights.to_dict(), **logit_error(load_causal_lm(checkpoint, "float32"), lm, ids)}
