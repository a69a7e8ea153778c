"""Which model runner an engine uses: the lean Llama-family decoder (pipeline/executor/llama_decoder.py) or the
Hugging Face modules, decided from config.json alone (no torch), so `check` and the build can say it."""

from __future__ import annotations

LEAN, MODULES = "lean", "hf-modules"
MODEL_TYPES = ("llama", "mistral", "qwen2")
# Rotary variants whose frequencies do not depend on the sequence length, so one table serves every position.
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def unsupported_config(config: dict, max_positions: int) -> str | None:
    """Why a model with this config.json cannot run on the lean decoder (a sentence), or None: what `check` says
    before any weight is loaded."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}"
    if config.get("hidden_act", "silu") != "silu":
        return f"hidden_act {config['hidden_act']!r} (the decoder's MLP is SiLU-gated)"
    if any(kind != "full_attention" for kind in config.get("layer_types") or ()):
        return "sliding-window layers"
    window = config.get("sliding_window")
    if window is not None and (model_type == "mistral" or config.get("use_sliding_window")) and window < max_positions:
        return f"a {window}-token sliding window, shorter than the {max_positions} positions a sequence may hold"
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind not in STATIC_ROPE:
        return f"rope_type {kind!r} (its frequencies change with the sequence length)"
    return None


def runner_for(config: dict, max_positions: int, quantization: str = "none") -> tuple[str, str | None]:
    """(LEAN or MODULES, why not LEAN or None) for a model with this config.json, held at ``quantization`` (the
    lean decoder runs float and int8 weight-only layers)."""
    reason = unsupported_config(config, max_positions)
    if reason is None and quantization not in ("none", "int8_weight_only"):
        reason = f"{quantization} weights run through their own modules"
    return (MODULES, reason) if reason else (LEAN, None)
