"""Weight-only int8 quantization of a torch model's linear layers: the torch backend's `build.quantization`.

Each ``nn.Linear`` becomes an ``Int8WeightOnlyLinear``: int8 weights with one symmetric scale per output channel
(absmax / 127) and activations left in the model's dtype. On a CPU with 16-bit activations the product runs in
aten's weight-only int8 kernel (``torch._weight_int8pack_mm``), which reads the int8 matrix directly, so a decode
step streams a quarter of float32's weight bytes; elsewhere (float32 activations, CUDA) the layer multiplies by
the dequantized matrix: the same numbers, none of the speed.

Why weight-only and not dynamic int8 activations as well: a dynamically quantized activation takes its scale
from the whole batch, so a token's logits would depend on which other tokens share its forward (the verify pass
over K+1 positions, other requests' rows) and speculative greedy output could drift from target-only output.
Here every row is computed from its own activations alone: the quantized model is a different model from the
float32 one (its error is measured by the build and recorded), but speculative decoding reproduces THAT model's
output exactly as it does an unquantized one's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import TORCH_QUANT_MODES

_PACK_DTYPES = (torch.bfloat16, torch.float16)  # activation dtypes aten's CPU int8 kernel is vectorized for
# The kernel reads the input dimension in blocks of 16; in torch 2.13 on other sizes it crashes or returns wrong
# numbers instead of refusing (tests/test_quantize.py checks sizes on both sides of this rule).
_PACK_IN_MULTIPLE = 16


class Int8WeightOnlyLinear(nn.Module):
    """``y = x @ (q * scale[:, None]).T + bias`` with ``q`` int8 ``[out, in]`` and ``scale`` ``[out]``."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.packable = self.in_features % _PACK_IN_MULTIPLE == 0
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8WeightOnlyLinear:
        weight = linear.weight.detach()
        absmax = weight.float().abs().amax(dim=1)
        # An all-zero row keeps scale 1 (any scale represents it); the scale is stored in the activation dtype,
        # which is what the kernel multiplies by, so both paths of forward use the same numbers.
        # Rows are rounded against the scale as stored, so a 16-bit scale's own rounding is not added on top.
        scale = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax)).to(weight.dtype)
        qweight = torch.round(weight.float() / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(qweight, scale, bias)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized matrix, for code that reads a head's shape or rows; forward never builds it on a CPU
        with 16-bit activations."""
        return self.qweight.to(self.scale.dtype) * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.packable and rows.device.type == "cpu" and rows.dtype in _PACK_DTYPES:
            out = torch._weight_int8pack_mm(rows.contiguous(), self.qweight, self.scale.to(rows.dtype))
        else:
            out = nn.functional.linear(rows, self.weight.to(rows.dtype))
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight-only"


@dataclass(frozen=True)
class QuantizedWeights:
    """What quantize_model did: the mode, how many layers it replaced and the weight bytes before and after."""

    mode: str
    layers: int
    bytes_before: int
    bytes_after: int

    def to_dict(self) -> dict:
        return {"mode": self.mode, "layers": self.layers, "weight_bytes_before": self.bytes_before,
                "weight_bytes_after": self.bytes_after}


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the tensors a forward reads as weights: the parameters and the int8 layers' matrices and scales,
    each storage counted once (tied embeddings share one). Other buffers (rotary tables) are not weights."""
    int8 = [t for m in model.modules() if isinstance(m, Int8WeightOnlyLinear) for t in m.buffers()]
    seen, total = set(), 0
    for tensor in (*model.parameters(), *int8):
        key = (tensor.untyped_storage().data_ptr(), tensor.device)
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total


def quantize_model(model: nn.Module, mode: str) -> QuantizedWeights:
    """Replace ``model``'s linear layers in place for ``mode`` (one of TORCH_QUANT_MODES); "none" changes nothing."""
    if mode not in TORCH_QUANT_MODES:
        raise ValueError(f"quantization mode {mode!r}: the torch backend implements {', '.join(TORCH_QUANT_MODES)}")
    before = weight_bytes(model)
    layers = 0
    if mode == "int8_weight_only":
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:  # subclasses (a pruned-vocabulary head, LoRA wrappers) keep theirs
                    setattr(parent, name, Int8WeightOnlyLinear.from_linear(child))
                    layers += 1
    return QuantizedWeights(mode, layers, before, weight_bytes(model))


@torch.no_grad()
def logit_error(reference: nn.Module, quantized: nn.Module, input_ids: torch.Tensor) -> dict:
    """How far ``quantized``'s logits are from ``reference``'s on ``input_ids`` [1, T]: the largest absolute
    difference, the mean one, and the share of positions whose top-1 token is the same."""
    ref = reference(input_ids).logits.float()
    got = quantized(input_ids).logits.float()
    diff = (ref - got).abs()
    return {"max_abs_logit_error": round(diff.max().item(), 4), "mean_abs_logit_error": round(diff.mean().item(), 5),
            "top1_agreement": round((ref.argmax(-1) == got.argmax(-1)).float().mean().item(), 4),
            "positions": int(input_ids.shape[1])}
