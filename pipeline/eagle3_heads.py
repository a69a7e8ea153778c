"""EAGLE-3 heads: one decoder layer that drafts from a fusion of three of the target's layers.

The target's outputs after a low, a middle and a high layer (``target_layers``, 0-based: the residual stream after
that layer) are concatenated and projected to the hidden size (``fc``). The layer (``midlayer``) reads, per
position, two halves side by side: the embedding of the next token (``input_layernorm``) and a hidden state
(``hidden_norm``): the fused target state at the first draft step, the layer's own output at the steps after it.
Its attention takes that 2d-wide input to the usual heads; the residual is the hidden state, so each step's output
before ``norm`` (``prenorm``) is the hidden state of the next step. ``lm_head`` ranks a reduced vocabulary of
``draft_vocab_size`` target ids: draft id i is target id ``i + d2t[i]``; ``t2d[t]`` says whether target id t has a
draft id. The token embedding is the target's own (frozen).

Saved as vLLM's ``Eagle3`` layout, which SGLang and TensorRT-LLM's PyTorch backend read too (recorded loaders in
tests/data/eagle3_recorded): ``config.json`` (architectures ``LlamaForCausalLMEagle3``, the layer's sizes,
``draft_vocab_size``, ``target_hidden_size``, ``norm_before_residual``) and ``model.safetensors`` with unprefixed
``midlayer.*`` (SGLang matches that name; vLLM renames it to ``layers.0.``), ``fc.weight``, ``norm.weight``,
``lm_head.weight``, ``d2t``, ``t2d`` and a copy of the target's ``embed_tokens.weight``. The fused layers are
written twice because the engines count differently: top-level ``eagle_aux_hidden_state_layer_ids`` in vLLM's
indexing (a layer's input: ours + 1), and ``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang's (which adds
1 itself: ours). TensorRT-LLM takes them as ``eagle3_layers_to_capture`` (a layer's output: ours).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .layer_math import rms_norm, rotate

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"
ENGINE_SUBDIR = "eagle3"  # where a torch target engine keeps its copy of the heads


FUSED_LAYERS = 3  # vLLM's and SpecForge's fc reads exactly three target layers


def default_layers(num_layers: int) -> list[int]:
    """The usual low / middle / high choice (0-based outputs): after layer 1, the middle one, and the fourth from
    the end (TensorRT-LLM's default capture), made distinct on a shallow model."""
    check_depth(num_layers)
    chosen = {layer for layer in (1, num_layers // 2 - 1, num_layers - 4) if 0 <= layer < num_layers - 1}
    for layer in range(num_layers - 1):
        if len(chosen) == FUSED_LAYERS:
            break
        chosen.add(layer)
    return sorted(chosen)


def check_depth(num_layers: int) -> None:
    if num_layers < FUSED_LAYERS + 1:
        raise ValueError(f"EAGLE-3 heads fuse {FUSED_LAYERS} target layers below the last, and the target has "
                         f"{num_layers} layers; use another method (ngram, suffix, a draft model) for this target")


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    target_layers: tuple[int, ...]  # 0-based target layers whose outputs are fused
    norm_before_residual: bool = False
    extra: dict = field(default_factory=dict, compare=False)  # keys of a loaded config.json this code ignores

    @classmethod
    def for_target(cls, target, layers: list[int], draft_vocab_size: int) -> Eagle3Config:
        """Sizes of one of ``target``'s own layers (an HF causal LM of the Llama family)."""
        c = target.config.get_text_config()
        heads = c.num_attention_heads
        return cls(hidden_size=c.hidden_size, num_attention_heads=heads,
                   intermediate_size=getattr(c, "intermediate_size", None) or 4 * c.hidden_size,
                   num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                   rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)), rope_theta=float(_rope_theta(c)),
                   max_position_embeddings=int(getattr(c, "max_position_embeddings", 4096)),
                   vocab_size=target.get_input_embeddings().weight.shape[0], draft_vocab_size=draft_vocab_size,
                   target_hidden_size=c.hidden_size, target_layers=tuple(layers))

    def to_json(self) -> dict:
        own = {k: v for k, v in asdict(self).items() if k not in ("target_layers", "extra")}
        return {"architectures": [ARCHITECTURE], "model_type": "llama", **own, "num_hidden_layers": 1,
                "hidden_act": "silu", "tie_word_embeddings": False,
                "eagle_aux_hidden_state_layer_ids": [layer + 1 for layer in self.target_layers],
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.target_layers)}}

    @classmethod
    def from_json(cls, data: dict) -> Eagle3Config:
        if ARCHITECTURE not in data.get("architectures", []):
            raise ValueError(f"architectures {data.get('architectures')}: not EAGLE-3 heads ({ARCHITECTURE}); train "
                             f"them with `python -m pipeline train-draft CONFIG --kind eagle3`")
        names = [f for f in cls.__dataclass_fields__ if f not in ("target_layers", "extra")]
        missing = [name for name in names if name not in data and name not in ("norm_before_residual",
                                                                               "target_hidden_size")]
        if missing:
            raise ValueError(f"config.json: missing {', '.join(missing)}")
        layers = _fused_layers(data)
        values = {name: data[name] for name in names if name in data}
        values.setdefault("target_hidden_size", data["hidden_size"])
        return cls(**values, target_layers=layers, extra={k: v for k, v in data.items() if k not in names})


def _fused_layers(data: dict) -> tuple[int, ...]:
    """The fused target layers (0-based outputs) from vLLM's top-level ids (inputs) or SGLang's nested ones."""
    vllm = data.get("eagle_aux_hidden_state_layer_ids")
    sglang = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(int(i) - 1 for i in vllm) if vllm else tuple(int(i) for i in sglang or ())
    if not layers:
        raise ValueError("config.json: eagle_aux_hidden_state_layer_ids (the fused target layers) is missing")
    if vllm and sglang and tuple(sglang) != layers:
        raise ValueError(f"config.json: eagle_aux_hidden_state_layer_ids {vllm} (vLLM's, layer inputs) and "
                         f"eagle_config.eagle_aux_hidden_state_layer_ids {sglang} (SGLang's, layer outputs) name "
                         f"different layers; keep one")
    return layers


def _rope_theta(config) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:  # transformers 5 keeps it in rope_parameters
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return theta


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)


class _Layer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)


@dataclass
class Projected:
    """One layer input projected: q [..., T, H, hd] and k, v [..., T, KVH, hd] (RoPE applied), and the residual."""

    q: Tensor
    k: Tensor
    v: Tensor
    residual: Tensor


class Eagle3Heads(nn.Module):
    """The heads (see the module docstring). Attention is the caller's: training masks a whole sequence's draft
    steps at once, the proposer attends over its cached keys; both use :meth:`project` and :meth:`finish`."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(len(c.target_layers) * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = _Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool) if c.draft_vocab_size == c.vocab_size
                             else torch.zeros(c.vocab_size, dtype=torch.bool))
        self.scaling = c.head_dim ** -0.5
        self.embed: Tensor | None = None  # the target's token embedding [V, d], set by attach()
        # How a linear layer multiplies x [..., in] (None: its own forward). A proposer sets the product its runtime
        # measured fastest for the few rows of a draft step; training leaves it unset.
        self.product: Callable[[Tensor, nn.Linear], Tensor] | None = None

    # ---- construction and files ---------------------------------------------------------------------------------

    @classmethod
    def for_target(cls, target, layers: list[int], vocab_ids: list[int] | None) -> Eagle3Heads:
        """New heads for ``target`` proposing ``vocab_ids`` (ascending target ids; None: the whole vocabulary).
        The layer starts as a copy of the target's last layer where the shapes allow (its attention's halves
        reading the embedding half, as the target's last layer reads its own input) and the head as the target's
        LM head rows: a start that already predicts roughly what the target does."""
        vocab = target.get_input_embeddings().weight.shape[0]
        ids = list(range(vocab)) if vocab_ids is None else list(vocab_ids)
        heads = cls(Eagle3Config.for_target(target, layers, len(ids)))
        heads.set_vocab(ids)
        heads._start_from(target, ids)
        return heads.attach(target)

    def _start_from(self, target, ids: list[int]) -> None:
        with torch.no_grad():
            self.lm_head.weight.copy_(target.get_output_embeddings().weight[torch.tensor(ids)])
        try:
            self._copy_last_layer(target)
        except (AttributeError, RuntimeError):  # not a Llama-style layer (GPT-2, ...): the layer starts at random
            pass

    def _copy_last_layer(self, target) -> None:
        last = target.base_model.layers[-1]
        d = self.config.hidden_size
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj"):
                mine, theirs = getattr(self.midlayer.self_attn, name), getattr(last.self_attn, name)
                mine.weight.zero_()
                mine.weight[:, d:] = theirs.weight  # the hidden half: the target's layer reading its residual
            self.midlayer.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(self.midlayer.mlp, name).weight.copy_(getattr(last.mlp, name).weight)
            self.midlayer.hidden_norm.weight.copy_(last.input_layernorm.weight)
            self.midlayer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
            self.norm.weight.copy_(target.base_model.norm.weight)
            # The last of the fused layers passes through; the others start at zero.
            self.fc.weight.zero_()
            self.fc.weight[:, -self.config.target_hidden_size:] = torch.eye(d)

    def set_vocab(self, ids: list[int]) -> None:
        """Draft id i proposes target id ids[i] (ascending)."""
        index = torch.tensor(ids, dtype=torch.long)
        self.d2t.copy_(index - torch.arange(len(ids)))
        self.t2d.zero_()
        self.t2d[index] = True

    def attach(self, target) -> Eagle3Heads:
        """Read token embeddings from ``target`` (not a parameter of the heads: the target's, frozen)."""
        self.embed = target.get_input_embeddings().weight.detach()
        return self

    def save(self, folder: Path, dtype: torch.dtype | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        weights = {name: tensor.detach().to(dtype) if dtype is not None and tensor.is_floating_point()
                   else tensor.detach() for name, tensor in self.state_dict().items()}
        if self.embed is not None:
            weights["embed_tokens.weight"] = self.embed.to(dtype or self.embed.dtype)
        save_file({k: v.contiguous().cpu() for k, v in weights.items()}, str(folder / WEIGHTS_FILE))
        data = self.config.to_json()
        data["torch_dtype"] = str(dtype or self.fc.weight.dtype).removeprefix("torch.")
        (folder / CONFIG_FILE).write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path) -> Eagle3Heads:
        folder = Path(folder)
        if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(f"{folder}: no EAGLE-3 heads ({CONFIG_FILE} and {WEIGHTS_FILE}); train them with "
                                    f"`python -m pipeline train-draft CONFIG --kind eagle3`")
        config = Eagle3Config.from_json(json.loads((folder / CONFIG_FILE).read_text()))
        heads = cls(config)
        weights = load_file(str(folder / WEIGHTS_FILE))
        embed = weights.pop("embed_tokens.weight", None)
        heads.load_state_dict({k: v.to(heads.d2t.dtype) if k == "d2t" else v for k, v in weights.items()})
        heads.to(weights["fc.weight"].dtype)
        if embed is not None:
            heads.embed = embed.to(weights["fc.weight"].dtype)
        return heads

    def fits(self, target) -> str | None:
        """Why these heads cannot draft for ``target`` (None: they can)."""
        c, t = self.config, target.config.get_text_config()
        vocab = target.get_input_embeddings().weight.shape[0]
        if c.target_hidden_size != t.hidden_size or c.vocab_size != vocab:
            return (f"heads for hidden size {c.target_hidden_size} and vocabulary {c.vocab_size}, the target has "
                    f"{t.hidden_size} and {vocab}; train heads for this target")
        if max(c.target_layers) >= t.num_hidden_layers - 1:
            return f"heads fuse target layers {list(c.target_layers)}, the target has {t.num_hidden_layers}"
        return None

    # ---- the layer ----------------------------------------------------------------------------------------------

    def _linear(self, layer: nn.Linear, x: Tensor) -> Tensor:
        return layer(x) if self.product is None else self.product(x, layer)

    def fuse(self, states: Tensor) -> Tensor:
        """The target layers' outputs [..., len(target_layers), d_t] -> the first step's hidden state [..., d]."""
        return self._linear(self.fc, states.flatten(-2).to(self.fc.weight.dtype))

    def project(self, tokens: Tensor, hidden: Tensor, positions: Tensor) -> Projected:
        """tokens [..., T] (the token after each position), hidden [..., T, d], positions [..., T] (float RoPE
        angles follow them)."""
        c, layer = self.config, self.midlayer
        embeds = self.embed[tokens].to(hidden.dtype)
        if c.norm_before_residual:
            hidden = layer.hidden_norm(hidden)
            residual, h = hidden, hidden
        else:
            residual, h = hidden, layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(embeds), h], dim=-1)
        attn = layer.self_attn
        shape = x.shape[:-1]
        q = self._linear(attn.q_proj, x).view(*shape, c.num_attention_heads, c.head_dim)
        k = self._linear(attn.k_proj, x).view(*shape, c.num_key_value_heads, c.head_dim)
        v = self._linear(attn.v_proj, x).view(*shape, c.num_key_value_heads, c.head_dim)
        cos, sin = self._rope(positions, x.dtype)
        return Projected(rotate(q, cos, sin), rotate(k, cos, sin), v, residual)

    def finish(self, attended: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """attended [..., T, H, hd] (attention's output per head) -> (normed output for lm_head, prenorm: the next
        step's hidden state), both [..., T, d]."""
        layer, mlp = self.midlayer, self.midlayer.mlp
        r = self._linear(layer.self_attn.o_proj, attended.flatten(-2)) + residual
        h = layer.post_attention_layernorm(r)
        prenorm = self._linear(mlp.down_proj, F.silu(self._linear(mlp.gate_proj, h)) * self._linear(mlp.up_proj, h)) + r
        return self.norm(prenorm), prenorm

    def logits(self, normed: Tensor) -> Tensor:
        """[..., draft_vocab_size] logits over the draft ids."""
        return self._linear(self.lm_head, normed)

    def target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def _rope(self, positions: Tensor, dtype) -> tuple[Tensor, Tensor]:
        half = self.config.head_dim // 2
        inv_freq = 1.0 / self.config.rope_theta ** (torch.arange(half, device=positions.device) / half)
        angles = positions.to(torch.float32)[..., None] * inv_freq  # [..., T, hd/2], float32 whatever the dtype
        angles = torch.cat([angles, angles], dim=-1)[..., None, :]  # [..., T, 1, hd]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scaling: float) -> Tensor:
    """q [T, H, hd] over keys/values [S, KVH, hd] (grouped heads), mask [T, S] True where allowed -> [T, H, hd]."""
    group = q.shape[-2] // keys.shape[-2]
    keys = keys.repeat_interleave(group, dim=-2)
    values = values.repeat_interleave(group, dim=-2)
    scores = torch.einsum("thd,shd->hts", q, keys).float() * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return torch.einsum("hts,shd->thd", scores.softmax(-1).to(values.dtype), values)
