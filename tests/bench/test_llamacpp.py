"""`bench --llamacpp` (pipeline/bench/llamacpp.py): llama-bench's JSON parsed from a recorded real run
(tests/data/llamacpp/, see its README), its records in the bench table, every error path by name, the default GGUF
from a target folder's source.json; llama-bench itself runs only where SPECPIPE_LLAMA_BENCH names a built binary.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.bench.report import summary_lines
from pipeline.bench.llamacpp import (check_binary, check_gguf, comparison_line, default_ggufs, llamacpp_records,
                                     parse_llama_bench, plan_from_args, precision_of, run_llama_bench, run_llamacpp,
                                     summary_line)
from pipeline.bench.plot import plot_results
from pipeline.bench.records import format_table
from pipeline.cli import main
from pipeline.errors import PipelineError

RECORDED = Path(__file__).resolve().parents[1] / "data" / "llamacpp" / "llama_bench_q8_0.json"
LLAMA_BENCH = os.environ.get("SPECPIPE_LLAMA_BENCH")
needs_llama_bench = pytest.mark.skipif(
    not (LLAMA_BENCH and os.access(LLAMA_BENCH, os.X_OK)),
    reason="SPECPIPE_LLAMA_BENCH does not name an executable llama-bench (build one: README, 'llama.cpp as a "
           "reference')")


def _recorded():
    return parse_llama_bench(RECORDED.read_text(), Path("SmolLM2-135M-Instruct.Q8_0.gguf"))


def test_parser_reads_the_recorded_decode_test():
    raw = json.loads(RECORDED.read_text())[0]
    result = _recorded()
    assert result.model_type == raw["model_type"] and result.precision == "q8_0"
    assert result.weight_bytes == raw["model_size"] > 100_000_000  # 135M parameters at a little over a byte each
    assert result.n_gen == 16 and result.repetitions == 1 and result.n_threads == raw["n_threads"]
    assert result.tokens_per_s == raw["avg_ts"] > 0
    assert result.build_commit == raw["build_commit"] and result.cpu_info == raw["cpu_info"]


@pytest.mark.parametrize("description, precision", [
    # llama_model_desc is "<arch> <size> <llama_ftype_name>"; the names are llama.cpp's (src/llama-model-loader.cpp)
    ("llama 135M all F32", "f32"), ("llama 135M BF16", "bf16"), ("llama 135M Q8_0", "q8_0"),
    ("llama 135M Q4_1", "q4_1"), ("llama 8B Q4_K - Medium", "q4_k"), ("llama 135M (guessed) Q8_0", "q8_0"),
    ("llama", "unknown")])
def test_precision_is_the_weight_type_of_the_description(description, precision):
    assert precision_of(description) == precision


def test_records_print_in_the_table_beside_ours():
    result = _recorded()
    records = llamacpp_records([result], ["code", "chat"])
    assert [(r["method"], r["k"], r["set"], r["prompt_set"]) for r in records] == [
        ("llamacpp", 0, "code", "code"), ("llamacpp", 0, "chat", "chat")]
    record = records[0]
    assert record["precision"] == "q8_0" and record["weight_bytes"] == result.weight_bytes
    assert record["weight_gbs"] == pytest.approx(result.weight_bytes * result.tokens_per_s / 1e9, abs=1e-3)
    assert record["speedup_vs_target"] is None and record["fraction_of_memory_bound"] is None
    ours = {"method": "target", "k": 0, "set": "code", "prompt_set": "code", "tokens_per_s": 50.0,
            "speedup_vs_target": 1.0, "bound_speedup": 1.0}
    table = format_table([ours, records[0]]).splitlines()
    assert "weights" in table[0].split() and len(table) == 3
    cells = table[2].split()
    assert cells[:4] == ["code", "llamacpp", "0", "q8_0"] and cells[4] == f"{result.tokens_per_s:.1f}"
    assert summary_lines([ours, *records]) == []  # nothing speculative to summarize; llama.cpp rows are skipped
    assert llamacpp_records([result], [])[0]["set"] == "-"


# With no K sweep the acceptance panel has nothing to label: matplotlib warns, the PNG is still written.
@pytest.mark.filterwarnings("ignore:No artists with labels found")
def test_plot_tolerates_llamacpp_records(tmp_path):
    out = plot_results(llamacpp_records([_recorded()], ["code"]), tmp_path / "p.png", "llama.cpp only")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.filterwarnings("ignore:No artists with labels found")
def test_plot_draws_llamacpp_against_our_target_only(tmp_path, monkeypatch):
    """The speedup panel's llama.cpp line sits at its tok/s over our target-only tok/s for the same set."""
    import pipeline.bench.plot as plot

    figures = []
    monkeypatch.setattr(plot, "save_figure", lambda fig, out, title: figures.append(fig) or out)
    result = _recorded()
    target = {"method": "target", "prompt_set": "code", "k": 0, "tokens_per_s": 20.0}
    ours = llamacpp_records([result], ["code"])
    plot.plot_results([target, *ours], tmp_path / "p.png", "t")
    lines = [line for line in figures[0].axes[0].get_lines() if "llama.cpp" in line.get_label()]
    assert len(lines) == 1 and "q8_0" in lines[0].get_label()
    assert lines[0].get_ydata()[0] == pytest.approx(ours[0]["tokens_per_s"] / 20.0)


def test_the_comparison_is_our_target_only_decode_rate_over_each_gguf():
    result = _recorded()
    theirs = llamacpp_records([result], ["code", "json"])
    assert theirs[0]["decode_tokens_per_s"] == theirs[0]["tokens_per_s"]
    ours = [{"method": "target", "set": s, "prompt_set": s, "tokens_per_s": 9.0, "decode_tokens_per_s": rate}
            for s, rate in (("code", result.tokens_per_s / 2), ("json", result.tokens_per_s / 4))]
    spec = {"method": "ngram", "set": "code", "prompt_set": "code", "decode_tokens_per_s": 1e6}
    assert comparison_line([*ours, spec, *theirs]) == \
        "target-only decode tok/s (first token excluded) over llama.cpp's: q8_0 code 0.50, json 0.25"
    assert comparison_line(ours) is None and comparison_line(theirs) is None


def test_summary_line_names_build_threads_and_each_type():
    result = _recorded()
    line = summary_line([result])
    assert line == (f"llama.cpp (build {result.build_commit}, {result.n_threads} threads): "
                    f"q8_0 {result.tokens_per_s:.1f} tok/s")


def test_missing_or_non_executable_binary_is_named(tmp_path):
    missing = tmp_path / "llama-bench"
    with pytest.raises(PipelineError, match=r"^--llamacpp: .*llama-bench does not exist; pass the path"):
        check_binary(missing)
    missing.write_text("not a program")
    with pytest.raises(PipelineError, match=r"^--llamacpp: .* is not an executable file.*chmod \+x"):
        check_binary(missing)
    with pytest.raises(PipelineError, match=r"is not an executable file"):
        check_binary(tmp_path)


def test_missing_gguf_is_named(tmp_path):
    with pytest.raises(PipelineError, match=r"^--llamacpp-gguf: .*nope.gguf does not exist.*llama-quantize"):
        check_gguf(tmp_path / "nope.gguf")


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_failing_llama_bench_reports_its_last_stderr_line(tmp_path):
    # A stand-in for the ERROR path only: real output is tested from the recording above.
    failing = _executable(tmp_path / "failing_llama_bench.sh", "#!/bin/sh\necho 'loading model' >&2\n"
                          "echo 'error: failed to load model x.gguf' >&2\nexit 1\n")
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(PipelineError) as caught:
        run_llama_bench(failing, gguf, threads=1, n_gen=4, repetitions=1)
    message = str(caught.value)
    assert message.startswith(f"--llamacpp-gguf: llama-bench failed on {gguf} (exit 1: error: failed to load model")
    assert "\n" not in message and "-p 0 -n 4 -r 1 -o json" in message


def test_a_binary_that_cannot_run_or_prints_no_json_is_named(tmp_path):
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    no_interpreter = _executable(tmp_path / "no_interpreter_llama_bench", "plain text, no #! line\n")
    with pytest.raises(PipelineError, match=r"^--llamacpp: .* cannot be run \(Exec format error\)"):
        run_llama_bench(no_interpreter, gguf, threads=1, n_gen=4, repetitions=1)
    with pytest.raises(PipelineError, match=r"^--llamacpp: llama-bench printed no JSON"):
        parse_llama_bench("| model | size |", gguf)
    with pytest.raises(PipelineError, match=r"holds no decode test"):
        parse_llama_bench(json.dumps([{**json.loads(RECORDED.read_text())[0], "n_prompt": 512, "n_gen": 0}]), gguf)
    with pytest.raises(PipelineError, match=r"lacks or garbles 'avg_ts'"):
        parse_llama_bench(json.dumps([{k: v for k, v in json.loads(RECORDED.read_text())[0].items()
                                       if k != "avg_ts"}]), gguf)


def test_default_gguf_is_the_one_the_target_was_dequantized_from(tmp_path):
    cache = tmp_path / "cache"
    (cache / "gguf").mkdir(parents=True)
    source = cache / "gguf" / "M.Q4_1.gguf"
    source.write_bytes(b"GGUF")
    folder = tmp_path / "models" / "m"
    folder.mkdir(parents=True)
    (folder / "source.json").write_text(json.dumps({"gguf_file": "M.Q4_1.gguf"}))
    assert default_ggufs("models/m", tmp_path, cache) == [source]
    assert default_ggufs(str(source), tmp_path, cache) == [source]  # a .gguf target is its own source
    source.unlink()
    with pytest.raises(PipelineError, match=r"^--llamacpp-gguf: no GGUF of the target models/m found \(its "
                                            r"source.json names M.Q4_1.gguf, which is not in .*; pass --llamacpp-gguf"):
        default_ggufs("models/m", tmp_path, cache)
    (folder / "source.json").unlink()
    with pytest.raises(PipelineError, match=r"not made from a GGUF .*pass --llamacpp-gguf FILE"):
        default_ggufs("models/m", tmp_path, cache)


def test_plan_checks_flags_before_anything_runs(tmp_path, monkeypatch):
    config = SimpleNamespace(target=SimpleNamespace(model="models/m"), base_dir=tmp_path)
    assert plan_from_args(None, [], config) is None
    with pytest.raises(PipelineError, match=r"^--llamacpp-gguf: it needs --llamacpp PATH"):
        plan_from_args(None, [tmp_path / "a.gguf"], config)
    binary = _executable(tmp_path / "llama-bench", "#!/bin/sh\nexit 0\n")
    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(PipelineError, match=r"^--llamacpp-gguf: no GGUF of the target"):
        plan_from_args(binary, [], config)
    gguf = tmp_path / "a.gguf"
    gguf.write_bytes(b"GGUF")
    plan = plan_from_args(binary, [gguf], config)
    assert plan.binary == binary and plan.ggufs == [gguf]


def test_bench_fails_on_a_bad_llamacpp_path_before_loading_anything(tiny_config, tmp_path, capsys):
    assert main(["bench", str(tiny_config), "--engines-dir", str(tmp_path), "--llamacpp",
                 str(tmp_path / "missing")]) == 2
    assert "--llamacpp: " in capsys.readouterr().err
    assert not (tmp_path / "tiny-test").exists()  # nothing was measured or written


@needs_llama_bench
def test_real_llama_bench_on_the_real_gguf(request):
    gguf = request.getfixturevalue("real_gguf_file")
    records, info, line = run_llamacpp(plan_from_args(Path(LLAMA_BENCH), [gguf], None), threads=1, n_gen=4,
                                       repetitions=1, sets=["code"])
    (record,) = records
    assert record["method"] == "llamacpp" and record["precision"] == "q4_1" and record["tokens_per_s"] > 0
    assert record["n_threads"] == 1 and record["tokens"] == 4 and record["weight_bytes"] > 50_000_000
    assert info["binary"] == LLAMA_BENCH and info["ggufs"][0]["file"] == str(gguf) and info["cpu_info"]
    assert line.startswith(f"llama.cpp (build {info['build_commit']}, 1 threads): q4_1 ")


@needs_llama_bench
def test_bench_appends_llamacpp_records_after_ours(tiny_config, tmp_path, capsys, request):
    gguf = request.getfixturevalue("real_gguf_file")  # any GGUF runs; the wiring is what is checked here
    out = tmp_path / "bench"
    assert main(["bench", str(tiny_config), "--engines-dir", str(tmp_path), "--out", str(out), "--skip-hf",
                 "--k-max", "1", "--max-new-tokens", "4", "--num-prompts", "1", "--repeats", "1",
                 "--llamacpp", LLAMA_BENCH, "--llamacpp-gguf", str(gguf)]) == 0
    printed = capsys.readouterr().out
    data = json.loads((out / "results.json").read_text())
    methods = [r["method"] for r in data["records"]]
    assert methods[-1] == "llamacpp" and methods.count("llamacpp") == 1 and "target" in methods
    (record,) = [r for r in data["records"] if r["method"] == "llamacpp"]
    assert record["set"] == "code" and record["tokens"] == 4 and record["precision"] == "q4_1"
    assert record["n_threads"] == data["machine"]["torch_threads"] == data["llamacpp"]["n_threads"]
    assert data["llamacpp"]["binary"] == LLAMA_BENCH and data["llamacpp"]["ggufs"][0]["file"] == str(gguf)
    assert f"llama.cpp (build {data['llamacpp']['build_commit']}, {record['n_threads']} threads): q4_1 " in printed
    assert re.search(r"code\s+llamacpp\s+0\s+q4_1\s+\d", printed)  # its row in the table
