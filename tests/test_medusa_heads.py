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


def test_train_drafts_default_head_count_is_the_converters():
    from pipeline.cli import build_parser

    converter = (RECORDED / "examples/medusa/convert_checkpoint.py").read_text()
    default = int(re.search(r"'--num_medusa_heads', type=int, default=(\d+)", converter).group(1))
    args = build_parser().parse_args(["train-draft", "some.yaml", "--kind", "medusa"])
    assert args.heads == default


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
