"""pipeline/eagle3_heads.py's files against the loaders RECORDED from the engines that run EAGLE-3 heads
(tests/data/eagle3_recorded, each file's repository, path and commit in its .source): the SpecForge draft model
class (the trainer whose checkpoints SGLang, vLLM and TensorRT-LLM load) takes our weights with strict key and shape
checks, and the names and config keys the vLLM, SGLang and TensorRT-LLM loaders read are the ones we write."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import load_file

from pipeline.eagle3_heads import Eagle3Heads, default_layers
from tests.executor.test_eagle3_proposer import shaken_heads, small_llama

RECORDED = Path(__file__).parent / "data" / "eagle3_recorded"


def recorded(project: str, name: str) -> str:
    source = (RECORDED / project / f"{name}.source").read_text()
    assert re.search(r"^commit: [0-9a-f]{40}$", source, re.M), source  # a recorded file names its commit
    return (RECORDED / project / name).read_text()


def saved_heads(tmp_path: Path, vocab_ids=None) -> Path:
    target = small_llama()
    heads = shaken_heads(target, vocab_ids)
    heads.save(tmp_path / "heads", torch.bfloat16)
    return tmp_path / "heads"


def specforge_draft_class(monkeypatch):
    """The recorded SpecForge module, imported as itself. Only the imports that build no parameter are stand-ins:
    its flex-attention helpers, distributed groups, logging, registry decorator and base class."""
    import torch.nn as nn

    def module(name: str, **attrs):
        stub = types.ModuleType(name)
        stub.__path__ = []
        stub.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, stub)

    module("specforge")
    module("specforge.modeling")
    module("specforge.modeling.draft")
    module("specforge.modeling.draft.flex_attention", compile_friendly_create_block_mask=None,
           compile_friendly_flex_attention=None, generate_eagle3_mask=None)
    module("specforge.utils", print_with_rank=print)
    module("specforge.distributed", get_sp_ring_group=None, get_sp_ulysses_group=None)

    class Eagle3DraftModel(nn.Module):
        def __init__(self, config):
            super().__init__()

        def post_init(self):  # transformers' weight initialisation: the loaded weights replace it
            pass

    module("specforge.modeling.draft.base", Eagle3DraftModel=Eagle3DraftModel)
    module("specforge.modeling.draft.registry", register_draft=lambda cls: cls)
    spec = importlib.util.spec_from_file_location("specforge.modeling.draft.llama3_eagle",
                                                  RECORDED / "specforge" / "llama3_eagle.py")
    loaded = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, loaded)
    spec.loader.exec_module(loaded)
    return loaded.LlamaForCausalLMEagle3


def test_the_recorded_specforge_draft_loads_our_weights_strictly(tmp_path, monkeypatch):
    from transformers import LlamaConfig

    folder = saved_heads(tmp_path, list(range(5, 45)))
    data = json.loads((folder / "config.json").read_text())
    draft = specforge_draft_class(monkeypatch)(LlamaConfig(**data))
    weights = load_file(str(folder / "model.safetensors"))
    missing, unexpected = draft.load_state_dict(weights, strict=False)
    assert (missing, unexpected) == ([], [])
    for name, tensor in draft.state_dict().items():  # strict on shapes too
        assert tensor.shape == weights[name].shape, name
    # d2t holds offsets and t2d marks the draft's target ids, as the recorded class's buffers mean them.
    assert (torch.arange(40) + weights["d2t"]).tolist() == list(range(5, 45))
    assert weights["t2d"].nonzero().flatten().tolist() == list(range(5, 45))


def test_the_recorded_specforge_config_keys_are_all_written(tmp_path):
    ours = json.loads((saved_heads(tmp_path) / "config.json").read_text())
    theirs = json.loads(recorded("specforge", "llama3-8B-eagle3.json"))
    # Token ids, init scale and library versions describe their target and trainer; every other key is written.
    cosmetic = {"bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "transformers_version",
                "use_cache"}
    assert set(theirs) - cosmetic - set(ours) == set()
    assert ours["architectures"] == theirs["architectures"] and ours["num_hidden_layers"] == 1


def test_vllm_reads_our_names_and_top_level_layer_ids_as_layer_inputs(tmp_path):
    eagle3 = recorded("vllm", "llama_eagle3.py")
    runner = recorded("vllm", "gpu_model_runner.py")
    llama = recorded("vllm", "llama.py")
    # load_weights: midlayer.* becomes layers.0.*, d2t draft_id_to_target_id, t2d is skipped, the rest gets "model.".
    assert re.search(r'"midlayer\." in name.*\n.*name\.replace\("midlayer\.", "layers\.0\."\)', eagle3)
    assert '"t2d" in name' in eagle3 and 'name.replace("d2t", "draft_id_to_target_id")' in eagle3
    assert re.search(r'if "lm_head" not in name:\s*\n\s*name = "model\." \+ name', eagle3)
    # The fused layers come from a top-level attribute, used as given ...
    assert 'hasattr(hf_config, "eagle_aux_hidden_state_layer_ids")' in runner
    # ... and a layer id names that layer's input (the state appended before the layer runs).
    assert re.search(r"for idx, layer in enumerate\([^:]*\):\s*\n\s*if idx in self\.aux_hidden_state_layers:\s*\n"
                     r"\s*aux_hidden_states\.append\(hidden_states \+ residual\)\s*\n\s*hidden_states, residual = layer\(",
                     llama)
    data = json.loads((saved_heads(tmp_path) / "config.json").read_text())
    layers = default_layers(6)
    assert data["eagle_aux_hidden_state_layer_ids"] == [layer + 1 for layer in layers]
    assert data["norm_before_residual"] is False and data["draft_vocab_size"] == 50
    names = load_file(str(tmp_path / "heads" / "model.safetensors"))
    assert all(not name.startswith("model.") for name in names)  # vLLM adds the prefix itself


def test_sglang_reads_midlayer_and_nested_layer_ids_as_layer_outputs(tmp_path):
    sglang = recorded("sglang", "llama_eagle3.py")
    assert "self.midlayer = " in sglang and '"t2d" in name' in sglang
    data = json.loads((saved_heads(tmp_path) / "config.json").read_text())
    assert data["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == default_layers(6)
    names = load_file(str(tmp_path / "heads" / "model.safetensors"))
    assert {n.split(".")[0] for n in names} == {"midlayer", "fc", "norm", "lm_head", "d2t", "t2d", "embed_tokens"}


def test_tensorrt_llm_captures_layer_outputs_and_prefixes_names(tmp_path):
    eagle3 = recorded("tensorrt_llm", "eagle3.py")
    modeling = recorded("tensorrt_llm", "modeling_speculative.py")
    assert "self.midlayer = " in modeling and "draft_vocab_size" in modeling
    # The default capture (1, L // 2 - 1, L - 4) is of layer outputs: the same layers as our default.
    assert re.search(r"\(1, self\.num_layers // 2 - 1,\s*self\.num_layers - 4\)", eagle3)
    assert default_layers(32) == [1, 15, 28]

