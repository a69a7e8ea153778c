"""bench-serve's cells in the result layout of NVIDIA ModelOpt's speculative-decoding benchmark, so our numbers sit
beside vLLM's, SGLang's and TensorRT-LLM's measured with it.

The layout is the one NVIDIA/Model-Optimizer ``examples/specdec_bench`` writes at commit
a2fbac7bad8ab446d3f8783dadb0c3366eb0ad73 (its files recorded in tests/data/specdec_bench_recorded, each with a
``.source``). One ``run.py`` invocation (one engine, algorithm, draft length and concurrency) fills one directory
(``--save_dir``) with

  configuration.json    ``utils.dump_env``: ``vars(args)`` (every run.py option), ``serving_config``, provenance
  timing.json           ``metrics.Timing``: a JSON list, one dict per invocation (``Metric.write`` appends)
  acceptance_rate.json  ``metrics.AcceptanceRate``: the same list form

and several runs sit side by side as ``upload_to_s3.py``'s sweep: ``SWEEP/run_name/{configuration,timing,...}.json``.
Our cell, one (path, mode, concurrency), is such a run, so ``specdec_results`` returns several files keyed by their
path under the sweep folder (``"engine_speculative_fixed_c4/timing.json"``), and ``write_specdec`` writes them
there, each whole (a fresh one-element list, not appended to an earlier file).

Units and forms are upstream's: ``token_times`` are ``time.perf_counter()`` seconds, so every time is in seconds
(ours are ms: divided by 1000); a distribution is ``compute_statistics``' dict of ``"%.4f"`` strings
(min, max, mean, std, quantiles 0.25/0.5/0.75); "Output TPS" is a plain float in tokens/s.

What maps (ours -> theirs):
  tokens_per_s                  -> "Output TPS" (total output tokens over first send to last token); "Output TPS/gpu"
                                   the same over tp_size = 1 (our engine runs on one device)
  latency_ms_p50 / 1000         -> "E2E Request Time" quantile 0.5 (send to last token, per request)
  ttft_ms_p50 / 1000            -> "TTFT Time" quantile 0.5
  1000 / tpot_ms_p50            -> "Request Generation Tokens Per Second" quantile 0.5: theirs per request is
                                   (tokens - 1) / (last - first token), 1 / TPOT; the median of 1/x is 1 / the median
                                   of x (exact for an odd request count, the neighbouring value's for an even one)
  tokens / requests             -> "Number of Output Tokens" mean
  acceptance_length_per_request -> "Request_AL" {request index: {"0": AL}} (our prompts are single-turn)
  acceptance_length             -> "Average_AL" (both the mean over requests of tokens per target step)
  tokens_per_step_histogram     -> "Acceptance_Length_Histogram" (steps by tokens emitted, where the path reports every
                                   step: engine, triton_stream) and from it "Joint_Acceptance_Rate" /
                                   "Conditional_Acceptance_Rate" as upstream derives them; else
  per_position_acceptance       -> "Joint_Acceptance_Rate" / "Conditional_Acceptance_Rate", keyed by tokens per step
                                   L: joint[L] = P(a step emits >= L tokens) = per_position[L - 2], conditional[L] =
                                   joint[L] / joint[previous L]; only lengths that occur (joint[L] > joint[L + 1]) are
                                   keys, as upstream's histogram-driven loop makes them. Only where every verify step
                                   drafted all K positions (an int K, mean_draft_len == K): ours are fractions among
                                   the steps that drafted a position, theirs among all steps, the same only then
  target_only                   -> every step emits one token by definition: Request_AL 1.0 per request, histogram
                                   {"1": tokens}, both rates {"1": 1.0}, as upstream computes them for a NONE run
  path, method, k, concurrency, run model/draft/options/machine -> configuration.json (engine "SPECPIPE_<PATH>",
                                   speculative_algorithm in run.py's spelling: EAGLE3, DRAFT_TARGET, NGRAM, NONE
                                   for target_only, and a method it has no choice for upper-cased: MEDUSA, SUFFIX)
Unknown values are null (a distribution's other statistics, a path's missing measurement) and dicts with no data are
empty, so every key upstream writes is present.

Ours with no equivalent: p99s (upstream keeps quartiles), itl (ours per token, theirs "Request Generation Step Time"
per engine step, first gap included: written all null), tokens_per_s_min/median/max and rounds (upstream runs once;
the cell's values are its median round's), requests_per_s, mean_draft_len, acceptance_rate (accepted / drafted),
acceptance_length_histogram (ours counts requests by AL; theirs, steps by tokens, is our
tokens_per_step_histogram, empty on a path that reports no steps), exact_match, weight_gb_per_s, prefix_hit_rate, occupancy (kept under serving_config: path, mode,
method, k, options). Theirs with none of ours: aa_timing.json (tiktoken counts of decoded text), responses.jsonl (the
texts), mtbench/specbench Category_AL, and provenance such as container_image (upload_to_s3 refuses a run without it
unless told to allow it). Upstream's step lengths also count the prefill's one-token step; ours count verify steps.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from pathlib import Path

QUANTILES = ("0.25", "0.5", "0.75")  # compute_statistics' default quantiles, keyed f"{q}"
ALGORITHMS = {"eagle3": "EAGLE3", "draft_model": "DRAFT_TARGET", "ngram": "NGRAM"}  # ours -> run.py's choices


def _fmt(value: float | None) -> str | None:
    return None if value is None else f"{value:.4f}"


def _stats(mean: float | None = None, median: float | None = None) -> dict[str, object]:
    """compute_statistics' dict with only what our record holds; the rest null."""
    return {"min": None, "max": None, "mean": _fmt(mean), "std": None,
            "quantiles": {q: _fmt(median) if q == "0.5" else None for q in QUANTILES}}


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def _timing(record: dict) -> dict[str, object]:
    tpot = record.get("tpot_ms_p50")
    tps = record["tokens_per_s"]
    requests = record.get("requests")
    return {"Output TPS": tps, "Output TPS/gpu": tps,  # tp_size 1
            "E2E Request Time": _stats(median=_seconds(record.get("latency_ms_p50"))),
            "TTFT Time": _stats(median=_seconds(record.get("ttft_ms_p50"))),
            "Request Generation Step Time": _stats(),
            "Request Generation Tokens Per Second": _stats(median=1000 / tpot if tpot else None),
            "Number of Output Tokens": _stats(mean=record["tokens"] / requests if requests else None)}


def _target_only(record: dict) -> bool:
    return record["mode"] == "target_only" or record.get("k") == 0


def _position_histogram(record: dict) -> dict[str, float] | None:
    """The share of steps that emitted each number of tokens, from per-position fractions, where they describe every
    step (see the module doc); None elsewhere."""
    k, per_position = record.get("k"), record.get("per_position_acceptance")
    full = (isinstance(k, int) and per_position is not None and len(per_position) == k
            and record.get("mean_draft_len") is not None and abs(record["mean_draft_len"] - k) < 5e-4)
    if not full or any(b > a for a, b in zip(per_position, per_position[1:])):
        return None
    at_least = [1.0, *per_position, 0.0]  # at_least[L - 1] = P(a step emits >= L tokens), L = 1 .. K + 2
    shares = {str(length): at_least[length - 1] - at_least[length] for length in range(1, k + 2)}
    return {length: share for length, share in shares.items() if share > 0}  # lengths some step emitted


def _acceptance(record: dict) -> dict[str, object]:
    if _target_only(record):
        ones = {"1": 1.0}
        return {"Request_AL": {str(i): {"0": 1.0} for i in range(record["requests"])}, "Average_AL": 1.0,
                "Acceptance_Length_Histogram": {"1": record["tokens"]}, "Conditional_Acceptance_Rate": ones,
                "Joint_Acceptance_Rate": dict(ones)}
    per_request = record.get("acceptance_length_per_request") or []
    histogram = record.get("tokens_per_step_histogram")
    shares = histogram or _position_histogram(record)
    joint, conditional = _histogram_rates(shares) if shares else ({}, {})
    return {"Request_AL": {str(i): {"0": al} for i, al in enumerate(per_request)},
            "Average_AL": record.get("acceptance_length"), "Acceptance_Length_Histogram": histogram or {},
            "Conditional_Acceptance_Rate": conditional, "Joint_Acceptance_Rate": joint}


def _histogram_rates(histogram: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """Joint and conditional acceptance by tokens per step from the steps' histogram (counts or shares), as upstream
    derives them from its own: joint[L] = the share of steps that emitted >= L tokens, conditional[L] = joint[L] /
    joint[the previous length that occurred]."""
    total = sum(histogram.values())
    joint: dict[str, float] = {}
    conditional: dict[str, float] = {}
    at_least, previous = total, 1.0
    for length, count in sorted(histogram.items(), key=lambda item: int(item[0])):
        joint[length] = at_least / total
        conditional[length] = joint[length] / previous
        previous = joint[length]
        at_least -= count
    return joint, conditional


def _algorithm(record: dict) -> str:
    if _target_only(record):
        return "NONE"
    method = str(record.get("method") or record["mode"])
    return ALGORITHMS.get(method, method.upper())


def _utc(stamp: str | None) -> str | None:
    """Our timestamp as upstream writes its own: datetime.now(timezone.utc).isoformat()."""
    try:
        return datetime.fromisoformat(stamp).astimezone(timezone.utc).isoformat() if stamp else None
    except ValueError:
        return stamp


def _configuration(record: dict, run: dict, name: str) -> dict[str, object]:
    """configuration.json: run.py's options (vars(args)), serving_config, then dump_env's provenance keys."""
    options, machine, k = run.get("options") or {}, run.get("machine") or {}, record.get("k")
    prompt_set, speculative = options.get("prompt_set"), not _target_only(record)
    args = {"tokenizer": run.get("model"), "mtbench": None, "specbench": None, "random_isl": None,
            "dataset": prompt_set, "dataset_path": None, "num_requests": record.get("requests"),
            "engine": f"SPECPIPE_{record['path'].upper()}", "speculative_algorithm": _algorithm(record),
            "model_dir": run.get("model"), "draft_model_dir": run.get("draft") if speculative else None,
            "runtime_params": {}, "temperature": 0.0 if options.get("decoding") == "greedy" else None,
            "max_seq_len": None, "output_length": options.get("max_tokens"),
            "draft_length": k if isinstance(k, int) and speculative else None, "block_size": None,
            "tp_size": 1, "ep_size": 1, "concurrency": record["concurrency"], "trust_remote_code": False,
            "aa_timing": False, "ignore_eos": options.get("ignore_eos"), "show_progress": False,
            "completions": None if prompt_set is None else prompt_set != "chat", "postprocess": "base",
            "save_dir": name}
    serving = {"config": run.get("config"), "path": record["path"], "mode": record["mode"],
               "method": record.get("method"), "k": k, "git_commit": run.get("git_commit"),
               "finished": run.get("finished"), "options": options, "machine": machine}
    provenance = {"engine_version": None, "gpu": machine.get("gpu"), "python_version": machine.get("python"),
                  "argv": None, "specdec_bench_version": None, "specdec_bench_sha": None, "modelopt_version": None,
                  "modelopt_sha": None, "nmm_sandbox_sha": None, "container_image": None,
                  "checkpoint": {"path": run.get("model")}, "timestamp": _utc(run.get("started")),
                  "jira_ticket": None, "huggingface_model_id": None}
    return {**args, "serving_config": serving, **provenance}


def run_name(record: dict) -> str:
    """A cell's run folder: its (path, mode, concurrency), in characters any file system takes."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"{record['path']}_{record['mode']}_c{record['concurrency']}")


def specdec_results(records: list[dict], run: dict) -> dict[str, object]:
    """Every cell as a specdec_bench run: {"<run>/<file>.json": JSON-able content} (see the module doc)."""
    files: dict[str, object] = {}
    for record in records:
        name = run_name(record)
        if f"{name}/timing.json" in files:
            raise ValueError(f"two cells share the run folder {name}: (path, mode, concurrency) must be unique")
        files[f"{name}/configuration.json"] = _configuration(record, run, name)
        files[f"{name}/timing.json"] = [_timing(record)]
        files[f"{name}/acceptance_rate.json"] = [_acceptance(record)]
    return files


def write_specdec(records: list[dict], run: dict, out_dir: Path) -> list[Path]:
    """Write specdec_results under ``out_dir`` (the sweep folder), each file whole through a temporary file."""
    written = []
    for relative, content in specdec_results(records, run).items():
        path = out_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(content, indent=4) + "\n")
        tmp.replace(path)
        written.append(path)
    return written
