"""Typed builders for Triton ``config.pbtxt`` files.

Every config is a ``tritonclient.grpc.model_config_pb2.ModelConfig`` message built in code and printed with
``google.protobuf.text_format``, so a typo in a field name fails here instead of at server start, and no file is
ever patched with sed or template substitution.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

ModelConfig = mc.ModelConfig

# Short names for the data types used in this package; the values are the protobuf enum members.
DTYPES: dict[str, int] = {
    "BOOL": mc.TYPE_BOOL, "UINT8": mc.TYPE_UINT8, "INT32": mc.TYPE_INT32, "INT64": mc.TYPE_INT64,
    "UINT64": mc.TYPE_UINT64, "FP16": mc.TYPE_FP16, "FP32": mc.TYPE_FP32, "BF16": mc.TYPE_BF16,
    "STRING": mc.TYPE_STRING,
}


def _dtype(name: str) -> int:
    if name not in DTYPES:
        raise ValueError(f"data type {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def tensor_in(name: str, dtype: str, dims: Sequence[int], optional: bool = False, ragged: bool = False,
              reshape: Sequence[int] | None = None) -> mc.ModelInput:
    """One input; ``reshape=[]`` turns a per-request [1] into a scalar as tensorrtllm_backend expects."""
    spec = mc.ModelInput(name=name, data_type=_dtype(dtype), dims=list(dims), optional=optional,
                         allow_ragged_batch=ragged)
    if reshape is not None:
        spec.reshape.shape.extend(reshape)
        spec.reshape.SetInParent()  # an empty shape must still be printed: `reshape: { shape: [ ] }`
    return spec


def tensor_out(name: str, dtype: str, dims: Sequence[int]) -> mc.ModelOutput:
    return mc.ModelOutput(name=name, data_type=_dtype(dtype), dims=list(dims))


def set_parameters(config: mc.ModelConfig, values: Mapping[str, object]) -> None:
    """Triton parameters are strings; booleans print as true/false (what the backends parse)."""
    for key, value in values.items():
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        config.parameters[key].string_value = text


def cpu_instances(count: int) -> mc.ModelInstanceGroup:
    return mc.ModelInstanceGroup(count=count, kind=mc.ModelInstanceGroup.KIND_CPU)


def to_text(config: mc.ModelConfig) -> str:
    return text_format.MessageToString(config)


def parse(text: str) -> mc.ModelConfig:
    """Parse a config.pbtxt back into a message; raises text_format.ParseError on malformed text."""
    return text_format.Parse(text, mc.ModelConfig())


def write_model(repo: Path, config: mc.ModelConfig, version: int = 1) -> Path:
    """Write ``<repo>/<name>/config.pbtxt`` and the version folder Triton requires; returns the model folder."""
    folder = repo / config.name
    (folder / str(version)).mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(to_text(config))
    return folder
