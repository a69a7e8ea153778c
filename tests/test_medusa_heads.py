"""pipeline/medusa_heads.py: heads in the layout TensorRT-LLM's Medusa converter reads, round-tripped."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.medusa_heads import HEADS_FILE, MedusaHeads

RECORDED = Path(__file__).parent / "data/trtllm_1.1.0_medusa"


def _target():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1)).eval()


def read_like_the_converter(folder: Path, num_heads: int, num_layers: int) -> dict:
    """The keys the recorded converter reads (tensorrt_llm/models/medusa/weight.py, non-ModelOpt checkpoints),
    each checked to appear in that file as this reader spells it."""
    source = (RECORDED / "tensorrt_llm/models/medusa/weight.py").read_text()
    spelled = {'f"{prefix}{h}.{l}.linear.weight"', 'f"{prefix}{h}.{l}.linear.bias"',
               'f"{prefix}{h}.{num_medusa_layers}.weight"', '"medusa_lm_head.safetensors"'}
    assert all(s in source for s in spelled), "the recorded converter reads other keys: update this reader"
    state = load_file(str(folder / "medusa_lm_head.safetensors"))
    read = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            read[f"{h}.{layer}.linear.weight"] = state.pop(f"{h}.{layer}.linear.weight")
            read[f"{h}.{layer}.linear.bias"] = state.pop(f"{h}.{layer}.linear.bias")
        read[f"{h}.{num_layers}.weight"] = state.pop(f"{h}.{num_layers}.weight")
    assert state == {}, f"keys the converter never reads: {sorted(state)}"
    return read


def test_heads_start_as_the_targets_head_and_round_trip(tmp_path):
    target = _target()
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=2)
    hidden = torch.randn(5, 16)
    with torch.no_grad():
        out = heads(hidden)  # [3, 5, 40]
        assert torch.allclose(out, target.lm_head(hidden).expand(3, -1, -1), atol=1e-6)  # residual blocks start at 0
        for p in heads.parameters():
            p.add_(0.01 * torch.randn_like(p))
    heads.save(tmp_path, base_model="some/target")
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (3, 2)
    read = read_like_the_converter(tmp_path, 3, 2)
    assert read["0.0.linear.weight"].shape == (16, 16) and read["2.2.weight"].shape == (40, 16)
    again = MedusaHeads.load(tmp_path)
    assert torch.equal(again(hidden), heads.eval()(hidden))


def test_the_default_head_and_layer_counts_are_the_converters():
    """speculative.medusa's defaults (which train-draft --kind medusa falls back to) are the converter's."""
    from pipeline.config import MedusaSpec

    converter = (RECORDED / "examples/medusa/convert_checkpoint.py").read_text()
    heads = int(re.search(r"'--num_medusa_heads', type=int, default=(\d+)", converter).group(1))
    layers = int(re.search(r"'--num_medusa_layers', type=int, default=(\d+)", converter).group(1))
    spec = MedusaSpec(model="heads")
    assert (spec.heads, spec.layers) == (heads, layers)


def test_bad_shapes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="at least 1 head"):
        MedusaHeads(0, 1, 16, 40)
    MedusaHeads(2, 1, 16, 40).save(tmp_path)
    state = load_file(str(tmp_path / HEADS_FILE))
    del state["1.1.weight"]
    from safetensors.torch import save_file

    save_file(state, str(tmp_path / HEADS_FILE))
    with pytest.raises(RuntimeError, match="1.1.weight"):
        MedusaHeads.load(tmp_path)


def test_a_reduced_vocabulary_round_trips_and_serves_only_its_tokens(tmp_path):
    from pipeline.medusa_heads import CONFIG_FILE, VOCAB_KEY

    torch.manual_seed(0)
    heads = MedusaHeads(2, 1, 8, 30)
    heads.vocab_ids = [1, 4, 5, 9, 12, 20, 29]
    heads.save(tmp_path)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert config[VOCAB_KEY] == heads.vocab_ids
    assert load_file(str(tmp_path / HEADS_FILE))["0.1.weight"].shape == (30, 8)  # the converter's [V, d] layout
    loaded = MedusaHeads.load(tmp_path)
    hidden = torch.randn(5, 8)
    full = torch.stack([loaded.head_logits(h, hidden) for h in range(2)])  # [heads, 5, N] over vocab_ids
    ids = torch.tensor(heads.vocab_ids)
    want = [ids[full[h].topk(3).indices] for h in range(2)]  # the best 3 of the covered tokens, as target ids
    got = loaded.restrict().top_tokens(hidden, [3, 3])
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert loaded[0][-1].weight.shape == (7, 8)  # serving reads only the covered rows
    with pytest.raises(ValueError, match="save the heads as trained"):
        loaded.save(tmp_path / "again")
    config[VOCAB_KEY] = [3, 2]
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(ValueError, match="ascending"):
        MedusaHeads.load(tmp_path)


def test_heads_that_do_not_match_the_config_or_target_are_named(tmp_path):
    from pipeline.medusa_heads import heads_problems

    MedusaHeads(3, 1, 8, 30).save(tmp_path)
    assert heads_problems(tmp_path, 3, 1, 8, 30) == []
    problems = heads_problems(tmp_path, 4, 2, 16, 30)
    assert any("speculative.medusa.heads: 4" in p and "medusa_num_heads 3" in p for p in problems)
    assert any("speculative.medusa.layers: 2" in p for p in problems)
    assert any("hidden_size 8, the target has 16" in p for p in problems)
    assert "no Medusa heads" in heads_problems(tmp_path / "missing", 3, 1, 8, 30)[0]
