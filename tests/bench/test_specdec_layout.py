"""pipeline/bench/specdec_layout.py against NVIDIA ModelOpt's specdec_bench as RECORDED (tests/data/
specdec_bench_recorded, each file's repository, path and commit in its .source). The expected layout is never typed
here: upstream's own metric classes (Timing, AcceptanceRate, compute_statistics) run on the same synthetic requests
our records are made from, and our files must have their keys, nesting and values; configuration.json's keys are
read from run.py's options and dump_env; the run folders must be the ones upload_to_s3 discovers."""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path
from statistics import mean

import numpy as np
import pytest

from pipeline.bench import specdec_layout
from pipeline.bench.specdec_layout import specdec_results, write_specdec
from pipeline.bench.timing import percentile

RECORDED = Path(__file__).resolve().parents[1] / "data" / "specdec_bench_recorded"
UPSTREAM = "NVIDIA/Model-Optimizer"

# (start, [time each step's tokens arrived], [tokens each step emitted]) per request, perf_counter seconds; at K = 3
# every step drafted 3 positions, so a step emits 1..4 tokens
SPEC = [(10.0, [10.20, 10.31, 10.45, 10.52, 10.66], [2, 4, 1, 3, 4]),
        (10.1, [10.55, 10.62, 10.80, 10.91], [1, 1, 2, 4]),
        (10.2, [10.33, 10.49, 10.58, 10.71, 10.77, 10.93], [4, 4, 3, 2, 1, 2])]
TARGET = [(20.0, [20.15, 20.19, 20.24, 20.30], [1, 1, 1, 1]),
          (20.05, [20.40, 20.43, 20.47], [1, 1, 1]),
          (20.1, [20.22, 20.26, 20.31, 20.35, 20.41], [1, 1, 1, 1, 1])]
RUN = {"config": "tiny", "model": "models/tiny/target", "draft": "models/tiny/draft (draft_model)",
       "started": "2026-01-02T03:04:05+0100", "finished": "2026-01-02T03:14:05+0100", "git_commit": "0" * 40,
       "machine": {"cpu": "x86", "python": "3.11.9"},
       "options": {"max_tokens": 32, "prompt_set": "mixed", "concurrency": [1, 4], "decoding": "greedy"}}


def recorded(relative: str) -> Path:
    """A recorded upstream file, after checking that its .source names it and a commit."""
    source = (RECORDED / f"{relative}.source").read_text()
    assert f"repository: {UPSTREAM}\n" in source and f"path: examples/specdec_bench/{relative}\n" in source, source
    assert re.search(r"^commit: [0-9a-f]{40}$", source, re.M), source
    return RECORDED / relative


def upstream(relative: str, names: list[str], namespace: dict) -> dict:
    """Define the top-level classes, functions and assignments ``names`` of a recorded file in ``namespace`` (which
    stands in for its imports), as upstream wrote them."""
    tree = ast.parse(recorded(relative).read_text())
    nodes = [n for n in tree.body if getattr(n, "name", None) in names
             or isinstance(n, ast.Assign) and any(getattr(t, "id", None) in names for t in n.targets)]
    assert len(nodes) == len(names), f"{relative}: found {len(nodes)} of {names}"
    exec(compile(ast.Module(body=nodes, type_ignores=[]), relative, "exec"), namespace)  # noqa: S102 - data
    return namespace


def upstream_metrics() -> tuple[type, type]:
    metric = upstream("specdec_bench/metrics/base.py", ["Metric"], {"json": json, "os": os})["Metric"]
    timing = upstream("specdec_bench/metrics/timing.py", ["Timing", "compute_statistics"],
                      {"np": np, "Metric": metric})["Timing"]
    acceptance = upstream("specdec_bench/metrics/acceptance_rate.py", ["AcceptanceRate"],
                          {"json": json, "os": os, "Metric": metric})["AcceptanceRate"]
    return timing, acceptance


def upstream_run(requests: list, tmp: Path) -> tuple[dict, dict]:
    """timing.json's and acceptance_rate.json's entry as upstream's metrics write them for ``requests``."""
    timing_class, acceptance_class = upstream_metrics()
    for cls in (timing_class, acceptance_class):
        cls.update_directory(str(tmp))
    timing, acceptance = timing_class(1), acceptance_class()
    for i, (start, times, groups) in enumerate(requests):
        step = {"token_times": [start, *times], "output_ids": [[[7] * g for g in groups]]}
        timing.process_step(step, i, 0)
        acceptance.process_step(step, i, 0)
    timing.process_final(None)
    acceptance.process_final([[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]
                             * len(requests))
    return tuple(json.loads((tmp / f"{m.name}.json").read_text())[0] for m in (timing, acceptance))


def our_record(requests: list, path: str, mode: str, k: int | str, concurrency: int) -> dict:
    """bench-serve's record of ``requests``, every value by our own definitions (ms, p50/p99, per request)."""
    ms = {name: [1000 * f(start, times) for start, times, _ in requests] for name, f in (
        ("ttft", lambda s, t: t[0] - s), ("latency", lambda s, t: t[-1] - s))}
    tokens = [sum(groups) for *_, groups in requests]
    ms["tpot"] = [1000 * (t[-1] - t[0]) / (n - 1) for (_, t, _), n in zip(requests, tokens)]
    wall = max(t[-1] for _, t, _ in requests) - min(s for s, *_ in requests)
    steps = [g for *_, groups in requests for g in groups]
    speculative = mode != "target_only"
    record = {"path": path, "mode": mode, "method": "draft_model", "concurrency": concurrency, "k": k,
              "requests": len(requests), "tokens": sum(tokens), "wall_s": wall, "tokens_per_s": sum(tokens) / wall,
              "rounds": [sum(tokens) / wall], "requests_per_s": len(requests) / wall, "itl_ms_p50": 1.0,
              "itl_ms_p99": 2.0, "mean_draft_len": 3.0 if speculative else 0.0, "exact_match": 1.0,
              "acceptance_rate": sum(g - 1 for g in steps) / (3 * len(steps)) if speculative else None,
              "acceptance_length_per_request": [mean(g) for *_, g in requests] if speculative else None,
              "per_position_acceptance": ([sum(g >= i + 2 for g in steps) / len(steps) for i in range(3)]
                                          if speculative else None)}
    record.update({f"{name}_ms_p{q}": percentile(values, q) for name, values in ms.items() for q in (50, 99)})
    record["tokens_per_step_histogram"] = ({str(n): steps.count(n) for n in sorted(set(steps))} if speculative
                                           else None)
    record["acceptance_length"] = mean(record["acceptance_length_per_request"]) if speculative else None
    return record


def same_shape(ours: object, theirs: object, where: str = "") -> None:
    """``ours`` has every key of ``theirs`` at every level and nothing else; a value is theirs' type or null; a
    dict upstream fills from data we do not have may be empty."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict), where
        if ours or not where.endswith("Acceptance_Length_Histogram"):
            assert set(ours) == set(theirs), f"{where}: {sorted(ours)} != {sorted(theirs)}"
        for key in ours:
            same_shape(ours[key], theirs[key], f"{where}/{key}")
    elif isinstance(theirs, str):
        assert ours is None or isinstance(ours, str) and re.fullmatch(r"-?\d+\.\d{4}", ours), f"{where}: {ours!r}"
    else:
        assert ours is None or isinstance(ours, (int, float)) and not isinstance(ours, bool), f"{where}: {ours!r}"


def same_values(ours: object, theirs: object, where: str = "") -> int:
    """Every non-null number of ``ours`` equals theirs (a "%.4f" string to its last digit); how many there were."""
    if isinstance(ours, dict):
        return sum(same_values(value, theirs[key], f"{where}/{key}") for key, value in ours.items())
    if ours is None:
        return 0
    assert float(ours) == pytest.approx(float(theirs), rel=1e-9, abs=1.5e-4), f"{where}: {ours} != {theirs}"
    return 1


def written(tmp_path: Path, records: list[dict]) -> dict[str, object]:
    paths = write_specdec(records, RUN, tmp_path / "sweep")
    assert not list((tmp_path / "sweep").rglob("*.tmp"))
    return {p.relative_to(tmp_path / "sweep").as_posix(): json.loads(p.read_text()) for p in paths}


def test_recorded_files_name_one_commit_the_module_cites():
    commits = {re.search(r"^commit: (\w+)$", p.read_text(), re.M)[1] for p in RECORDED.rglob("*.source")}
    assert len(commits) == 1 and commits.pop() in specdec_layout.__doc__


def test_timing_is_upstreams_for_the_same_requests(tmp_path):
    for requests, mode, k in ((SPEC, "speculative_fixed", 3), (TARGET, "target_only", 0)):
        record = our_record(requests, "engine", mode, k, 4)
        assert record["latency_ms_p50"] != record["latency_ms_p99"]  # a swap would show
        theirs, _ = upstream_run(requests, tmp_path / mode)
        ours = written(tmp_path / mode, [record])[f"engine_{mode}_c4/timing.json"]
        assert isinstance(ours, list) and len(ours) == 1  # Metric.write's list, one entry per run
        same_shape(ours[0], theirs)
        assert same_values(ours[0], theirs) == 6  # the TPS pair, E2E, TTFT, generation TPS medians, mean tokens
        for key in ("E2E Request Time", "TTFT Time", "Request Generation Tokens Per Second"):
            assert ours[0][key]["quantiles"]["0.5"] is not None, key


def test_a_p50_p99_swap_or_ms_left_as_seconds_fails_the_comparison(tmp_path):
    record = our_record(SPEC, "engine", "speculative_fixed", 3, 1)
    theirs, _ = upstream_run(SPEC, tmp_path)
    for bad in ({**record, "latency_ms_p50": record["latency_ms_p99"]},
                {**record, "ttft_ms_p50": record["ttft_ms_p50"] / 1000}):
        ours = specdec_results([bad], RUN)["engine_speculative_fixed_c1/timing.json"][0]
        with pytest.raises(AssertionError):
            same_values(ours, theirs)


def test_acceptance_is_upstreams_for_the_same_requests(tmp_path):
    for requests, mode, k in ((SPEC, "speculative_fixed", 3), (TARGET, "target_only", 0)):
        _, theirs = upstream_run(requests, tmp_path / mode)
        ours = written(tmp_path / mode, [our_record(requests, "triton", mode, k, 1)])
        ours = ours[f"triton_{mode}_c1/acceptance_rate.json"][0]
        same_shape(ours, theirs)
        assert len(ours["Request_AL"]) == len(requests) and all(len(t) == 1 for t in ours["Request_AL"].values())
        same_values(ours, theirs)
        assert ours["Joint_Acceptance_Rate"] and ours["Conditional_Acceptance_Rate"]
        if mode == "target_only":
            assert ours == theirs


def test_every_cell_is_a_run_folder_upload_to_s3_finds(tmp_path):
    records = [our_record(SPEC, "engine", "speculative_fixed", 3, 1), our_record(TARGET, "engine", "target_only", 0, 1),
               our_record(SPEC, "triton_stream", "speculative", "adaptive", 4)]
    written(tmp_path, records)
    s3 = upstream("upload_to_s3.py", ["_RUN_SENTINELS", "_is_run_dir", "_discover_runs"], {"Path": Path})
    runs = s3["_discover_runs"](tmp_path / "sweep", "prefix")
    assert len(runs) == len(records) == len({run for run, _ in runs})
    timing, acceptance = upstream_metrics()
    names = {f"{timing(1).name}.json", f"{acceptance().name}.json", *configuration_file_names()}
    for run, _ in runs:
        assert {p.name for p in run.iterdir()} == names and all((run / s).is_file() for s in s3["_RUN_SENTINELS"])
    with pytest.raises(ValueError, match="unique"):
        specdec_results([records[0], dict(records[0])], RUN)


def configuration_file_names() -> set[str]:
    dump_env = next(n for n in ast.walk(ast.parse(recorded("specdec_bench/utils.py").read_text()))
                    if isinstance(n, ast.FunctionDef) and n.name == "dump_env")
    return {n.value for n in ast.walk(dump_env) if isinstance(n, ast.Constant) and str(n.value).endswith(".json")}


def configuration_keys_and_algorithms() -> tuple[set[str], list[str]]:
    """configuration.json's keys as upstream makes them (run.py's options, dump_env's overrides and its own keys),
    and run.py's --speculative_algorithm choices."""
    run_py = ast.parse(recorded("run.py").read_text())
    keys, choices = set(), []
    for node in ast.walk(run_py):
        if not isinstance(node, ast.Call):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        if getattr(node.func, "attr", None) == "add_argument" and node.args[0].value.startswith("--"):
            keys.add(kw["dest"].value if "dest" in kw else node.args[0].value.lstrip("-").replace("-", "_"))
            if node.args[0].value == "--speculative_algorithm":
                choices = ast.literal_eval(kw["choices"])
        elif getattr(node.func, "id", None) == "dump_env":
            keys |= {k.value for k in kw["overrides"].keys}
    dump_env = next(n for n in ast.walk(ast.parse(recorded("specdec_bench/utils.py").read_text()))
                    if isinstance(n, ast.FunctionDef) and n.name == "dump_env")
    keys |= {t.slice.value for n in ast.walk(dump_env) if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Subscript) and getattr(t.value, "id", None) == "config"}
    return keys, choices


def test_configuration_has_upstreams_keys_and_algorithm_names(tmp_path):
    keys, choices = configuration_keys_and_algorithms()
    assert len(keys) > 30 and "container_image" in keys and choices
    records = [our_record(SPEC, "engine", "speculative_fixed", 3, 4), our_record(TARGET, "openai", "target_only", 0, 1)]
    for method in ("eagle3", "ngram", "draft_model"):
        records.append({**our_record(SPEC, "triton", method, "adaptive", 2), "method": method})
    configs = [c for name, c in written(tmp_path, records).items() if name.endswith("/configuration.json")]
    assert len(configs) == len(records)
    for config, record in zip(configs, records):
        assert set(config) == keys
        assert config["speculative_algorithm"] in choices, config["speculative_algorithm"]
        assert (config["concurrency"], config["num_requests"]) == (record["concurrency"], record["requests"])
        assert config["draft_length"] == (3 if record["k"] == 3 else None)
    assert configs[1]["speculative_algorithm"] == "NONE" and configs[0]["output_length"] == RUN["options"]["max_tokens"]


def test_the_steps_histogram_gives_upstreams_rates_at_any_k(tmp_path):
    """A path that reports every step (engine, gRPC stream) gives the steps' histogram: the same histogram, joint
    and conditional rates as upstream's for the same requests, whether K was fixed or chosen per step."""
    _, theirs = upstream_run(SPEC, tmp_path / "upstream")
    for mode, k in (("speculative_fixed", 3), ("speculative", "adaptive")):
        record = {**our_record(SPEC, "triton_stream", mode, k, 2), "per_position_acceptance": None}
        ours = specdec_results([record], RUN)[f"triton_stream_{mode}_c2/acceptance_rate.json"][0]
        assert ours["Acceptance_Length_Histogram"] == {str(k): v for k, v in theirs["Acceptance_Length_Histogram"].items()}
        for key in ("Joint_Acceptance_Rate", "Conditional_Acceptance_Rate"):
            assert ours[key].keys() == theirs[key].keys() and same_values(ours[key], theirs[key]) == len(theirs[key])


def test_unmeasured_values_are_null_and_adaptive_k_has_no_step_rates(tmp_path):
    record = {**our_record(SPEC, "triton", "speculative", "adaptive", 4), "ttft_ms_p50": None, "ttft_ms_p99": None,
              "tpot_ms_p50": None, "per_position_acceptance": None, "tokens_per_step_histogram": None}
    _, theirs_acceptance = upstream_run(SPEC, tmp_path / "upstream")
    files = written(tmp_path, [record])
    timing = files["triton_speculative_c4/timing.json"][0]
    acceptance = files["triton_speculative_c4/acceptance_rate.json"][0]
    assert timing["TTFT Time"]["quantiles"] == {"0.25": None, "0.5": None, "0.75": None}
    assert timing["Request Generation Tokens Per Second"]["quantiles"]["0.5"] is None
    assert acceptance["Joint_Acceptance_Rate"] == {} == acceptance["Conditional_Acceptance_Rate"]
    assert same_values(acceptance["Request_AL"], theirs_acceptance["Request_AL"]) == len(SPEC)


def test_upstream_times_are_seconds():
    """Why our ms are divided by 1000: the engines' token_times, which Timing subtracts, are perf_counter()s."""
    vllm = recorded("specdec_bench/models/vllm.py").read_text()
    assert re.search(r"timing\.append\(time\.perf_counter\(\)\)", vllm) and 'output_dict["token_times"]' in vllm
