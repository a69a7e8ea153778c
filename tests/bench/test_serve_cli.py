"""`python -m pipeline bench-serve` (pipeline/bench/serve_cli.py) end to end.

Fast: the engine path on the session's tiny pair at concurrency 1 and 2 with a few tokens, and with the chat prompt
set; the Triton paths run briefly (chat prompts, usage from the server's metrics) under the `server` marker.
"""

from __future__ import annotations

import json

import pytest

from pipeline.bench import serve_matrix
from tests.conftest import run_cli, tiny_config_dict, write_config


@pytest.fixture(scope="module")
def engine_bench(built_engines, tmp_path_factory):
    config_path, engines = built_engines
    out = tmp_path_factory.mktemp("serving")
    result = run_cli("bench-serve", str(config_path), "--engines-dir", str(engines), "--paths", "engine",
                     "--concurrency", "1,2", "--requests", "4", "--max-tokens", "6", "--rounds", "2",
                     "--hf-rounds", "1", "--num-prompts", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads((out / "serving.json").read_text()), out, result.stdout


def test_engine_path_end_to_end(engine_bench):
    data, out, stdout = engine_bench
    cells = {(r["mode"], r["concurrency"]): r for r in data["records"]}
    assert set(cells) == {(m, c) for m in serve_matrix.MODES for c in (1, 2)}
    for (mode, _), r in cells.items():
        assert r["path"] == "engine" and r["requests"] == 4 and r["tokens"] <= 4 * 6
        assert r["tokens_per_s"] > 0 and r["ttft_ms_p50"] > 0 and r["itl_ms_p99"] >= r["itl_ms_p50"] > 0
        if mode == "target_only":  # max_draft_len=0 reaches the engine: nothing drafted
            assert r["mean_draft_len"] == 0
        else:
            assert r["mean_draft_len"] > 0
    assert cells[("speculative_fixed", 1)]["k"] == data["options"]["k"]
    for (mode, _), r in cells.items():  # the field's figures, per cell
        assert len(r["rounds"]) == 2 and r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
        assert r["tpot_ms_p50"] > 0 and r["weight_gb_per_s"] > 0 and r["acceptance_length"] >= 1
        assert len(r["acceptance_length_per_request"]) == 4 and sum(r["acceptance_length_histogram"]["counts"]) == 4
        assert r["exact_match"] == 1.0  # greedy: speculation never changes the tokens (target_only against itself)
        if mode != "target_only":
            assert r["per_position_acceptance"] and all(0 <= x <= 1 for x in r["per_position_acceptance"])
        # every step reported: the steps' histogram holds every token the cell generated
        assert sum(int(n) * c for n, c in r["tokens_per_step_histogram"].items()) == r["tokens"]
    assert data["phases"]["startup_s"] > 0 and data["phases"]["warmup_s"] > 0
    runs = {folder.name for folder in (out / "specdec_bench").iterdir()}
    assert runs == {f"engine_{m}_c{c}" for m in serve_matrix.MODES for c in (1, 2)}
    assert json.loads((out / "specdec_bench" / "engine_speculative_c1" / "acceptance_rate.json").read_text())
    assert data["batch1_target_vs_hf"]["target_tokens_per_s"] > 0 and data["batch1_target_vs_hf"]["hf_target_tokens_per_s"] > 0
    assert data["machine"]["cpu"] and data["machine"]["torch"]
    assert (out / "serving.png").stat().st_size > 10_000
    assert "speculative_fixed" in stdout and "wrote" in stdout


def test_chat_prompts_reuse_the_shared_prefix_on_the_engine_path(built_engines, tmp_path):
    """--prompt-set chat: every prompt starts with the (fitted) system prompt, which the engine's prefix cache
    computes once; each cell records its hit rate and mean batch occupancy from the engine's totals."""
    config_path, engines = built_engines
    result = run_cli("bench-serve", str(config_path), "--engines-dir", str(engines), "--paths", "engine",
                     "--prompt-set", "chat", "--modes", "one_at_a_time,speculative", "--concurrency", "2",
                     "--requests", "4", "--max-tokens", "4", "--rounds", "1", "--hf-rounds", "0", "--num-prompts", "3",
                     "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "serving.json").read_text())
    # the tiny pair's 256-token prompt limit cuts the system prompt (~1100 tokens here), still a few blocks long
    assert data["options"]["prompt_set"] == "chat" and data["options"]["shared_prefix_tokens"] >= 128
    for r in data["records"]:
        assert 0 < r["prefix_hit_rate"] < 1 and 0 < r["occupancy"] <= 1
    assert data["records"][0]["occupancy"] == 0.25  # one_at_a_time: one request in a batch of 4
    assert "prefix hit" in result.stdout and "occupancy" in result.stdout


def test_the_shipped_category_set_by_name(built_engines, tmp_path):
    """--prompts categories: the shipped chats, categories interleaved so the first prompts span them."""
    config_path, engines = built_engines
    result = run_cli("bench-serve", str(config_path), "--engines-dir", str(engines), "--paths", "engine",
                     "--prompts", "categories", "--modes", "speculative", "--concurrency", "3", "--requests", "3",
                     "--max-tokens", "4", "--rounds", "1", "--hf-rounds", "0", "--num-prompts", "9",
                     "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "serving.json").read_text())
    assert data["options"]["prompt_set"] == "categories" and data["options"]["num_prompts"] == 9
    assert data["records"][0]["tokens"] > 0


def test_an_ngram_config_is_benchmarked_with_lookups(tiny_pair, tmp_path):
    """The config's speculative.method reaches the benchmarked engine: an n-gram config has no draft engine."""
    from pipeline.config import load_config
    from pipeline.stages import run_stages

    data = tiny_config_dict(tiny_pair, name="tiny-ngram")
    data.pop("draft")
    config_path = write_config(tmp_path, {**data, "speculative": {**data["speculative"], "method": "ngram"}})
    run_stages(load_config(config_path), tmp_path / "engines", ("convert", "build"))
    result = run_cli("bench-serve", str(config_path), "--engines-dir", str(tmp_path / "engines"), "--paths", "engine",
                     "--modes", "speculative_fixed", "--concurrency", "1", "--requests", "2", "--max-tokens", "6",
                     "--rounds", "1", "--hf-rounds", "0", "--num-prompts", "2", "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-2000:]
    (record,) = json.loads((tmp_path / "out" / "serving.json").read_text())["records"]
    assert record["mode"] == "speculative_fixed" and record["tokens"] > 0


def test_bad_flags_name_the_flag(built_engines):
    config_path, engines = built_engines
    result = run_cli("bench-serve", str(config_path), "--engines-dir", str(engines), "--modes", "speculative,fast")
    assert result.returncode != 0 and "--modes: fast unknown" in result.stderr
    result = run_cli("bench-serve", str(config_path), "--engines-dir", str(engines), "--concurrency", "8",
                     "--requests", "4")
    assert result.returncode != 0 and "--concurrency: 8" in result.stderr


@pytest.mark.server
def test_triton_paths_briefly(built_engines, tmp_path):
    pytest.importorskip("tritonclient.http")
    pytest.importorskip("tritonclient.grpc")
    config_path, engines = built_engines
    paths = ("triton", "triton_stream", "openai")
    modes = ("one_at_a_time", "target_only", "speculative_fixed", "method_ngram")
    result = run_cli("bench-serve", str(config_path), "--engines-dir", str(engines), "--paths", ",".join(paths),
                     "--modes", ",".join(modes), "--concurrency", "2", "--requests", "2",
                     "--max-tokens", "4", "--rounds", "1", "--hf-rounds", "0", "--prompt-set", "chat",
                     "--num-prompts", "2", "--out", str(tmp_path), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads((tmp_path / "serving.json").read_text())["records"]
    by_path = {(r["path"], r["mode"]): r for r in records}
    assert set(by_path) == {(p, m) for p in paths for m in modes}
    for path in paths:  # greedy through every front: the same answers as speculation off
        assert by_path[(path, "speculative_fixed")]["exact_match"] == 1.0
        # from the engine model's position counters (HTTP) or the streamed stats
        assert by_path[(path, "speculative_fixed")]["acceptance_length"] >= 1
    assert by_path[("triton", "speculative_fixed")]["per_position_acceptance"]
    # the stream reports every step (specdec_bench's step histogram)
    stream = by_path[("triton_stream", "speculative_fixed")]
    assert sum(int(n) * c for n, c in stream["tokens_per_step_histogram"].items()) == stream["tokens"]
    for path in paths:  # the request's speculative_method reached the engine through every front
        assert by_path[(path, "method_ngram")]["method"] == "ngram" and by_path[(path, "method_ngram")]["exact_match"] == 1.0
    assert by_path[("openai", "target_only")]["ttft_ms_p50"] > 0 and by_path[("openai", "target_only")]["tpot_ms_p50"] > 0
    assert by_path[("triton", "target_only")]["ttft_ms_p50"] is None  # HTTP request/response: no first token
    assert by_path[("triton_stream", "target_only")]["ttft_ms_p50"] > 0
    for r in records:
        assert 0 < r["tokens"] <= 2 * 4 and r["tokens_per_s"] > 0
        # from the served engine model's counters: the warm-up already cached the shared system prompt
        assert 0 < r["prefix_hit_rate"] < 1 and 0 < r["occupancy"] <= 1
    assert by_path[("triton", "target_only")]["mean_draft_len"] == 0  # num_draft_tokens=0 reached the engine
