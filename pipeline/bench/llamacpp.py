"""llama.cpp's `llama-bench` as a reference point in `bench`: decode tokens/s of GGUF files of the same model.

`--llamacpp PATH` names the llama-bench binary; each `--llamacpp-gguf FILE` is run once, after our own records are
measured, as `llama-bench -m FILE -t THREADS -p 0 -n N -r R -o json` (THREADS = torch's thread count, N = the
bench's --max-new-tokens, R = its --repeats). Its JSON output becomes one record per GGUF and prompt set with
method "llamacpp" and K 0, beside ours in the table and results.json.

llama-bench's decode test (`-p 0`) generates N tokens from an empty context, not from our prompts: it measures the
same model's per-token cost at short context, which is what target-only decoding is compared with.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import PipelineError

# A decode run of a 135M model takes seconds; an 8B one at float32 on a laptop, minutes. Past this it is hung.
TIMEOUT_S = 1800
BUILD_HINT = "build it from llama.cpp (README: 'llama.cpp as a reference')"


@dataclass(frozen=True)
class LlamaBenchResult:
    """One GGUF's decode test, as llama-bench reported it."""

    file: Path
    model_type: str  # llama-bench's model description: architecture, size, weight type ("llama 135M Q8_0")
    precision: str  # the weight type in it, lower case: f32, bf16, q8_0, q4_1, q4_k...
    weight_bytes: int  # model_size: bytes of the tensors in the file
    n_threads: int
    n_gen: int
    tokens_per_s: float  # avg_ts: mean over the repetitions of n_gen / seconds
    stddev_tokens_per_s: float
    repetitions: int
    build_commit: str  # "unknown" when llama.cpp was built from a source tree without .git (the PyPI sdist)
    build_number: int
    cpu_info: str


def precision_of(model_type: str) -> str:
    """The weight type in llama-bench's model description, lower case: "llama 135M all F32" -> "f32"."""
    words = model_type.replace("(guessed)", "").split()
    # The description is "<arch> <size> <type name>"; llama.cpp names an all-float32 file "all F32".
    rest = [w for w in words[2:] if w != "all"]
    return rest[0].lower() if rest else "unknown"


def parse_llama_bench(text: str, file: Path) -> LlamaBenchResult:
    """The decode test (n_prompt 0, n_gen > 0) of llama-bench's `-o json` output for ``file``."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PipelineError(f"--llamacpp: llama-bench printed no JSON for {file} ({exc}); check that the binary is "
                            f"llama-bench and accepts -o json") from None
    tests = tests if isinstance(tests, list) else []
    decode = [t for t in tests if isinstance(t, dict) and t.get("n_prompt") == 0 and t.get("n_gen", 0) > 0]
    if not decode:
        raise PipelineError(f"--llamacpp: llama-bench's JSON for {file} holds no decode test (n_prompt 0, n_gen > 0); "
                            f"check that the binary is llama-bench")
    test = decode[0]
    try:
        return LlamaBenchResult(
            file=file, model_type=str(test["model_type"]), precision=precision_of(str(test["model_type"])),
            weight_bytes=int(test["model_size"]), n_threads=int(test["n_threads"]), n_gen=int(test["n_gen"]),
            tokens_per_s=float(test["avg_ts"]), stddev_tokens_per_s=float(test.get("stddev_ts") or 0.0),
            repetitions=len(test.get("samples_ts") or []), build_commit=str(test.get("build_commit", "unknown")),
            build_number=int(test.get("build_number") or 0), cpu_info=str(test.get("cpu_info", "")))
    except (KeyError, TypeError, ValueError) as exc:
        raise PipelineError(f"--llamacpp: llama-bench's JSON for {file} lacks or garbles {exc}; a llama-bench older "
                            f"or newer than this reader? Use one whose -o json has model_type, model_size, "
                            f"n_threads, avg_ts") from None


def check_binary(binary: Path) -> Path:
    """``binary`` if it is an executable file, else the PipelineError that says how to get one."""
    if not binary.exists():
        raise PipelineError(f"--llamacpp: {binary} does not exist; pass the path of the llama-bench binary, or "
                            f"{BUILD_HINT}")
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise PipelineError(f"--llamacpp: {binary} is not an executable file; pass the llama-bench binary itself "
                            f"(build/bin/llama-bench), or chmod +x it")
    return binary


def check_gguf(gguf: Path) -> Path:
    if not gguf.is_file():
        raise PipelineError(f"--llamacpp-gguf: {gguf} does not exist or is not a file; pass a .gguf file of the "
                            f"target model (llama-quantize makes F32/BF16/Q8_0 ones from the source GGUF)")
    return gguf


def run_llama_bench(binary: Path, gguf: Path, threads: int, n_gen: int, repetitions: int,
                    timeout_s: float = TIMEOUT_S) -> LlamaBenchResult:
    """Run llama-bench's decode test on one GGUF and parse what it printed."""
    command = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(n_gen),
               "-r", str(repetitions), "-o", "json"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise PipelineError(f"--llamacpp: llama-bench on {gguf} ran past {timeout_s:.0f} s; pass fewer "
                            f"--max-new-tokens or --repeats, or a smaller --llamacpp-gguf") from None
    except OSError as exc:  # not a binary for this machine, or a script without an interpreter line
        raise PipelineError(f"--llamacpp: {binary} cannot be run ({exc.strerror or exc}); pass a llama-bench built "
                            f"for this machine, or {BUILD_HINT}") from None
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout or "").splitlines() if line.strip()]
        last = lines[-1][:300] if lines else "no output"
        raise PipelineError(f"--llamacpp-gguf: llama-bench failed on {gguf} (exit {done.returncode}: {last}); "
                            f"check that llama.cpp supports this GGUF's architecture and type, or run "
                            f"{' '.join(command)} to see all it printed")
    return parse_llama_bench(done.stdout, gguf)


def default_ggufs(target_model: str, base_dir: Path, cache: Path) -> list[Path]:
    """The GGUF the config's target came from: the target itself when it is a .gguf file, else the file named by
    the target folder's source.json (`gguf_file`, written when it was dequantized) in ``cache``/gguf."""
    target = (base_dir / os.path.expanduser(target_model)).resolve()
    if target.is_file() and target.suffix.lower() == ".gguf":
        return [target]
    source = target / "source.json"
    name = None
    if source.is_file():
        try:
            name = json.loads(source.read_text()).get("gguf_file")
        except (json.JSONDecodeError, AttributeError):
            name = None
    found = cache / "gguf" / name if isinstance(name, str) and name else None
    if found is None or not found.is_file():
        what = (f"its source.json names {name}, which is not in {cache / 'gguf'}" if found is not None
                else "it was not made from a GGUF (no gguf_file in a source.json)")
        raise PipelineError(f"--llamacpp-gguf: no GGUF of the target {target_model} found ({what}); pass "
                            f"--llamacpp-gguf FILE, a GGUF of the same model")
    return [found]


@dataclass(frozen=True)
class LlamaCppPlan:
    """What `bench --llamacpp` will run, checked before anything is measured so a bad path fails at once."""

    binary: Path
    ggufs: list[Path]


def plan_from_args(binary: Path | None, ggufs: list[Path], config) -> LlamaCppPlan | None:
    """None without --llamacpp; else the checked binary and GGUFs (default: the target's source GGUF)."""
    if binary is None:
        if ggufs:
            raise PipelineError("--llamacpp-gguf: it needs --llamacpp PATH, the llama-bench binary that runs it")
        return None
    from ..artifacts import cache_root

    check_binary(binary)
    files = ggufs or default_ggufs(config.target.model, config.base_dir, cache_root())
    return LlamaCppPlan(binary, [check_gguf(f) for f in files])


def llamacpp_records(results: list[LlamaBenchResult], sets: list[str]) -> list[dict]:
    """One record per GGUF and prompt set ("-" without sets), shaped like records.make_record's; the fields that
    describe speculation or our latency are None. weight_gbs is the bytes of weights read per second when every
    token reads them all once: weight_bytes * tokens/s."""
    records = []
    for name in sets or ["-"]:
        for result in results:
            records.append({
                "method": "llamacpp", "k": 0, "set": name, "prompt_set": name,
                "tokens_per_s": round(result.tokens_per_s, 2), "decode_tokens_per_s": round(result.tokens_per_s, 2),
                "speedup_vs_target": None, "acceptance_rate": None, "alpha": None, "mean_accepted_len": None,
                "mean_draft_len": None, "acceptance_by_position": [], "cost_ratio_c": None, "verify_cost_ratio": None,
                "bound_speedup": None, "bound_speedup_refined": None, "predicted_speedup": None,
                "efficiency": None, "efficiency_refined": None, "itl_ms_p50": None, "itl_ms_p90": None,
                "ttft_ms": None, "fraction_of_memory_bound": None,
                "tokens": result.n_gen, "target_steps": None, "prompts": None, "repeats": result.repetitions,
                "precision": result.precision, "weight_bytes": result.weight_bytes,
                "weight_gbs": round(result.weight_bytes * result.tokens_per_s / 1e9, 3),
                "stddev_tokens_per_s": round(result.stddev_tokens_per_s, 2), "n_threads": result.n_threads,
                "gguf_file": str(result.file), "model_type": result.model_type,
            })
    return records


def summary_line(results: list[LlamaBenchResult]) -> str:
    """"llama.cpp (build X, N threads): f32 A tok/s, bf16 B tok/s, q8_0 C tok/s"."""
    first = results[0]
    return (f"llama.cpp (build {first.build_commit}, {first.n_threads} threads): "
            + ", ".join(f"{r.precision} {r.tokens_per_s:.1f} tok/s" for r in results))


def comparison_line(records: list[dict]) -> str | None:
    """Our target-only decoding against llama.cpp's, per prompt set: decode tokens/s (after the first token, as
    llama-bench's decode test has no prompt) over each GGUF's. None without both."""
    ours = [r for r in records if r["method"] == "target" and r.get("decode_tokens_per_s")]
    theirs = {r["precision"]: r["tokens_per_s"] for r in records if r["method"] == "llamacpp" and r["tokens_per_s"]}
    if not ours or not theirs:
        return None
    return "target-only decode tok/s (first token excluded) over llama.cpp's: " + "; ".join(
        f"{precision} " + ", ".join(f"{r['set']} {r['decode_tokens_per_s'] / rate:.2f}" for r in ours)
        for precision, rate in theirs.items())


def run_llamacpp(plan: LlamaCppPlan, threads: int, n_gen: int, repetitions: int,
                 sets: list[str]) -> tuple[list[dict], dict, str]:
    """Run every GGUF of ``plan``: (records, the results.json "llamacpp" entry, the summary line)."""
    results = [run_llama_bench(plan.binary, gguf, threads, n_gen, repetitions) for gguf in plan.ggufs]
    first = results[0]
    info = {"binary": str(plan.binary), "build_commit": first.build_commit, "build_number": first.build_number,
            "cpu_info": first.cpu_info, "n_threads": threads, "n_gen": n_gen, "repetitions": repetitions,
            "ggufs": [{"file": str(r.file), "model_type": r.model_type, "precision": r.precision,
                       "weight_bytes": r.weight_bytes, "tokens_per_s": r.tokens_per_s,
                       "stddev_tokens_per_s": r.stddev_tokens_per_s} for r in results],
            "test": "llama-bench -p 0: decode of n_gen tokens from an empty context (not our prompts)"}
    return llamacpp_records(results, sets), info, summary_line(results)
