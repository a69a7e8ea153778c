"""A draft that starts from the target: the same embeddings, final norm, LM head and tokenizer, and a subset of its
decoder layers, so training starts from a model that already predicts in the target's own terms."""

from __future__ import annotations

import copy

import torch


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's stack of decoder layers: the ModuleList as long as config.num_hidden_layers."""
    count = model.config.num_hidden_layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return module
    raise ValueError(f"{type(model).__name__}: no ModuleList of {count} decoder layers found; train-draft supports "
                     f"decoder-only models whose layers form one list (Llama, Qwen2, Mistral, GPT-2, ...)")


def default_layers(num_layers: int, keep: int) -> list[int]:
    """Which target layers a ``keep``-layer draft starts from: the first half and the last half of ``keep``.

    The last layers are the ones whose output the final norm and LM head expect; the first ones build the
    representation the rest read. (The first ``keep`` alone leave the head reading early states it never saw.)"""
    if not 1 <= keep <= num_layers:
        raise ValueError(f"--layers: {keep} must be between 1 and the target's {num_layers} layers")
    first = (keep + 1) // 2
    return list(range(first)) + list(range(num_layers - (keep - first), num_layers))


def draft_from_target(target, layers: list[int]):
    """A copy of ``target`` keeping only decoder ``layers`` (in order), renumbered for the KV cache."""
    draft = copy.deepcopy(target)
    stack = decoder_layers(draft)
    kept = [stack[i] for i in layers]
    for new_index, layer in enumerate(kept):
        for module in layer.modules():  # attention modules index the KV cache by their layer number
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_index
    stack._modules.clear()
    for index, layer in enumerate(kept):
        stack.add_module(str(index), layer)
    draft.config.num_hidden_layers = len(kept)
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = [draft.config.layer_types[i] for i in layers]
    return draft
