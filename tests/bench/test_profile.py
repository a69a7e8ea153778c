"""`python -m pipeline profile` (pipeline/bench/profile.py): measured acceptance and cost ratio -> a recommended draft
and K, no engines, overall and per set label; prompts files with chats."""

from __future__ import annotations

import json
import re

import pytest

from pipeline.cli import main
from tests.conftest import tiny_config_dict, write_config


def _foreign_model(folder):
    """A tiny model whose tokenizer was trained on other text: a draft the target cannot use."""
    from transformers import LlamaForCausalLM

    from pipeline.tinymodels import TinyModelShape, llama_config, train_tokenizer

    texts = ["the quick brown fox jumps over the lazy dog " * 20, "lorem ipsum dolor sit amet " * 20]
    tokenizer = train_tokenizer(texts, 300)
    model = LlamaForCausalLM(llama_config(TinyModelShape(32, 1, 2, 1, 64), tokenizer, 256))
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def test_profile_recommends_k_in_range_and_reports_incompatible_drafts(tiny_pair, tmp_path, capsys):
    config = write_config(tmp_path, tiny_config_dict(tiny_pair, name="profile-test"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\\n    return\nclass Stack:\\n    def push(self, item):\n")
    foreign = _foreign_model(tmp_path / "foreign")
    missing = tmp_path / "no-such-model"
    assert main(["profile", str(config), "--prompts", str(prompts), "--draft", str(tiny_pair / "draft"),
                 "--draft", str(foreign), "--draft", str(missing), "--k-max", "3", "--max-new-tokens", "8",
                 "--json"]) == 0
    out = capsys.readouterr().out
    profiles = json.loads(out[out.index("\n[\n") + 1:])
    ok, hybrid, bad, gone, lookup, suffix = profiles
    assert [p["method"] for p in profiles] == ["draft_model", "ngram+draft", "draft_model", "draft_model", "ngram",
                                               "suffix"]
    assert suffix["status"] == "ok" and suffix["cost_ratio_c"] == 0.0 and 1 <= suffix["best_k"] <= 3
    assert ok["status"] == "ok" and 1 <= ok["best_k"] <= 3
    assert len(ok["acceptance_by_position"]) == 3 and len(ok["expected_speedup"]) == 3
    assert ok["best_speedup"] == max(ok["expected_speedup"])
    # the expected speedup is exactly the measured terms put together
    survival, c, verify = ok["acceptance_by_position"], ok["cost_ratio_c"], ok["verify_cost_ratio"]
    for k in (1, 2, 3):
        assert abs(ok["expected_speedup"][k - 1] - (1 + sum(survival[:k])) / (k * c + verify[k - 1])) < 1e-9
    assert bad["status"] == "incompatible" and "tokenizer" in bad["reason"]
    assert gone["status"] == "unavailable"
    assert "incompatible" in out.split("\n[\n")[0]
    assert "recommend:" in out and f"K={ok['best_k']} maximises" in out
    # lookups: no model cost, acceptance per target step, the same speedup formula with c = 0
    assert lookup["status"] == "ok" and lookup["cost_ratio_c"] == 0.0 and 1 <= lookup["best_k"] <= 3
    for k in (1, 2, 3):
        expected = (1 + sum(lookup["acceptance_by_position"][:k])) / lookup["verify_cost_ratio"][k - 1]
        assert abs(lookup["expected_speedup"][k - 1] - expected) < 1e-9
    # the hybrid ran at K = k_max with the draft's cost terms
    assert hybrid["draft"] == f"ngram+{tiny_pair / 'draft'}" and hybrid["best_k"] == 3
    assert 0.0 <= hybrid["draft_step_share"] <= 1.0 and hybrid["best_speedup"] > 0


def test_profile_defaults_to_the_configs_draft(tiny_config, tmp_path, capsys):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["import os\nimport sys\n"]))
    assert main(["profile", str(tiny_config), "--prompts", str(prompts), "--k-max", "2",
                 "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "best K" in out and "recommend:" in out


def test_profile_rejects_bad_options(tiny_config, tmp_path, capsys):
    assert main(["profile", str(tiny_config), "--prompts", str(tmp_path / "none.txt")]) == 2
    assert "--prompts:" in capsys.readouterr().err
    assert main(["profile", str(tiny_config), "--prompts", str(tmp_path / "none.txt"), "--k-max", "4",
                 "--max-new-tokens", "4"]) == 2
    assert "--max-new-tokens: 4 must exceed --k-max 4" in capsys.readouterr().err


def test_recommendation_names_the_method():
    from pipeline.bench.profile import DraftProfile, recommendation

    draft = DraftProfile("d", "ok", best_k=4, best_speedup=1.6)
    lookup = DraftProfile("ngram", "ok", best_k=3, best_speedup=1.9, method="ngram")
    hybrid = DraftProfile("ngram+d", "ok", best_k=4, best_speedup=2.1, method="ngram+draft")
    assert recommendation([draft, lookup]) .startswith("recommend: speculative.method: ngram with speculative"
                                                       ".max_draft_len: 3, no draft model")
    assert "method: ngram+draft with draft d and speculative.max_draft_len: 4" in recommendation(
        [draft, lookup, hybrid])
    assert "method: draft_model with draft d" in recommendation([draft])
    trees = DraftProfile("suffix", "ok", best_k=5, best_speedup=2.3, method="suffix")
    assert recommendation([draft, lookup, hybrid, trees]).startswith(
        "recommend: speculative.method: suffix with speculative.max_draft_len: 5, no draft model")
    heads = DraftProfile("eagle3:models/h", "ok", best_k=3, best_speedup=2.6, method="eagle3")
    assert recommendation([draft, lookup, hybrid, trees, heads]).startswith(
        "recommend: speculative.method: eagle3 with eagle3: {model: models/h} and speculative.max_draft_len: 3")
    slow = DraftProfile("ngram", "ok", best_k=1, best_speedup=0.9, method="ngram")
    assert "serve the target alone" in recommendation([slow])


USER = "def add(a, b):"


def test_profile_reads_chats(chat_engines, tmp_path, capsys):
    config, _ = chat_engines
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": USER}]}) + "\n"
                       + json.dumps({"text": "import os\nimport sys\n"}) + "\n")
    assert main(["profile", str(config), "--prompts", str(prompts), "--k-max", "2", "--max-new-tokens", "6",
                 "--no-ngram"]) == 0
    assert "recommend:" in capsys.readouterr().out


def test_each_candidate_runs_in_the_dtype_a_build_would_give_it(tiny_pair, tmp_path):
    """A 16-bit candidate (train-draft --dtype bfloat16) is measured in 16 bits where this CPU runs that natively,
    as `dtype: auto` would build it; the config's own draft in the config's dtype."""
    import shutil

    from pipeline.bench.profile import _draft_dtype
    from pipeline.config import load_config
    from pipeline.dtypes import cpu_runs_natively

    config = load_config(write_config(tmp_path, tiny_config_dict(tiny_pair, name="dtypes")))
    own = config.draft.model
    assert _draft_dtype(own, tiny_pair / "draft", config, "cpu") == "float32"
    sixteen = shutil.copytree(tiny_pair / "draft", tmp_path / "bf16")
    saved = json.loads((sixteen / "config.json").read_text())
    (sixteen / "config.json").write_text(json.dumps({**saved, "dtype": "bfloat16"}))
    assert _draft_dtype(str(sixteen), sixteen, config, "cpu") == \
        ("bfloat16" if cpu_runs_natively("bfloat16") else "float32")
    assert _draft_dtype(str(sixteen), sixteen, config, "cuda") in ("bfloat16", "float16")
    assert _draft_dtype("missing", None, config, "cpu") is None


def test_profile_recommends_per_set_label_as_well_as_overall(tiny_config, tmp_path, capsys):
    """Labelled prompts are not pooled into one answer: each set gets its own recommendation and figures, from the
    same generations, costed with the candidate's one measured c and verify cost."""
    prompts = tmp_path / "labelled.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in [
        {"text": "def add(a, b):", "set": "code"}, {"text": "import os\nimport sys\n", "set": "code"},
        {"text": "class Stack:\n    def push(self, item):", "set": "classes"}]))
    assert main(["profile", str(tiny_config), "--prompts", str(prompts), "--k-max", "2", "--max-new-tokens", "6",
                 "--json"]) == 0
    out = capsys.readouterr().out
    text, profiles = out[:out.index("\n[\n")], json.loads(out[out.index("\n[\n") + 1:])
    assert "recommend over all prompts:" in text
    assert re.search(r"^recommend for set code \(2 prompts\): ", text, re.M)
    assert re.search(r"^recommend for set classes \(1 prompts\): ", text, re.M)
    assert re.search(r"^best K per set +code +classes *$", text, re.M)
    for p in (p for p in profiles if p["method"] in ("draft_model", "ngram")):
        assert {name: figures["prompts"] for name, figures in p["per_set"].items()} == {"code": 2, "classes": 1}
        c, verify = p["cost_ratio_c"], p["verify_cost_ratio"]
        for figures in p["per_set"].values():
            survival = figures["acceptance_by_position"]
            for k in (1, 2):
                assert figures["expected_speedup"][k - 1] == pytest.approx((1 + sum(survival[:k])) /
                                                                           (k * c + verify[k - 1]))
            assert figures["best_speedup"] == max(figures["expected_speedup"])
