"""pipeline/bench/report.py: the summary names the best K by median with its range and its rivals within noise, the
noisy cells are listed with their reasons, and results.json's "best" says the same."""

from __future__ import annotations

from pipeline.bench.records import finish_records
from pipeline.bench.report import best_by_set, drift_lines, noisy_lines, summary_lines


def _record(k, rate, low=None, high=None, method="speculative"):
    """Its repeats ran at ``low``, ``rate`` and ``high`` tok/s."""
    by_repeat = [rate if low is None else low, rate, rate if high is None else high]
    return {"method": method, "k": k, "set": "code", "prompt_set": "code", "tokens_per_s": rate,
            "tokens_per_s_by_repeat": by_repeat, "bound_speedup": 1.6, "bound_speedup_refined": 1.4, "alpha": 0.6, "mean_accepted_len": 2.0,
            "repeats": 3}


def _records():
    """The trial's shape: a burst makes K=2's fastest repeat the fastest of all, and K=3's median a lone dip."""
    return finish_records([_record(0, 10.0, method="target"), _record(1, 13.5, 13.0, 14.0),
                           _record(2, 12.0, 6.0, 25.0), _record(3, 3.1, 3.0, 3.2), _record(4, 13.4, 13.2, 13.9)])


def test_the_summary_picks_by_median_and_says_what_is_within_noise():
    (line,) = summary_lines(_records())
    assert line.startswith("code: best speculative K=1 1.35x (1.30-1.40x over 3 repeats); within noise of "
                           "K=4 1.34x, K=2 1.20x; bound 1.60x")


def test_noisy_cells_are_listed_with_their_reasons():
    (line,) = noisy_lines(_records())
    assert line.startswith("noisy cells (2 of 5): code speculative K=2 (repeats spread 158%); code speculative K=3 "
                           "(0.31x between 1.20x and 1.34x (K=2 and K=4)).")
    assert "--repeats" in line
    assert noisy_lines(finish_records([_record(0, 10.0, method="target"), _record(1, 12.0)])) == []


def test_a_drifting_machine_is_named_once_and_its_pairs_stay_quiet():
    drifting = finish_records([_record(0, 10.0, 5.0, 15.0, method="target"), _record(1, 12.0, 6.0, 18.0)])
    assert drift_lines(drifting) == ["the machine's speed moved between repeats: target-only's rate spread code "
                                     "100%; each speedup pairs a repeat with target-only's in the same repeat, "
                                     "which cancels a slow drift"]
    assert noisy_lines(drifting) == [] and drift_lines(_records()) == []
    many = finish_records([_record(0, 10.0, method="target")] + [_record(k, 12.0, 6.0, 18.0) for k in range(1, 11)])
    (line,) = noisy_lines(many)
    assert line.startswith("noisy cells (10 of 11): ") and line.count(" (repeats spread 100%)") == 8
    assert "; and 2 more." in line


def test_results_json_best_names_the_pick_and_its_rivals():
    best = best_by_set(_records())["code"]["speculative"]
    assert best == {"k": 1, "speedup_vs_target": 1.35, "speedup_min": 1.3, "speedup_max": 1.4,
                    "within_noise_of": [4, 2], "noisy": False, "repeats": 3}


def test_the_printed_report_carries_the_summary_the_drift_and_the_noisy_cells(capsys):
    from pipeline.bench.report import print_report
    from pipeline.bench.timing import CostTerms

    records = finish_records([_record(0, 10.0, 5.0, 15.0, method="target"), _record(1, 13.5, 6.5, 30.0),
                              _record(2, 12.0), _record(3, 3.1)])
    print_report(records, CostTerms(4.0, 1.0, [5.0, 6.0, 7.0], 100, 3), None, 3)
    out = capsys.readouterr().out
    assert "cost terms: c = 0.250 (draft 1.00 ms / target 4.00 ms per token); verify cost K=1..3: 1.25 1.50 1.75" in out
    for start in ("code: best speculative K=1", "the machine's speed moved between repeats", "noisy cells (3 of 4)"):
        assert f"\n{start}" in out


def test_runner_lines_say_the_runner_and_the_product_per_width():
    from pipeline.bench.report import runner_lines

    info = {"target": {"runner": "lean", "why_not_lean": None,
                       "kernels": {"by_width": {"1": "linear", "2": "w_xt"}, "ms": {}}},
            "draft": {"runner": "hf-modules", "why_not_lean": "model_type 'gpt2' is not one of llama, mistral, qwen2",
                      "kernels": None}}
    info["target"]["attention"] = {"by_width": {"1": "sdpa_f32", "4": "sdpa"}, "us": {}}
    assert runner_lines(info) == [
        "target runner: lean; matrix product by forward width: 1: linear, 2: w_xt; attention by query width: "
        "1: sdpa_f32, 4: sdpa",
        "draft runner: hf-modules (model_type 'gpt2' is not one of llama, mistral, qwen2); attention by query "
        "width: SDPA at every width"]
    assert runner_lines(None) == []
    # why rows is not among them
    info["target"]["rows_kernel"] = "needs AVX2 and FMA, or AVX-512 (fma missing on this CPU)"
    assert runner_lines(info)[0].startswith("target runner: lean; matrix product by forward width: 1: linear, 2: "
                                            "w_xt (no rows kernel: needs AVX2 and FMA, or AVX-512 (fma missing on this "
                                            "CPU));")
    for known in ("loaded (avx2)", "not tried"):
        info["target"]["rows_kernel"] = known
        assert "rows kernel" not in runner_lines(info)[0]
    info["target"]["compiled"] = {"buckets": [1, 2, 4], "warm_up_s": 12.5, "eager_calls": 0,
                                  "route": {"1": 1, "2": 2, "4": 4}}
    assert runner_lines(info)[0].startswith(
        "target runner: lean; matrix product by forward width: compiled per width bucket [1, 2, 4] (warm-up 12.5 s);"
        " attention")
    info["target"]["compiled"]["route"]["1"] = 2  # one row ran slower than two
    assert "(warm-up 12.5 s); run wider: 1 as 2; attention" in runner_lines(info)[0]
