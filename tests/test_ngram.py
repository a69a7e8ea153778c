"""N-gram (prompt-lookup) proposals: exact lookups, lossless greedy and sampled output, per-proposer statistics."""

from __future__ import annotations

import pytest
import torch

from conftest import load_tiny_models, tiny_vocab_model

from pipeline.executor import SpeculativeExecutor
from pipeline.methods import Method, NgramSettings
from pipeline.speculative.ngram import one_hot_probs, propose_ngram


@pytest.mark.parametrize("tokens, k, kw, expected", [
    ([1, 2, 3, 4, 9, 1, 2, 3], 3, {}, [4, 9, 1]),  # longest suffix [1,2,3] recurs
    ([1, 2, 3, 4, 9, 2, 3], 3, {"max_match": 2}, [4, 9, 2]),
    ([5, 6, 7], 2, {}, []),  # nothing recurs
    ([1, 2, 1, 3, 1], 2, {"min_match": 2}, []),  # only a 1-token match, below min_match
    ([1, 2, 1, 3, 1], 2, {}, [3, 1]),  # most recent 1-token match wins
    ([7, 8, 1, 9, 9, 7, 8, 1, 5, 7, 8], 4, {}, [1, 5, 7, 8]),  # most recent of two equal-length matches
    ([7, 8, 1, 9, 9, 7, 8, 1, 5, 8], 4, {}, [1, 9, 9, 7]),  # equal matches: a full-length proposal beats a recent
    # one that runs into the end of the sequence
    ([5, 1, 2, 9, 1, 2], 3, {}, [9, 1, 2]),  # the only match's proposal may itself reach the end
    ([3, 3, 3], 0, {}, []),
])
def test_lookup(tokens, k, kw, expected):
    assert propose_ngram(tokens, k, **kw) == expected


def test_one_hot_probs():
    probs = one_hot_probs([2, 0], 4)
    assert probs.tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return load_tiny_models(tiny_pair)


REPEATING = ["x = compute(a, b)\ny = compute(a, b)\nz = compute(", "def f(self):\n    return self.value\n"
             "def g(self):\n    return self.", "import os\nimport sys\nimport "]


def hf_greedy(model, ids, n):
    x = torch.tensor([ids])
    return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)[0, len(ids):].tolist()


@pytest.mark.parametrize("method", ["ngram", "ngram+draft"])
def test_greedy_output_is_the_target_greedy_output(pair, method):
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, None if method == "ngram" else draft, tok, max_draft_len=4, method=method)
    results = ex.generate(REPEATING, 40)
    for prompt, result in zip(REPEATING, results):
        assert result.token_ids == hf_greedy(target, tok(prompt)["input_ids"], 40)
        s = result.stats
        assert s.generated_tokens == 40 == s.accepted_tokens + s.target_steps
        for name, (drafted, accepted, steps) in s.by_proposer.items():
            assert name in ("ngram", "draft_model") and 0 <= accepted <= drafted and steps >= 1
        assert sum(d for d, _, _ in s.by_proposer.values()) == s.draft_tokens
    total = results[0].stats.merge(results[1].stats).merge(results[2].stats)
    assert total.by_proposer["ngram"][1] > 0  # lookups were proposed and accepted
    if method == "ngram":
        assert set(total.by_proposer) == {"ngram"}


def test_adaptive_k_governs_lookup_rows(pair, monkeypatch):
    """Serving's adaptive K must cap n-gram rows too: a free proposal still widens the verify, and at a large batch
    that costs more than the lookups save (bench-serve measured 0.71x target-only before the cap applied)."""
    target, _, tok = pair
    ex = SpeculativeExecutor(target, None, tok, max_draft_len=4, method="ngram", adaptive_draft_len=True,
                             max_batch_size=4)
    seen = []

    def never_pays(rates, limits, uses_model=None):
        seen.append(list(uses_model))
        return 0

    monkeypatch.setattr(ex.engine.policy, "choose", never_pays)
    capped = ex.generate(REPEATING, 24)
    assert seen and all(flags == [False] * len(flags) for flags in seen)  # lookup rows run no draft forward
    assert sum(r.stats.draft_tokens for r in capped) == 0
    named = ex.run([ex.new_request(tok(REPEATING[0])["input_ids"], 24, max_draft_len=4)])[0]
    assert named.stats.draft_tokens > 0  # a request that named its K is never capped
    assert named.token_ids == capped[0].token_ids


def test_hybrid_choice_follows_each_proposers_record_and_cost(pair):
    from pipeline.executor.step_batch import StepBatch

    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=4, method="ngram+draft")
    hybrid = ex.engine.proposers[Method.NGRAM_DRAFT]

    def route(request, cost_ratio=0.3, proposers=ex.engine.proposers):
        batch = StepBatch([request])
        batch.k = [4]
        hybrid.cost_ratio = lambda: cost_ratio
        chosen = proposers[request.method].route(batch, 0)
        return (chosen.method if chosen else None), batch.lookups.get(0)

    repeats = ex.new_request([5, 6, 7, 8, 5, 6, 7], 10)
    assert route(repeats) == (Method.NGRAM, [8, 5, 6, 7])  # no history: lookup
    for _ in range(10):  # lookups always rejected, the draft model always accepted
        repeats.advance([], 4, 0, proposer=Method.NGRAM)
        repeats.advance([], 4, 4, proposer=Method.DRAFT_MODEL)
        repeats.finish_reason = None
    assert route(repeats)[0] == Method.DRAFT_MODEL
    assert route(repeats, cost_ratio=3.0)[0] == Method.NGRAM  # a draft that costs more than it saves
    assert route(ex.new_request([5, 6, 7, 8], 10)) == (Method.DRAFT_MODEL, [])  # no match
    only_lookup = SpeculativeExecutor(target, None, tok, method="ngram")
    assert route(only_lookup.new_request([5, 6, 7, 8], 10), proposers=only_lookup.engine.proposers)[0] is None


def test_one_lookup_per_row_per_step_under_adaptive_k(pair, monkeypatch):
    """The K policy asks what a lookup row can propose, then the row proposes: both from one lookup."""
    from pipeline.executor.proposers import ngram as ngram_proposer

    target, draft, tok = pair
    calls = []

    def counted(tokens, k, *args):
        calls.append(len(tokens))
        return propose_ngram(tokens, k, *args)

    monkeypatch.setattr(ngram_proposer, "propose_ngram", counted)
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=4, method="ngram+draft", adaptive_draft_len=True,
                             max_batch_size=4)
    results = ex.generate(REPEATING[:3], 24)
    steps = sum(r.stats.target_steps for r in results)
    assert calls and len(calls) <= steps  # at most one per row per step (none on a plain step)


def test_ngram_needs_no_draft_and_draft_model_needs_one(pair):
    target, _, tok = pair
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeExecutor(target, None, tok, method="draft_model")
    with pytest.raises(ValueError, match="method"):
        SpeculativeExecutor(target, None, tok, method="lookup")
    ex = SpeculativeExecutor(target, None, tok, max_draft_len=3, method="ngram")
    assert ex.method == "ngram" and ex.engine.draft is None


@pytest.mark.parametrize("method, temperature, top_k", [("ngram", 0.8, 0), ("ngram+draft", 1.3, 4)])
def test_sampled_output_follows_the_target_distribution(method, temperature, top_k):
    """Lookups are one-hot proposals; the first two sampled tokens must still follow the target's exact joint
    (TV < 0.07 at 3000 samples) and lookups must really have been proposed (the prompt repeats)."""
    target, draft = tiny_vocab_model(1), tiny_vocab_model(2)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]

    def probs(ids):
        logits = target(torch.tensor([ids])).logits[0, -1].float() / temperature
        if top_k:
            logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
        return torch.softmax(logits, -1)

    with torch.no_grad():
        first = probs(prompt)
        exact = torch.stack([first[a] * probs(prompt + [a]) for a in range(6)]).flatten()
    ex = SpeculativeExecutor(target, draft if method != "ngram" else None, None, max_draft_len=3, method=method,
                             max_batch_size=32)
    n = 3000
    results = ex.generate([prompt] * n, 2, temperature=temperature, top_k=top_k, seed=list(range(n)))
    pairs = torch.tensor([r.token_ids[0] * 6 + r.token_ids[1] for r in results])
    tv = 0.5 * (torch.bincount(pairs, minlength=36).float() / n - exact).abs().sum().item()
    assert tv < 0.07, tv
    looked_up = sum(r.stats.by_proposer.get("ngram", [0, 0, 0])[0] for r in results)
    kept = sum(r.stats.by_proposer.get("ngram", [0, 0, 0])[1] for r in results)
    assert 0 < kept < looked_up


def test_ngram_settings_are_used(pair):
    target, _, tok = pair
    strict = SpeculativeExecutor(target, None, tok, max_draft_len=4, method="ngram",
                                 ngram=NgramSettings(min_match=3, max_match=3))
    loose = SpeculativeExecutor(target, None, tok, max_draft_len=4, method="ngram")
    a = strict.generate(REPEATING, 30)
    b = loose.generate(REPEATING, 30)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert sum(r.stats.draft_tokens for r in a) < sum(r.stats.draft_tokens for r in b)


# ---- config, stages, serving ---------------------------------------------------------------------------------------

def test_config_method_rules(tiny_pair):
    from conftest import tiny_config_dict

    from pipeline.config import parse_config
    from pipeline.errors import ConfigError

    data = tiny_config_dict(tiny_pair)
    del data["draft"]
    with pytest.raises(ConfigError, match="draft: required for speculative.method 'draft_model'.*method: ngram"):
        parse_config(data)
    with pytest.raises(ConfigError, match="'ngram\\+draft'"):
        parse_config({**data, "speculative": {"method": "ngram+draft"}})
    config = parse_config({**data, "speculative": {"method": "ngram", "ngram": {"min_match": 2, "max_match": 3}}})
    assert config.roles == ("target",) and config.speculative.ngram.min_match == 2
    with pytest.raises(ConfigError, match="speculative.ngram.min_match: 5 is above max_match"):
        parse_config({**data, "speculative": {"method": "ngram", "ngram": {"min_match": 5}}})
    with pytest.raises(ConfigError, match="speculative.method"):
        parse_config({**data, "speculative": {"method": "lookahead"}})


def test_ngram_config_builds_only_the_target_and_swapping_method_rebuilds_nothing(tiny_pair, tmp_path, capsys):
    from conftest import tiny_config_dict, write_config

    from pipeline.cli import main
    from pipeline.config import load_config
    from pipeline.run_cmd import load_executor

    data = tiny_config_dict(tiny_pair, name="lookup")
    draft = data.pop("draft")
    path = write_config(tmp_path, {**data, "speculative": {"method": "ngram", "max_draft_len": 4}})
    engines = tmp_path / "engines"
    assert main(["build", str(path), "--engines-dir", str(engines)]) == 0
    assert (engines / "lookup" / "target" / "build").is_dir() and not (engines / "lookup" / "draft").exists()
    executor = load_executor(load_config(path), engines)
    (result,) = executor.generate(REPEATING[:1], 16)
    assert set(result.stats.by_proposer) <= {"ngram"} and executor.engine.draft is None
    built = SpeculativeExecutor.from_engines(engines / "lookup")  # the folder records its method: none to repeat
    assert built.method == "ngram" and built.engine.draft is None

    # method: ngram+draft with the draft added: the target is up to date, only the draft is converted and built
    path = write_config(tmp_path, {**data, "draft": draft, "speculative": {"method": "ngram+draft", "max_draft_len": 4}})
    capsys.readouterr()
    assert main(["build", str(path), "--engines-dir", str(engines)]) == 0
    out = capsys.readouterr().out
    assert out.count("up to date") == 2 and out.count("built") >= 2, out  # target convert+build kept
    hybrid = load_executor(load_config(path), engines)
    assert hybrid.method == "ngram+draft" and hybrid.engine.draft is not None

    # and back to draft_model: nothing to rebuild at all
    path = write_config(tmp_path, {**data, "draft": draft, "speculative": {"method": "draft_model", "max_draft_len": 4}})
    capsys.readouterr()
    assert main(["build", str(path), "--engines-dir", str(engines)]) == 0
    assert capsys.readouterr().out.count("up to date") == 4


def test_deploy_passes_the_method_to_the_served_engine(tiny_pair, tmp_path):
    from conftest import tiny_config_dict

    from pipeline.config import parse_config
    from pipeline.triton import torch_repo

    data = tiny_config_dict(tiny_pair)
    config = parse_config({**data, "speculative": {"method": "ngram+draft", "ngram": {"max_match": 3}}})
    model = torch_repo.model_config(config, "speculative_stream", True, tmp_path)
    params = {k: v.string_value for k, v in model.parameters.items()}
    assert params["method"] == "ngram+draft" and params["ngram_max_match"] == "3"


def test_trtllm_deploy_says_how_ngram_is_served(tmp_path, capsys):
    import yaml

    from pipeline.cli import main

    data = yaml.safe_load(open("configs/llama3.1-8b_llama3.2-1b.yaml"))
    data["speculative"]["method"] = "ngram+draft"
    path = tmp_path / "hybrid.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["deploy", str(path), "--engines-dir", str(tmp_path / "engines")]) == 0
    assert "n-gram proposals on TensorRT-LLM run through the Python executor" in capsys.readouterr().out
    data["speculative"]["method"] = "ngram"
    data.pop("draft")
    path.write_text(yaml.safe_dump(data))
    assert main(["deploy", str(path), "--engines-dir", str(tmp_path / "engines")]) == 2
    assert "cannot be served by the tensorrtllm_backend layout" in capsys.readouterr().err
