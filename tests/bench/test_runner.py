"""pipeline/bench/runner.py on the TensorRT-LLM executor over FAKE engines (tests/fake_trtllm.py)."""

from __future__ import annotations

from tests.conftest import load_tiny_models


def test_bench_runs_on_the_trtllm_executor_over_a_fake_engine(tiny_pair):
    """`bench` on a trtllm config used to crash (the executor lacked the limits the bench reads); here it runs on
    the TensorRT-LLM executor over FAKE engines (tests/fake_trtllm.py): call-level cost terms, no HF baselines."""
    from tests.fake_trtllm import FakeTrtllmEngine

    from pipeline.bench.runner import BenchOptions, run_bench
    from pipeline.backends.trtllm_runner import EngineLimits
    from pipeline.executor.trtllm_executor import TrtllmSpeculativeExecutor

    target, draft, tok = load_tiny_models(tiny_pair)
    ex = TrtllmSpeculativeExecutor(FakeTrtllmEngine(target), FakeTrtllmEngine(draft), tok, EngineLimits(64, 128, 2),
                                   max_draft_len=2, acceptance="greedy")
    notes_seen = []
    options = BenchOptions(prompt_sets=["code"], max_new_tokens=4, num_prompts=1, k_max=2, repeats=1,
                           cost_repeats=2)
    # Set names are labels from a --prompts file: any name, carried as `set` (and `prompt_set`) by every record.
    records, costs, notes = run_bench(ex, {"renames": ["def main(x, y):\n    return x + y\n"]}, options,
                                      note=notes_seen.append)
    assert "hf_skipped" in notes and any("Hugging Face baselines skipped" in n for n in notes_seen)
    assert {(r["set"], r["prompt_set"]) for r in records} == {("renames", "renames")}
    methods = {(r["method"], r["k"]) for r in records}
    assert {("target", 0), ("speculative", 1), ("speculative", 2), ("ngram", 2), ("ngram+draft", 2)} <= methods
    assert costs.target_ms > 0 and costs.draft_ms > 0 and len(costs.verify_ms) == 2
