"""`python -m pipeline bench` (pipeline/bench/cli.py) end to end on the tiny pair: results.json fields, consistent
values, the repeats' spread, the time estimate printed before the timed part, the PNG; `--prompts` files whose labels
make the sets, chats included (tests/chat_helpers.py).

Token counts are tiny so each run takes seconds; timing values are never compared with thresholds.
"""

from __future__ import annotations

import json
import re

import pytest

from pipeline.executor import attention_choice, matmul_choice, row_kernels
from pipeline.cli import main
from pipeline.speculative.analytic import speedup_bound
from pipeline.speculative.tree import TokenTree
from tests.conftest import load_tiny_models, tiny_config_dict, write_config

FIELDS = {"method", "k", "tokens_per_s", "speedup_vs_target", "acceptance_rate", "mean_accepted_len",
          "cost_ratio_c", "bound_speedup", "efficiency", "itl_ms_p50", "itl_ms_p90", "ttft_ms",
          "verify_cost_ratio", "prompt_set", "alpha", "bound_speedup_refined",
          "tokens_per_s_min", "tokens_per_s_max", "tokens_per_s_by_repeat", "speedup_min", "speedup_max", "spread",
          "noisy", "noise"}
QUICK = ["--max-new-tokens", "6", "--num-prompts", "2", "--repeats", "1"]


def _results(folder):
    data = json.loads((folder / "results.json").read_text())
    return data, data["records"]


def test_bench_from_built_engines_writes_consistent_results(built_engines, tiny_pair, capsys):
    config, engines = built_engines
    out = engines.parent / "bench-out"
    # The engines were built for K <= 4: a sweep to 6 is clipped with a note rather than failing.
    assert main(["bench", str(config), "--engines-dir", str(engines), "--out", str(out), "--k-max", "6",
                 "--skip-hf", "--max-new-tokens", "6", "--num-prompts", "2", "--repeats", "2"]) == 0
    printed = capsys.readouterr()
    assert "the target engine was built for K <= 4; sweeping K = 1,2,4 " in printed.out + printed.err
    data, records = _results(out)
    assert data["machine"]["cpu_count"] >= 1 and data["machine"]["device"] == "cpu"
    assert data["options"]["k_max"] == 4 and data["options"]["k_values"] == [1, 2, 4]
    assert data["loaded_from"].startswith("engines")
    runner = {"runner": "lean", "why_not_lean": None,
              "compiled": None,  # runtime.torch_compile is off
              "rows_kernel": row_kernels.state()}  # whatever this process found
    attention = {role: data["runners"][role].pop("attention") for role in ("target", "draft")}
    kernels = {role: data["runners"][role].pop("kernels") for role in ("target", "draft")}
    assert data["runners"] == {"target": runner, "draft": runner}
    widths = {str(w) for w in attention_choice.WIDTHS}
    assert all(set(plan["by_width"]) == widths for plan in attention.values())  # measured
    widths = {str(w) for w in matmul_choice.WIDTHS}
    assert all(set(plan["by_width"]) == widths and plan["ms"] for plan in kernels.values())  # measured, however small
    assert "target runner: lean; matrix product by forward width: 1: " in printed.out
    for record in records:
        assert FIELDS <= record.keys(), FIELDS - record.keys()
        assert record["prompt_set"] == "code"
    by_method = {}
    for record in records:
        by_method.setdefault(record["method"], []).append(record)
    assert not {"hf_target", "hf_assisted"} & by_method.keys()
    (target,) = by_method["target"]
    assert target["k"] == 0 and target["speedup_vs_target"] == 1.0 and target["bound_speedup"] == 1.0
    assert target["mean_accepted_len"] == 1.0 and target["acceptance_rate"] == 0.0
    # the default sweep for --k-max 6 is 1, 2, 4, 6; the engines' K <= 4 leaves 1, 2, 4
    assert sorted(r["k"] for r in by_method["speculative"]) == [1, 2, 4]
    c = data["cost_terms"]["cost_ratio_c"]
    for record in by_method["speculative"]:
        k = record["k"]
        assert record["cost_ratio_c"] == pytest.approx(c, abs=1e-4)
        assert record["verify_cost_ratio"] == pytest.approx(data["cost_terms"]["verify_cost_ratio"][k - 1], abs=1e-4)
        assert record["bound_speedup"] == pytest.approx(speedup_bound(record["alpha"], k, c), abs=2e-3)
        assert record["bound_speedup_refined"] == pytest.approx(
            speedup_bound(record["alpha"], k, c, record["verify_cost_ratio"]), abs=2e-3)
        assert record["efficiency"] == pytest.approx(record["speedup_vs_target"] / record["bound_speedup"], abs=2e-3)
        assert record["speedup_vs_target"] == pytest.approx(record["tokens_per_s"] / target["tokens_per_s"],
                                                            abs=2e-3)
        assert 0.0 <= record["acceptance_rate"] <= 1.0
        assert 1.0 <= record["mean_accepted_len"] <= k + 1
    # The torch executor supports max_draft_len="auto": dynamic K must be measured, not skipped with a note.
    assert "dynamic_skipped" not in data["notes"], data["notes"]
    (dynamic,) = by_method["dynamic"]
    assert dynamic["k"] == "auto" and 1.0 <= dynamic["mean_accepted_len"] <= 4 + 1
    assert 0 < dynamic["mean_draft_len"] <= 4  # within the engines' K
    (adaptive,) = by_method["adaptive"]  # the served default: the engine's policy caps K
    assert adaptive["k"] == "policy" and 0 <= adaptive["mean_draft_len"] <= 4
    terms = data["cost_terms"]
    params = sum(p.numel() * p.element_size() for p in load_tiny_models(tiny_pair)[0].parameters())
    assert terms["target_weight_bytes"] == params and terms["memory_bandwidth_gbs"] > 0
    assert terms["memory_bound_tok_s"] == pytest.approx(terms["memory_bandwidth_gbs"] * 1e9 / params, rel=1e-3)
    for record in records:
        assert record["set"] == record["prompt_set"]
        assert record["fraction_of_memory_bound"] == pytest.approx(
            record["tokens_per_s"] / terms["memory_bound_tok_s"], abs=2e-3)
    assert "memory-bound limit:" in printed.out and "of mem bound" in printed.out  # the table's column
    assert len(terms["verify_cost_ratio"]) == 4 and "verify cost K=1..4:" in printed.out  # one per K, printed
    png = out / "results.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _check_spread_and_timing(data, printed.out)


def _check_spread_and_timing(data, printed):
    """Every timed record keeps each repeat's rate and its range around the median; the estimate of the timed part
    (one calibration generation per method, times the plan's size) is printed before the table."""
    for record in data["records"]:
        assert len(record["tokens_per_s_by_repeat"]) == record["repeats"] == data["options"]["repeats"]
        assert record["tokens_per_s_min"] == min(record["tokens_per_s_by_repeat"])
        assert record["tokens_per_s_max"] == max(record["tokens_per_s_by_repeat"])
        assert record["speedup_min"] <= record["speedup_vs_target"] <= record["speedup_max"]
        assert isinstance(record["noisy"], bool) and (record["noise"] is None) != record["noisy"]
    methods = {(r["method"], r["k"]) for r in data["records"]}
    prompts = sum({r["set"]: r["prompts"] for r in data["records"]}.values())
    estimated = data["timing"]["estimated"]
    assert estimated["generations"] == len(methods) * prompts * data["options"]["repeats"]
    assert estimated["seconds"] > 0 and data["timing"]["timed_s"] > 0
    assert data["timing"]["total_s"] >= data["timing"]["timed_s"]
    full = data["timing"]["full_run"]
    assert full["flags"] == "--num-prompts 8 --max-new-tokens 64 --k-values all --repeats 3"
    assert full["generations"] > estimated["generations"]
    announced = re.search(rf"bench: {estimated['generations']} timed generations \(.*\) will take about .* a full "
                          rf"run \(--num-prompts 8 .*\) would take about", printed)
    assert announced and announced.start() < printed.index("weight GB/s")  # before the table
    assert "bench took " in printed
    best = data["best"]["code"]["speculative"]
    spec = {r["k"]: r for r in data["records"] if r["method"] == "speculative"}
    assert best["speedup_vs_target"] == max(r["speedup_vs_target"] for r in spec.values())
    assert best["speedup_vs_target"] == spec[best["k"]]["speedup_vs_target"]


def test_bench_from_model_folders_with_a_short_hf_run(tiny_pair, tmp_path, capsys):
    config = write_config(tmp_path, tiny_config_dict(tiny_pair, name="bench-hf"))
    engines = tmp_path / "engines"
    assert main(["bench", str(config), "--engines-dir", str(engines), "--k-max", "1", "--prompt-set", "json,prose",
                 "--max-new-tokens", "4", "--num-prompts", "1", "--repeats", "1"]) == 0
    printed = capsys.readouterr().out
    assert "no built engines" in printed and re.search(r"best (speculative|ngram) K=\d", printed)
    data, records = _results(engines / "bench-hf" / "bench")
    assert data["loaded_from"].startswith("model folders")
    assert {r["prompt_set"] for r in records} == {"json", "prose"}
    for name in ("json", "prose"):
        methods = {(r["method"], r["k"]) for r in records if r["prompt_set"] == name}
        assert {("target", 0), ("speculative", 1), ("hf_target", 0), ("hf_assisted", 1)} <= methods
    hf = [r for r in records if r["method"] == "hf_assisted"]
    assert all(FIELDS <= r.keys() and r["speedup_vs_hf_target"] is not None for r in hf)
    assert (engines / "bench-hf" / "bench" / "results.png").is_file()


@pytest.mark.parametrize("flag, value, message", [("--k-max", "0", "--k-max: 0 must be between 1 and 16"),
                                                  ("--max-new-tokens", "1", "--max-new-tokens: 1 must be >= 2"),
                                                  ("--prompt-set", "poems", "--prompt-set: 'poems' is not")])
def test_bench_rejects_bad_options_by_name(tiny_config, tmp_path, capsys, flag, value, message):
    assert main(["bench", str(tiny_config), "--engines-dir", str(tmp_path), flag, value]) == 2
    assert message in capsys.readouterr().err


USER = "def add(a, b):"


CHAT_QUICK = ["--max-new-tokens", "4", "--repeats", "1", "--k-max", "2", "--skip-hf"]


def test_bench_prompts_file_sets_come_from_labels(chat_engines, tmp_path, capsys):
    config, engines = chat_engines
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in [
        {"text": "def f(x):", "set": "code"}, {"text": "import sys", "set": "code"},
        {"messages": [{"role": "user", "content": USER}], "set": "chat"}, {"text": "class A:", "set": "code"}]))
    out = tmp_path / "bench"
    assert main(["bench", str(config), "--engines-dir", str(engines), "--prompts", str(prompts), "--out", str(out),
                 "--num-prompts", "2", *CHAT_QUICK]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["options"]["prompt_sets"] == ["code", "chat"] and data["options"]["prompts_file"] == str(prompts)
    assert data["options"]["num_prompts"] == 2
    assert {r["set"] for r in data["records"]} == {"code", "chat"}
    assert all(r["set"] == r["prompt_set"] for r in data["records"])
    assert {r["prompts"] for r in data["records"] if r["set"] == "code"} == {2}  # --num-prompts caps each set
    assert {r["prompts"] for r in data["records"] if r["set"] == "chat"} == {1}


def test_bench_prompts_errors(chat_engines, tiny_config, tmp_path, capsys):
    config, engines = chat_engines
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert main(["bench", str(config), "--prompts", str(prompts), "--prompt-set", "code", *CHAT_QUICK]) == 2
    assert "--prompt-set and --prompts: pass one of them" in capsys.readouterr().err
    # the plain tiny pair has no chat template: the chat item is named, with the fix
    assert main(["bench", str(tiny_config), "--engines-dir", str(tmp_path / "none"), "--prompts", str(prompts),
                 *CHAT_QUICK]) == 2
    err = capsys.readouterr().err
    assert f"--prompts: {prompts} line 1: messages: the tokenizer in " in err and "has no chat template" in err


def test_bench_and_profile_measure_medusa_beside_target_and_ngram(tiny_pair, tmp_path, capsys):
    """A medusa config: bench has a medusa row (K = the tree's depth, acceptance per depth, the chain model's bounds
    left out), profile times each tree against target-only and can recommend one."""
    from pipeline.medusa_heads import MedusaHeads

    target, _, _ = load_tiny_models(tiny_pair)
    MedusaHeads.from_target(target, 2, 1).save(tmp_path / "heads")
    data = tiny_config_dict(tiny_pair, name="medusa-bench", speculative={
        "method": "medusa", "medusa": {"model": str(tmp_path / "heads"), "heads": 2, "layers": 1,
                                       "choices": [[0], [1], [0, 0]]}})
    data.pop("draft")
    config = write_config(tmp_path, data)
    engines = tmp_path / "engines"
    assert main(["build", str(config), "--engines-dir", str(engines)]) == 0
    out = tmp_path / "bench"
    assert main(["bench", str(config), "--engines-dir", str(engines), "--out", str(out), "--k-max", "2",
                 "--skip-hf", "--max-new-tokens", "12", "--num-prompts", "2", "--repeats", "1"]) == 0
    _, records = _results(out)
    by_method = {r["method"]: r for r in records}
    assert {"target", "ngram", "medusa"} <= by_method.keys()
    medusa = by_method["medusa"]
    assert medusa["k"] == 2 and medusa["bound_speedup"] is None and medusa["speedup_vs_target"] > 0
    assert len(medusa["acceptance_by_position"]) <= 2 and medusa["mean_accepted_len"] >= 1
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nimport os\n")
    capsys.readouterr()
    assert main(["profile", str(config), "--prompts", str(prompts), "--max-new-tokens", "10", "--k-max", "2",
                 "--tree", "[[0], [0, 0]]", "--tree", "[[0], [1], [2]]", "--json"]) == 0
    printed = capsys.readouterr().out
    profiles = json.loads(printed[printed.index("\n["):])
    medusa_rows = [p for p in profiles if p["method"] == "medusa"]
    assert [p["choices"] for p in medusa_rows] == [[[0], [0, 0]], [[0], [1], [2]]]
    assert all(p["status"] == "ok" and p["best_speedup"] > 0 and p["tokens_per_step"] >= 1 for p in medusa_rows)
    assert "acceptance by tree depth" in printed and "recommend:" in printed
    # Without --tree: the configured tree and one tuned to these heads, prompts and this machine, both timed.
    assert main(["profile", str(config), "--prompts", str(prompts), "--max-new-tokens", "10", "--json"]) == 0
    printed = capsys.readouterr().out
    assert "medusa tree" in printed
    profiles = [p for p in json.loads(printed[printed.index("\n["):]) if p["method"] == "medusa"]
    assert profiles[0]["choices"] == [[0], [1], [0, 0]]
    if "tuned to these prompts" in printed:  # random heads may earn no tree at all; then it says so instead
        assert len(profiles) == 2 and TokenTree.from_choices(profiles[1]["choices"]).max_depth <= 2
    else:
        assert "none pays here" in printed
    assert main(["profile", str(config), "--prompts", str(prompts), "--tree", "[[0], [-1]]"]) == 2
    assert "--tree: '[[0], [-1]]' is not a named tree" in capsys.readouterr().err


def test_bench_and_profile_measure_eagle3_beside_target_and_ngram(deep_pair, tmp_path, capsys):
    """An eagle3 config: bench has an eagle3 row at each K of the sweep (greedy output equal to the target's),
    profile prices the heads like a draft model with their measured c and can recommend them."""
    from pipeline.eagle3_heads import Eagle3Heads, default_layers

    target, _, _ = load_tiny_models(deep_pair)
    Eagle3Heads.for_target(target, default_layers(target.config.num_hidden_layers), None).save(tmp_path / "heads")
    data = tiny_config_dict(deep_pair, name="eagle3-bench", speculative={
        "method": "eagle3", "max_draft_len": 2, "eagle3": {"model": str(tmp_path / "heads")}})
    data.pop("draft")
    config = write_config(tmp_path, data)
    engines = tmp_path / "engines"
    assert main(["build", str(config), "--engines-dir", str(engines)]) == 0
    out = tmp_path / "bench"
    assert main(["bench", str(config), "--engines-dir", str(engines), "--out", str(out), "--k-max", "2",
                 "--skip-hf", "--max-new-tokens", "12", "--num-prompts", "2", "--repeats", "1"]) == 0
    _, records = _results(out)
    rows = [r for r in records if r["method"] == "eagle3"]
    assert sorted(r["k"] for r in rows) == [1, 2]
    assert all(r["speedup_vs_target"] > 0 and len(r["acceptance_by_position"]) <= r["k"] for r in rows)
    assert all(0 < r["cost_ratio_c"] < 10 for r in rows)  # the heads' own measured cost, not the absent draft's
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nimport os\n")
    capsys.readouterr()
    assert main(["profile", str(config), "--prompts", str(prompts), "--max-new-tokens", "10", "--k-max", "2",
                 "--json"]) == 0
    printed = capsys.readouterr().out
    profiles = [p for p in json.loads(printed[printed.index("\n["):]) if p["method"] == "eagle3"]
    assert len(profiles) == 1 and profiles[0]["status"] == "ok"
    assert profiles[0]["draft"] == f"eagle3:{tmp_path / 'heads'}" and 0 < profiles[0]["cost_ratio_c"] < 10
    assert len(profiles[0]["acceptance_by_position"]) == 2 and "recommend:" in printed
