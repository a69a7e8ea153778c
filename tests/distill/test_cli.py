"""`python -m pipeline train-draft`: the trained draft is a folder the rest of the pipeline takes unchanged."""

from __future__ import annotations

import json

import pytest

from pipeline.cli import main
from pipeline.config import load_config
from tests.conftest import tiny_config_dict, write_config


@pytest.fixture(scope="module")
def trained(tiny_pair, tmp_path_factory):
    folder = tmp_path_factory.mktemp("train-draft")
    config = write_config(folder, tiny_config_dict(tiny_pair, name="distil"))
    out = folder / "distilled"
    argv = ["train-draft", str(config), "--engines-dir", str(folder / "engines"), "--out", str(out),
            "--tokens", "4000", "--new-tokens", "24", "--lr", "1e-3"]
    assert main(argv) == 0
    return folder, config, out, argv


def test_the_draft_folder_is_complete_and_reused(trained, capsys):
    folder, _, out, argv = trained
    report = json.loads((out / "distill.json").read_text())
    evals = report["history"]["evals"]
    assert report["layers_from_target"] == [0] and evals[-1]["acceptance"] > evals[0]["acceptance"]
    assert (out / "manifest.json").is_file() and (out / "model.safetensors").is_file()
    capsys.readouterr()
    assert main(argv) == 0  # same target, prompts and options: nothing to redo
    assert capsys.readouterr().out.count("up to date") == 2


def test_a_config_naming_the_draft_checks_builds_and_stays_lossless(trained, tiny_pair):
    folder, _, out, _ = trained
    config = write_config(folder, tiny_config_dict(tiny_pair, name="with-distilled",
                                                   draft={"model": str(out), "dtype": "float32"}))
    engines = folder / "engines"
    assert main(["check", str(config)]) == 0  # same tokenizer, architecture, limits
    assert main(["build", str(config), "--engines-dir", str(engines)]) == 0
    from pipeline.run_cmd import load_executor

    executor = load_executor(load_config(config), engines)
    prompts = ["def main(", "import os\n", "class Parser:"]
    speculative = executor.generate(prompts, 24)
    plain = executor.generate(prompts, 24, max_draft_len=0)
    assert [r.token_ids for r in speculative] == [r.token_ids for r in plain]
    assert sum(r.stats.accepted_tokens for r in speculative) > 0


def test_a_trtllm_dry_run_builds_the_pair(trained, tiny_pair, capsys):
    folder, _, out, _ = trained
    config = write_config(folder, tiny_config_dict(tiny_pair, name="distilled-trtllm", backend="trtllm",
                                                   draft={"model": str(out), "dtype": "float16"},
                                                   target={"model": str(tiny_pair / "target"), "dtype": "float16"}))
    capsys.readouterr()
    assert main(["build", str(config), "--engines-dir", str(folder / "engines"), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "trtllm-build" in printed and str(out) in printed


def test_a_reduced_vocabulary_16_bit_draft_checks_builds_and_stays_lossless(trained, tiny_pair, capsys):
    """--vocab and --dtype: the ids reach the built engine through convert, `check` says what each backend does with
    them, and the torch executor drafts over them only."""
    from pipeline.draft_vocab import ReducedVocabHead, vocab_ids

    folder, config, _, argv = trained
    out = folder / "distilled-v64"
    assert main(["train-draft", str(config), "--engines-dir", str(folder / "engines"), "--out", str(out),
                 "--tokens", "2000", "--new-tokens", "24", "--vocab", "64", "--dtype", "bfloat16"]) == 0
    assert "dataset up to date" in capsys.readouterr().out  # the data options are unchanged: no new generations
    saved = json.loads((out / "config.json").read_text())
    assert len(saved["draft_vocab"]) == 64 and saved["dtype"] == "bfloat16"
    assert (out / "training.png").stat().st_size > 10_000

    pair = write_config(folder, tiny_config_dict(tiny_pair, name="with-v64", draft={"model": str(out),
                                                                                     "dtype": "float32"}))
    assert main(["check", str(pair)]) == 0
    assert "LM head over 64 of 512 tokens" in capsys.readouterr().out
    engines = folder / "engines"
    assert main(["build", str(pair), "--engines-dir", str(engines)]) == 0
    from pipeline.run_cmd import load_executor

    executor = load_executor(load_config(pair), engines)
    draft = executor.draft.model
    assert isinstance(draft.get_output_embeddings(), ReducedVocabHead) and len(vocab_ids(draft)) == 64
    prompts = ["def main(", "import os\n", "class Parser:"]
    speculative = executor.generate(prompts, 24)
    assert [r.token_ids for r in speculative] == [r.token_ids for r in executor.generate(prompts, 24,
                                                                                       max_draft_len=0)]

    on_trtllm = write_config(folder, tiny_config_dict(tiny_pair, name="v64-trtllm", backend="trtllm",
                                                      draft={"model": str(out), "dtype": "float16"},
                                                      target={"model": str(tiny_pair / "target"),
                                                              "dtype": "float16"}))
    capsys.readouterr()
    main(["check", str(on_trtllm)])
    printed = capsys.readouterr()
    assert "is not used by the trtllm backend" in printed.out + printed.err


def test_bad_values_are_one_line_errors(trained, capsys):
    _, config, _, _ = trained
    assert main(["train-draft", str(config), "--tokens", "0"]) == 2
    assert "--tokens: 0 must be >= 1" in capsys.readouterr().err
    assert main(["train-draft", str(config), "--heads", "0", "--kind", "medusa"]) == 2
    assert "--heads: 0 must be >= 1" in capsys.readouterr().err
    assert main(["train-draft", str(config), "--vocab", "513"]) == 2
    assert "--vocab: 513 is above the target's 512 tokens" in capsys.readouterr().err


def test_the_shipped_distilled_config_trains_its_draft_before_building():
    """`make build-engines CONFIG=configs/smollm2-135m-distilled.yaml` makes the real model, trains, then builds."""
    import subprocess

    from tests.conftest import REPO

    plan = subprocess.run(["make", "-n", "-B", "build-engines", "CONFIG=configs/smollm2-135m-distilled.yaml"],
                          cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines()
    order = [next(i for i, line in enumerate(plan) if marker in line)
             for marker in ("scripts/make_real_model.py", "-m pipeline train-draft", "-m pipeline build")]
    assert order == sorted(order)
    assert load_config(REPO / "configs" / "smollm2-135m-distilled.yaml").draft.model.endswith(
        "smollm2-135m-distilled-draft")
