"""The two pieces of a Llama-family layer that more than one module computes by hand: RMSNorm and rotary positions
(the lean decoder runs the target's layers with them, EAGLE-3 heads their own layer)."""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Hugging Face's LlamaRMSNorm to the bit: the statistics in float32, the scale in the model's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., heads, d]; cos/sin broadcast to it. RoPE with the halves layout Hugging Face's Llama uses."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
