"""pipeline/distill/draft_init.py: a draft made of a subset of the target's layers."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.distill.draft_init import default_layers, draft_from_target


def _target(layers: int = 6):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


def test_default_layers_take_the_first_and_the_last():
    assert default_layers(30, 4) == [0, 1, 28, 29]
    assert default_layers(3, 1) == [0]
    assert default_layers(6, 3) == [0, 1, 5]
    with pytest.raises(ValueError, match="between 1 and the target's 6"):
        default_layers(6, 7)


def test_all_layers_reproduce_the_target_and_a_subset_decodes_with_its_cache():
    target = _target()
    ids = torch.randint(0, 64, (1, 12))
    assert torch.allclose(draft_from_target(target, list(range(6)))(ids).logits, target(ids).logits)
    draft = draft_from_target(target, [0, 4, 5])
    assert draft.config.num_hidden_layers == 3 and target.config.num_hidden_layers == 6  # the target is untouched
    assert [layer.self_attn.layer_idx for layer in draft.model.layers] == [0, 1, 2]
    # Cached decoding equals recomputing the whole sequence: the renumbered layers index their own cache slots.
    generated = draft.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                               pad_token_id=0)
    sequence = ids
    for _ in range(6):
        next_id = draft(sequence).logits[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, next_id], dim=1)
    assert generated.tolist() == sequence.tolist()
