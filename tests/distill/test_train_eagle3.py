"""pipeline/distill/train_eagle3.py and `train-draft --kind eagle3` on the tiny pair: the heads learn the target's
distribution at every draft position, resume exactly, and land in vLLM's Eagle3 layout."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.cli import main
from pipeline.distill.dataset import generate_dataset, text_prompts
from pipeline.distill import train_eagle3 as train_module
from pipeline.distill.train import padded_batch
from pipeline.distill.train_eagle3 import (Eagle3Options, draft_vocab, fused_states, target_states, train_eagle3,
                                           ttt_steps)
from pipeline.eagle3_heads import Eagle3Heads, default_layers
from pipeline.executor import SpeculativeExecutor
from pipeline.tinymodels import read_text, split_files, stdlib_files
from tests.conftest import load_tiny_models, run_cli, tiny_config_dict, write_config


@pytest.fixture(scope="module")
def setup(deep_pair):
    target, _, tokenizer = load_tiny_models(deep_pair)
    _, held = split_files(stdlib_files(), 0)
    prompts = text_prompts(tokenizer, read_text(held, 100_000), 24, 24, seed=0)
    return target, tokenizer, generate_dataset(target, tokenizer, prompts, 32, top_k=16, seed=0)


def heads_for(target, data, options):
    """Heads moved far off their start: the tiny target's next tokens are predictable enough that the start (the
    target's own last layer and head) already ranks them well, and learning would not show."""
    layers = default_layers(target.config.num_hidden_layers)
    heads = Eagle3Heads.for_target(target, layers, draft_vocab(data, options.vocab, target.config.vocab_size, options))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.5)
    return heads


def test_heads_learn_the_targets_distribution_at_every_draft_position(setup):
    target, tokenizer, data = setup
    options = Eagle3Options(tokens=4000, ttt_steps=3, lr=1e-2, vocab=200)
    heads = heads_for(target, data, options)
    history = train_eagle3(heads, target, data, options)
    first, last = history["evals"][0], history["evals"][-1]
    assert last["loss"] < first["loss"]
    for j in range(3):  # every draft position beats its start, the later ones drafting on the heads' own outputs
        assert last["by_position"][j]["acceptance"] > first["by_position"][j]["acceptance"] + 0.1
    assert 0 < last["coverage"] <= 1 and last["accepted_per_step"] > first["accepted_per_step"]
    assert all(not p.requires_grad for p in target.parameters())  # the target stays frozen
    # Trained heads draft for real: greedy output unchanged, and drafts accepted.
    prompts = [tokenizer.decode(data.sequence(s)[0][:24].tolist()) for s in range(4)]
    plain = SpeculativeExecutor(target, None, tokenizer, max_draft_len=0, method="ngram").generate(prompts, 24)
    results = SpeculativeExecutor(target, None, tokenizer, max_draft_len=3, method="eagle3",
                                  eagle3=heads).generate(prompts, 24)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    assert sum(r.stats.by_proposer["eagle3"][1] for r in results) > 0


def test_resume_continues_exactly(setup, tmp_path):
    target, _, data = setup
    options = Eagle3Options(tokens=1500, ttt_steps=2, checkpoint_every=1, vocab=100)
    whole = heads_for(target, data, options)
    train_eagle3(whole, target, data, options)
    first = train_eagle3(heads_for(target, data, options), target, data, options, state_dir=tmp_path, stop_after=2)
    assert not first["finished"]
    resumed = heads_for(target, data, options)
    assert train_eagle3(resumed, target, data, options, state_dir=tmp_path, resume=True)["finished"]
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


@torch.no_grad()
def test_the_steps_from_a_later_position_are_the_tail_of_the_whole_sequences(setup):
    """Training skips the queries of the positions nothing is taught at; the earlier positions must still give the
    first step's keys (slicing them too, or a position or token shifted by the slice, changes the tail)."""
    target, _, data = setup
    options = Eagle3Options(tokens=100, vocab=200)
    heads = heads_for(target, data, options)
    input_ids, mask, _ = padded_batch(data, [0, 1, 2], "cpu")
    states = target_states(target, heads.config.target_layers, input_ids, mask)
    whole = list(ttt_steps(heads, input_ids, states, 3))
    for first in (1, 17):
        for j, part in enumerate(ttt_steps(heads, input_ids, states, 3, first)):
            torch.testing.assert_close(part, whole[j][:, first:])


def test_the_loss_skipping_untaught_positions_is_the_loss_over_all(setup, monkeypatch):
    target, _, data = setup
    options = Eagle3Options(tokens=100, vocab=200)
    heads = heads_for(target, data, options)
    cache = fused_states(target, heads.config.target_layers, data)
    chosen = [0, 3, 5]
    starts = [data.sequence(s)[1] for s in chosen]
    assert train_module._first_trained(starts, 3) > 0  # the tiny prompts leave positions to skip
    loss, per_step, positions = train_module._ttt_terms(heads, cache, chosen, 3, "cpu")
    monkeypatch.setattr(train_module, "_first_trained", lambda starts, steps: 0)
    every, every_step, every_positions = train_module._ttt_terms(heads, cache, chosen, 3, "cpu")
    torch.testing.assert_close(loss, every)
    assert positions == every_positions
    for got, want in zip(per_step, every_step):
        assert got[3] == want[3] and got[0] == want[0]
        assert got[1] == pytest.approx(want[1], rel=1e-5) and got[2] == pytest.approx(want[2], rel=1e-5)


def test_train_draft_kind_eagle3_writes_heads_a_config_builds_and_serves(deep_pair, tmp_path, capsys):
    out = tmp_path / "heads"
    data = tiny_config_dict(deep_pair, name="eagle3")
    data["speculative"] = {"method": "eagle3", "max_draft_len": 3, "eagle3": {"model": str(out)}}
    config = write_config(tmp_path, data)
    engines = tmp_path / "engines"
    assert main(["train-draft", str(config), "--engines-dir", str(engines), "--kind", "eagle3", "--layers", "3,0,1",
                 "--tokens", "1500", "--new-tokens", "16", "--num-prompts", "16", "--vocab", "300"]) == 0
    printed = capsys.readouterr().out
    assert "eagle3 heads built" in printed and "target layers [0, 1, 3]" in printed
    saved = json.loads((out / "config.json").read_text())
    assert saved["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]  # vLLM counts a layer's input
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]  # SGLang adds 1 itself
    assert saved["draft_vocab_size"] == 300 and (out / "training.png").is_file()
    assert main(["build", str(config), "--engines-dir", str(engines)]) == 0
    from pipeline.executor import open_executor

    ex = open_executor(engines / "eagle3")
    assert ex.method == "eagle3" and ex.has_eagle3_heads
    result = ex.generate(["def f(x):\n    return"], 12)[0]
    plain = ex.generate(["def f(x):\n    return"], 12, method="ngram", max_draft_len=0)[0]
    assert result.token_ids == plain.token_ids


def test_bad_layers_are_one_line_errors(deep_pair, tmp_path):
    config = write_config(tmp_path, tiny_config_dict(deep_pair, name="bad"))
    for args, message in ((["--kind", "eagle3", "--layers", "0,1,9"], "--layers: [0, 1, 9] must be 3 distinct target layers"),
                          (["--kind", "eagle3", "--layers", "0,1"], "--layers: [0, 1] must be 3 distinct target layers"),
                          (["--kind", "eagle3", "--layers", "a"], "is not comma-separated layer ids"),
                          (["--kind", "medusa", "--ttt-steps", "2"], "--ttt-steps: applies to --kind eagle3 only")):
        result = run_cli("train-draft", str(config), "--engines-dir", str(tmp_path / "e"), *args)
        assert result.returncode != 0 and message in result.stderr, result.stderr


def test_check_reads_the_heads_and_refuses_heads_for_another_target(deep_pair, tiny_pair, tmp_path):
    from tests.executor.test_eagle3_proposer import small_llama

    target, _, _ = load_tiny_models(deep_pair)
    Eagle3Heads.for_target(target, default_layers(target.config.num_hidden_layers), None).save(tmp_path / "ok")
    Eagle3Heads.for_target(small_llama(), default_layers(6), None).save(tmp_path / "other")
    for heads, expected in (("ok", "speculative.eagle3: heads over target layers [0, 1, 2], 512 draft tokens"),
                            ("other", "was trained for hidden_size 32, the target has 96"),
                            ("missing", "train heads with `python -m pipeline train-draft CONFIG --kind eagle3`")):
        data = tiny_config_dict(deep_pair, name=f"check-{heads}")
        data["speculative"] = {"method": "eagle3", "eagle3": {"model": str(tmp_path / heads)}}
        data.pop("draft")
        (tmp_path / f"config-{heads}").mkdir()
        result = run_cli("check", str(write_config(tmp_path / f"config-{heads}", data)))
        assert expected in result.stdout + result.stderr, result.stdout + result.stderr
        assert (result.returncode == 0) == (heads == "ok")
