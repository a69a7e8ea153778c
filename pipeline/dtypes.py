"""`dtype: auto`: the dtype a model is built and run in, chosen from its checkpoint and the device that runs it.

Greedy speculative output equals target-only output token for token only when both compute the same logits. In
float32 they do, up to summation order; in a 16-bit type the verify forward (K+1 positions) and a one-token step
round differently, so a near tie between the target's two best tokens can flip (TensorRT-LLM and vLLM document the
same). A CPU without native 16-bit matmul also runs bfloat16 several times slower than float32, emulating it. So:

  - a dtype the config writes is kept;
  - int8 weights (torch backend, build.quantization): bfloat16 activations (float16 on a GPU without bfloat16),
    what aten's int8 kernel is vectorized for; it widens them itself, so no native 16-bit matmul is needed;
  - CPU (torch backend): float32, unless the checkpoint is 16-bit and the CPU has native matmul for that type
    (AVX512-BF16 / AMX-BF16 for bfloat16, AVX512-FP16 / AMX-FP16 for float16);
  - CUDA (torch backend): the checkpoint's own dtype (bfloat16 only where the GPU supports it, else float16);
  - trtllm: the checkpoint's 16-bit type; a float32 (or unstated) checkpoint is built in float16, the type
    TensorRT-LLM's engines are tuned for.

A GGUF file counts as float32: the loader dequantizes it to float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SIXTEEN_BIT = ("bfloat16", "float16")

# /proc/cpuinfo flags of native 16-bit matrix arithmetic, per type.
_CPU_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # float32 | float16 | bfloat16
    reason: str  # one line for `check`: why this dtype


def checkpoint_dtype(hf_config: dict) -> str | None:
    """The dtype a checkpoint's config.json states (`torch_dtype`, or `dtype` in transformers 5), or None."""
    for section in (hf_config, hf_config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = section.get(key)
            if isinstance(value, str):
                value = value.removeprefix("torch.")
                if value in ("float32", "float16", "bfloat16"):
                    return value
    return None


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_runs_natively(dtype: str, flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU has native matrix arithmetic for a 16-bit ``dtype`` (float32 always)."""
    if dtype == "float32":
        return True
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in _CPU_FLAGS.get(dtype, ()))


def resolve_dtype(requested: str, stated: str | None, backend: str, device: str,
                  cpu_native=cpu_runs_natively, cuda_bf16: bool | None = None,
                  int8_weights: bool = False) -> DtypeChoice:
    """The concrete dtype for one model. ``stated``: the checkpoint's own dtype (None when it states none);
    ``device``: "cpu" or "cuda" (the torch backend's device; ignored for trtllm); ``int8_weights``: the torch
    backend quantizes this model's weights to int8 (its activations then run in 16 bits)."""
    if requested != "auto":
        return DtypeChoice(requested, "set in the config")
    own = f"checkpoint {stated}" if stated else "the checkpoint states no dtype"
    if int8_weights and backend == "torch":
        # aten's CPU int8 kernel takes 16-bit activations (it widens them in registers, so no native bf16 matmul is
        # needed); with float32 ones the layers multiply by the dequantized matrix, at a quarter of the speed.
        if device == "cuda" and not _cuda_has_bf16(cuda_bf16):
            return DtypeChoice("float16", f"auto: {own}; int8 weights run with 16-bit activations and this GPU has "
                                          f"no bfloat16: float16 chosen")
        return DtypeChoice("bfloat16", f"auto: {own}; int8 weights run with bfloat16 activations (aten's int8 "
                                       f"kernel), bfloat16 chosen")
    if backend == "trtllm":
        if stated in SIXTEEN_BIT:
            return DtypeChoice(stated, f"auto: {own}")
        return DtypeChoice("float16", f"auto: {own}; TensorRT-LLM engines run in 16 bits, float16 chosen")
    if device == "cuda":
        if stated == "bfloat16":
            if not _cuda_has_bf16(cuda_bf16):
                return DtypeChoice("float16", f"auto: {own}, but this GPU has no bfloat16; float16 chosen")
        return DtypeChoice(stated or "float32", f"auto: {own} on CUDA")
    if stated in SIXTEEN_BIT:
        if cpu_native(stated):
            return DtypeChoice(stated, f"auto: {own}, and this CPU has native {stated} matmul")
        return DtypeChoice("float32", f"auto: {own}, but this CPU has no native {stated} matmul (it would be "
                                      f"emulated, slower, and greedy output could change with K); float32 chosen")
    return DtypeChoice("float32", f"auto: {own} on CPU")


def _cuda_has_bf16(known: bool | None) -> bool:
    if known is not None:
        return known
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def torch_device(runtime_device: str) -> str:
    """The device the torch backend runs on: the config's, or CUDA when available for ``auto``."""
    if runtime_device != "auto":
        return runtime_device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
