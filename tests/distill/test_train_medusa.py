"""pipeline/distill/train_medusa.py and `train-draft --kind medusa` on the tiny pair: heads learn the target's
distribution further ahead, resume exactly, and land in the converter's layout."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.cli import main
from pipeline.distill.dataset import generate_dataset, text_prompts
from pipeline.distill.train_medusa import MedusaOptions, train_medusa
from pipeline.medusa_heads import MedusaHeads
from pipeline.tinymodels import read_text, split_files, stdlib_files
from tests.conftest import load_tiny_models, tiny_config_dict, write_config


@pytest.fixture(scope="module")
def setup(tiny_pair):
    target, _, tokenizer = load_tiny_models(tiny_pair)
    _, held = split_files(stdlib_files(), 0)
    prompts = text_prompts(tokenizer, read_text(held, 100_000), 24, 24, seed=0)
    return target, generate_dataset(target, tokenizer, prompts, 32, top_k=16, seed=0)


def test_heads_learn_the_targets_distribution_further_ahead(setup):
    target, data = setup
    heads = MedusaHeads.from_target(target, num_heads=2, num_layers=1)
    history = train_medusa(heads, target, data, MedusaOptions(tokens=4000, heads=2, lr=3e-3))
    first, last = history["evals"][0], history["evals"][-1]
    assert last["loss"] < first["loss"]
    for h in range(2):  # every head beats its start: the target's own head, which predicts one token ahead
        assert last["by_head"][h]["acceptance"] > first["by_head"][h]["acceptance"]
    assert all(not p.requires_grad for p in target.parameters())  # the target stays frozen


def test_resume_continues_exactly(setup, tmp_path):
    target, data = setup
    options = MedusaOptions(tokens=1500, heads=2, checkpoint_every=1)
    whole = MedusaHeads.from_target(target, 2, 1)
    train_medusa(whole, target, data, options)
    first = train_medusa(MedusaHeads.from_target(target, 2, 1), target, data, options, state_dir=tmp_path,
                         stop_after=2)
    assert not first["finished"]
    resumed = MedusaHeads.from_target(target, 2, 1)
    assert train_medusa(resumed, target, data, options, state_dir=tmp_path, resume=True)["finished"]
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


def test_train_draft_kind_medusa_writes_the_heads(tiny_pair, tmp_path, capsys):
    config = write_config(tmp_path, tiny_config_dict(tiny_pair, name="medusa"))
    out = tmp_path / "heads"
    assert main(["train-draft", str(config), "--engines-dir", str(tmp_path / "engines"), "--kind", "medusa",
                 "--heads", "3", "--out", str(out), "--tokens", "1500", "--new-tokens", "16",
                 "--num-prompts", "16"]) == 0
    assert "medusa heads built" in capsys.readouterr().out
    saved = json.loads((out / "config.json").read_text())
    assert (saved["medusa_num_heads"], saved["medusa_num_layers"]) == (3, 1)
    report = json.loads((out / "distill.json").read_text())
    assert len(report["history"]["evals"][-1]["by_head"]) == 3 and (out / "training.png").is_file()
    heads = MedusaHeads.load(out)
    assert heads.num_heads == 3 and (out / "manifest.json").is_file()
    assert main(["train-draft", str(config), "--kind", "medusa", "--layers", "2"]) == 2
    assert "--layers: applies to --kind model and eagle3" in capsys.readouterr().err


def test_a_medusa_config_trains_builds_and_runs(tiny_pair, tmp_path, capsys):
    """The documented flow: train-draft --kind medusa on a medusa config (heads, layers and folder from the
    config; --vocab), build (the heads travel with the target's engine), then the engines decode with Medusa,
    token for token the target's greedy output."""
    from pipeline.executor import SpeculativeExecutor
    from pipeline.medusa_heads import VOCAB_KEY

    data = tiny_config_dict(tiny_pair, name="medusa-flow", speculative={
        "method": "medusa", "medusa": {"model": str(tmp_path / "heads"), "heads": 2, "layers": 1,
                                       "choices": [[0], [1], [0, 0], [1, 0]]}})
    data.pop("draft")
    config = write_config(tmp_path, data)
    engines = tmp_path / "engines"
    assert main(["train-draft", str(config), "--engines-dir", str(engines), "--kind", "medusa", "--vocab", "40",
                 "--tokens", "1500", "--new-tokens", "16", "--num-prompts", "16"]) == 0
    saved = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert (saved["medusa_num_heads"], len(saved[VOCAB_KEY])) == (2, 40)
    assert main(["build", str(config), "--engines-dir", str(engines)]) == 0
    capsys.readouterr()
    assert (engines / "medusa-flow" / "target" / "build" / "medusa" / "medusa_lm_head.safetensors").is_file()
    assert not (engines / "medusa-flow" / "draft").exists()
    executor = SpeculativeExecutor.from_engines(engines / "medusa-flow")
    assert executor.method == "medusa" and executor.max_draft_len == 2
    prompts = ["def f(x):\n    return", "import os\n"]
    plain = executor.generate(prompts, 24, max_draft_len=0)
    medusa = executor.generate(prompts, 24)
    assert [r.token_ids for r in medusa] == [r.token_ids for r in plain]
    assert sum(r.stats.draft_tokens for r in medusa) > 0
    heads = executor.engine.proposers["medusa"].heads
    proposed = heads.top_tokens(torch.zeros(1, heads.hidden_size), [3, 3])
    assert all(set(ids[0].tolist()) <= set(saved[VOCAB_KEY]) for ids in proposed)  # only the trained tokens
    # The tree is part of the engine: editing it rebuilds the target; the heads are kept in the build folder.
    data["speculative"]["medusa"]["choices"] = [[0], [0, 0]]
    config = write_config(tmp_path, data)
    assert main(["build", str(config), "--engines-dir", str(engines)]) == 0
    assert "build    target  built" in capsys.readouterr().out
