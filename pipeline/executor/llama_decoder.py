"""A lean decoder for the Llama family, run on the paged KV cache without the Hugging Face modules.

Llama 2/3 (any static RoPE scaling), Mistral without a sliding window in reach, Qwen2 (QKV bias) and SmolLM share
one layer: RMSNorm, attention with rotary positions and grouped KV heads, RMSNorm, a SiLU-gated MLP. Run through the
Hugging Face modules a decode step of such a model spends as long in small ops and module calls as in its matrix
products; here a layer is four matrix products (fused QKV, output, fused gate/up, down), the norms, a RoPE lookup in
precomputed tables, and paged attention. Where the row kernels' C++ library loads (row_kernels.py), an eager forward
on a CPU also runs RMSNorm, RoPE and SiLU(gate) * up as one operator each (rounded as the torch expressions; a
compiled forward leaves them to the compiler), and a step whose rows share one width runs each layer in one call.
The weights are the loaded model's: the fused matrices are new tensors (from huge_pages.MIN_BYTES of them, in one
block of huge pages) and the model's own projections become views into them, so nothing is held twice and the
model still serves ``generate``.

``unsupported(model)`` says why a model must stay on the Hugging Face path (None when it may run here; the rules on
config.json alone are pipeline/decoder_support.py's, which `check` and the build use); the engine checks it and
falls back, and the tests compare both paths' logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..decoder_support import unsupported_config
from ..layer_math import rms_norm, rotate
from ..quantize import Int8WeightOnlyLinear
from . import huge_pages, matmul_choice, row_kernels
from .matmul_choice import KernelPlan, product
from . import paged_attention  # also registers torch.ops.specpipe.paged_attention

MATRIX_TYPES = {nn.Linear, Int8WeightOnlyLinear}


def unsupported(model, max_positions: int) -> str | None:
    """Why the loaded ``model`` cannot run on the lean decoder (a sentence), or None."""
    reason = unsupported_config(model.config.to_dict(), max_positions)
    if reason is not None:
        return reason
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,), (mlp.gate_proj, mlp.up_proj),
                      (mlp.down_proj,)):
            kinds = {type(linear) for linear in group}
            if len(kinds) > 1 or not kinds <= MATRIX_TYPES:
                return f"{'/'.join(sorted(k.__name__ for k in kinds))} projections (the decoder fuses nn.Linear " \
                       f"and int8 weight-only layers)"
    if type(model.lm_head) not in MATRIX_TYPES:
        return f"a {type(model.lm_head).__name__} LM head"
    hooked = next((name for name, module in model.named_modules() if _user_hooks(module)), None)
    if hooked is not None:  # the lean decoder calls no module, so a hook (instrumentation, offloading) would not run
        return f"forward hooks on {hooked or 'the model'}"
    return None


def _user_hooks(module) -> bool:
    """Forward hooks on ``module`` other than the ones transformers installs to collect hidden states."""
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    return any(not getattr(hook, "__module__", "").startswith("transformers.utils.output_capturing") for hook in hooks)


def _fuse(linears: list, arena: huge_pages.Arena | None = None) -> tuple[Tensor | Int8WeightOnlyLinear, Tensor | None]:
    """One [sum(out), in] matrix (and bias) holding ``linears``' weights (in ``arena`` when given); each linear's
    weight (and bias) becomes a view into it, so the memory is not doubled. int8 layers fuse into one int8 layer
    (the bias inside it). One linear is "fused" too when it moves into an arena."""
    if isinstance(linears[0], Int8WeightOnlyLinear):
        return _fuse_int8(linears), None
    weight = torch.cat([linear.weight.detach() for linear in linears])
    if arena is not None:
        weight = arena.copy(weight)
    bias = _stacked_bias(linears, weight)
    start = 0
    for linear in linears:
        end = start + linear.out_features
        linear.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight, bias


def _stacked_bias(layers: list, like: Tensor) -> Tensor | None:
    """The layers' biases end to end (zeros for a layer without one), or None when none has a bias."""
    if all(layer.bias is None for layer in layers):
        return None
    return torch.cat([layer.bias.detach() if layer.bias is not None else like.new_zeros(layer.out_features)
                      for layer in layers])


def _fuse_int8(layers: list[Int8WeightOnlyLinear]) -> Int8WeightOnlyLinear:
    """Per output channel the int8 kernel is independent of the other channels: stacking the rows and their scales
    gives each channel the same numbers it had alone."""
    bias = _stacked_bias(layers, layers[0].scale)
    fused = Int8WeightOnlyLinear(torch.cat([layer.qweight for layer in layers]),
                                 torch.cat([layer.scale for layer in layers]), bias)
    start = 0
    for layer in layers:
        end = start + layer.out_features
        layer.qweight, layer.scale = fused.qweight[start:end], fused.scale[start:end]
        if layer.bias is not None:
            layer.bias = nn.Parameter(fused.bias[start:end], requires_grad=False)
        start = end
    return fused


def _matrix(linear, arena: huge_pages.Arena | None = None) -> tuple[Tensor | Int8WeightOnlyLinear, Tensor | None]:
    """An unfused projection as (weight, bias) (moved into ``arena`` when given); an int8 layer is kept whole (it
    applies its bias)."""
    if isinstance(linear, Int8WeightOnlyLinear):
        return linear, None
    if arena is not None:
        return _fuse([linear], arena)
    return linear.weight.detach(), linear.bias


def _constant(module: nn.Module, name: str, tensor: Tensor | None) -> None:
    """``tensor`` as a parameter that takes no gradient: inductor's freezing folds parameters into the compiled
    graph as constants (buffers stay graph inputs)."""
    module.register_parameter(name, None if tensor is None else nn.Parameter(tensor, requires_grad=False))


class _Layer(nn.Module):
    """One decoder layer's weights (as parameters: see _constant)."""

    def __init__(self, layer, arena: huge_pages.Arena | None = None):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self._weight("qkv", *_fuse([attn.q_proj, attn.k_proj, attn.v_proj], arena))
        self._weight("o", *_matrix(attn.o_proj, arena))
        self._weight("gate_up", *_fuse([mlp.gate_proj, mlp.up_proj], arena))
        self._weight("down", *_matrix(mlp.down_proj, arena))
        _constant(self, "norm1", layer.input_layernorm.weight.detach())
        _constant(self, "norm2", layer.post_attention_layernorm.weight.detach())
        self.eps1, self.eps2 = layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon
        self.scaling = attn.scaling
        self.q_width = attn.q_proj.out_features
        self.kv_width = attn.k_proj.out_features
        self.intermediate = mlp.gate_proj.out_features

    def _weight(self, name: str, weight, bias: Tensor | None) -> None:
        if isinstance(weight, nn.Module):  # an int8 layer: a submodule with its own buffers
            setattr(self, name, weight)
        else:
            _constant(self, name, weight)
        _constant(self, f"{name}_bias", None if bias is None else bias.detach())


def _matrix_modules(model) -> list[nn.Module]:
    """The model's weight matrices as modules: its decoder layers' projections and its LM head."""
    return [m for m in model.model.layers.modules() if type(m) in MATRIX_TYPES] + [model.lm_head]


def _matrix_bytes(model) -> int:
    """Bytes of the model's weight matrices (an int8 layer's buffers included)."""
    return sum(t.numel() * t.element_size() for m in _matrix_modules(model)
               for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])


def _arena(model) -> huge_pages.Arena | None:
    """Huge-page memory for the model's weight matrices (huge_pages.py), for a float model on a CPU where Linux
    gives them; else None (the matrices stay where torch put them)."""
    linears = _matrix_modules(model)
    if any(not isinstance(m, nn.Linear) for m in linears) or model.lm_head.weight.device.type != "cpu" \
            or huge_pages.unavailable() is not None:
        return None
    return huge_pages.Arena(sum(huge_pages.padded(m.weight.numel() * m.weight.element_size()) for m in linears))


class LlamaDecoder(nn.Module):
    """The decoder of a loaded Llama-family causal LM (see the module docstring); call it with one packed forward
    inside ``paged_attention.active(plan, cache)``."""

    def __init__(self, model, max_positions: int, kernels: KernelPlan | None = None, aux_layers: tuple = ()):
        """``kernels``: the matrix product per forward width; left out, measured over the model's weights on a
        CPU (F.linear throughout on CUDA). ``aux_layers``: decoder layers whose outputs (the residual stream after
        them) every forward also returns, for every token (see step)."""
        reason = unsupported(model, max_positions)
        if reason is not None:
            raise ValueError(f"the lean decoder cannot run this model: {reason}")
        super().__init__()
        self.aux_layers = tuple(aux_layers)
        config, body = model.config, model.model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = body.layers[0].self_attn.head_dim
        arena = _arena(model) if _matrix_bytes(model) >= huge_pages.MIN_BYTES else None
        tied = model.lm_head.weight is body.embed_tokens.weight
        self.layers = nn.ModuleList(_Layer(layer, arena) for layer in body.layers)
        _constant(self, "norm", body.norm.weight.detach())
        self.eps = body.norm.variance_epsilon
        lm_head, lm_head_bias = _matrix(model.lm_head, arena)
        if tied and arena is not None:  # the model's embedding is the LM head's weight, now in the arena
            body.embed_tokens.weight = model.lm_head.weight
        _constant(self, "embed", body.embed_tokens.weight.detach())
        if isinstance(lm_head, nn.Module):
            self.lm_head = lm_head
        else:
            _constant(self, "lm_head", lm_head)
        _constant(self, "lm_head_bias", lm_head_bias)
        with torch.inference_mode():
            positions = torch.arange(max_positions, device=self.embed.device)[None]
            cos, sin = body.rotary_emb(self.embed[:1], positions)  # [1, P, d] in the model's dtype, as HF makes it
        _constant(self, "cos", cos[0])
        _constant(self, "sin", sin[0])
        self.kernels = kernels if kernels is not None else self._measure_kernels()
        # whether eager forwards run the per-token operations as the row kernels' operators: for a small model as
        # much as a large one, whose step is then mostly its calls from Python
        self.layer_ops = (self.embed.device.type == "cpu" and self.embed.dtype in row_kernels.DTYPES
                          and row_kernels.unavailable() is None)
        # each layer's weights as row_kernels.decoder_layer takes them, where the rows kernel multiplies them all
        self.layer_weights = None
        if self.layer_ops and all(row_kernels.supports(self.embed.dtype, w) for w in self._matrices()[:-1]):
            self.layer_weights = [row_kernels.layer_weights(
                layer.norm1, layer.eps1, [(layer.qkv, layer.qkv_bias), (layer.o, layer.o_bias),
                                          (layer.gate_up, layer.gate_up_bias), (layer.down, layer.down_bias)],
                layer.norm2, layer.eps2) for layer in self.layers]

    def _matrices(self) -> list:
        return [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.lm_head]

    def _measure_kernels(self) -> KernelPlan:
        weights = self._matrices()
        if self.embed.device.type != "cpu":
            return KernelPlan()  # cuBLAS picks its kernel per shape (and timing unsynchronized calls measures launches)
        if len({isinstance(w, Tensor) for w in weights}) > 1:
            return KernelPlan()  # one plan times every matrix of a forward with the same kinds
        return matmul_choice.measured_once(weights)

    def _fused(self) -> bool:
        """Whether this forward runs the row kernels' operators (a compiled or exported one leaves the per-token
        operations to the compiler)."""
        return self.layer_ops and not torch.compiler.is_compiling()

    @staticmethod
    def _norm(x: Tensor, weight: Tensor, eps: float, fused: bool) -> Tensor:
        return row_kernels.rms_norm(x, weight, eps) if fused else rms_norm(x, weight, eps)

    def forward(self, input_ids: Tensor, positions: Tensor, keep: Tensor,
                hidden: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """input_ids, positions [T] (packed, the active plan's tokens then any padding); ``keep`` [K] the packed
        positions whose logits come back. Returns logits [K, V] (and the final normed hidden states [K, d] with
        ``hidden``)."""
        logits, final, _ = self.step(input_ids, positions, keep)
        return (logits, final) if hidden else logits

    def step(self, input_ids: Tensor, positions: Tensor, keep: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """(logits [K, V], final hidden states [K, d], the aux_layers' outputs [T, len(aux_layers), d] or None)."""
        x, aux = self.body(input_ids, positions)
        final = self.final(x, keep)
        return self.head(final), final, aux

    def body(self, input_ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor | None]:
        """The residual stream after the last layer [T, d], and after each of aux_layers [T, n, d] (or None)."""
        x = self.embed[input_ids]  # [T, d]
        kind, fused = self.kernels.kind(x.shape[0]), self._fused()
        cos, sin = self.cos[positions], self.sin[positions]  # [T, d]: what the fused RoPE reads
        if not fused:
            cos, sin = cos[:, None], sin[:, None]  # [T, 1, d]: broadcast over the heads
        captured = {}
        # one dense attention group on the paged kernel: the layer, or else its attention, in one C++ call
        paged = paged_attention.one_paged_group(x.shape[0]) if fused else None
        whole = paged is not None and self._whole_layers(x.shape[0], kind)
        for index, layer in enumerate(self.layers):
            if whole:
                x = self._one_call(index, layer, x, cos, sin, paged)
            else:
                x = self._layer(index, layer, x, cos, sin, kind, fused, paged)
            if index in self.aux_layers:
                captured[index] = x
        aux = torch.stack([captured[i] for i in self.aux_layers], dim=1) if captured else None
        return x, aux

    def _layer(self, index: int, layer: _Layer, x: Tensor, cos: Tensor, sin: Tensor, kind: str, fused: bool,
               paged: tuple | None) -> Tensor:
        """The residual stream after ``layer``, operator by operator (its attention in one call with ``paged``)."""
        h = self._norm(x, layer.norm1, layer.eps1, fused)
        x = x + self._attention(index, layer, h, cos, sin, kind, fused, paged)
        h = product(kind, self._norm(x, layer.norm2, layer.eps2, fused), layer.gate_up, layer.gate_up_bias)
        if fused:
            gated = row_kernels.silu_mul(h)
        else:
            gate, up = h.split(layer.intermediate, dim=-1)
            gated = F.silu(gate) * up
        return x + product(kind, gated, layer.down, layer.down_bias)

    def _one_call(self, index: int, layer: _Layer, x: Tensor, cos: Tensor, sin: Tensor, paged: tuple) -> Tensor:
        """The residual stream after ``layer``, in one C++ call (see _whole_layers)."""
        cache, group = paged
        keys, values = self._pools(cache, index, x)
        return row_kernels.decoder_layer(x, self.layer_weights[index], cos, sin, keys, values, cache.write_slots,
                                         group.blocks, group.mask, self.heads, layer.scaling)

    def _pools(self, cache, index: int, x: Tensor) -> tuple[Tensor, Tensor]:
        return cache.pools(index, self.kv_heads, self.head_dim, x.dtype, x.device)

    def _whole_layers(self, tokens: int, kind: str) -> bool:
        """Whether every layer of a forward whose attention is one dense paged group runs as one
        row_kernels.decoder_layer call: every product the rows kernel's, and the rows kernel takes them all."""
        return kind == "rows" and self.layer_weights is not None and 0 < tokens <= row_kernels.MAX_ROWS

    def final(self, x: Tensor, keep: Tensor) -> Tensor:
        """The final normed hidden states of the ``keep`` positions [K, d]: the LM head runs only where someone
        reads the logits."""
        return self._norm(x[keep], self.norm, self.eps, self._fused())

    def head(self, final: Tensor) -> Tensor:
        return product(self.kernels.kind(final.shape[0]), final, self.lm_head, self.lm_head_bias)

    def _attention(self, index: int, layer: _Layer, h: Tensor, cos: Tensor, sin: Tensor, kind: str, fused: bool,
                   paged: tuple | None) -> Tensor:
        tokens = h.shape[0]
        qkv = product(kind, h, layer.qkv, layer.qkv_bias)
        if paged is not None:  # RoPE, the KV write and attention in one C++ call
            cache, group = paged
            keys, values = self._pools(cache, index, qkv)
            out = row_kernels.rope_write_attend(qkv, cos, sin, keys, values, cache.write_slots, group.blocks,
                                                group.mask, self.heads, layer.scaling)
            return product(kind, out, layer.o, layer.o_bias)
        if fused:  # the query and key heads rotated in place, one operator
            row_kernels.rope_(qkv, cos, sin, self.heads + self.kv_heads)
        q, k, v = qkv.split((layer.q_width, layer.kv_width, layer.kv_width), dim=-1)
        q, k = q.view(tokens, self.heads, self.head_dim), k.view(tokens, self.kv_heads, self.head_dim)
        if not fused:
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        v = v.view(tokens, self.kv_heads, self.head_dim)
        out = torch.ops.specpipe.paged_attention(q, k, v, index, layer.scaling)  # [T, heads, d]
        return product(kind, out.reshape(tokens, self.heads * self.head_dim), layer.o, layer.o_bias)
