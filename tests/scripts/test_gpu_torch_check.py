"""scripts/gpu_torch_check.py: the torch-backend GPU check, run here in tiny mode on the CPU (its full size runs only
where CUDA is available)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_torch_check.py"
TOP_KEYS = {"env", "torch", "device_name", "dtype", "models", "verify_cost", "generation", "parity", "result",
            "exit_code", "summary", "seconds"}
PLANS = ["target-only K=0", "self-draft K=2", "self-draft K=4", "self-draft K=6", "target-as-draft K=4"]


def _run(tmp_path: Path, *args: str, timeout: int) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    path = tmp_path / "gpu_torch_check.json"
    assert path.is_file(), proc.stdout + proc.stderr
    return proc, json.loads(path.read_text())


def _check_report(proc: subprocess.CompletedProcess, report: dict) -> None:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert TOP_KEYS <= set(report)
    assert report["result"] == "PASS" and report["exit_code"] == 0
    ks = [row["k"] for row in report["verify_cost"]]
    assert ks == list(range(9))
    assert all(row["ms"] > 0 and row["ratio"] > 0 for row in report["verify_cost"])
    assert report["verify_cost"][0]["ratio"] == pytest.approx(1.0)
    by_name = {g["name"]: g for g in report["generation"]}
    assert list(by_name) == PLANS
    assert all(g["tok_s"] > 0 and g["speedup"] > 0 for g in by_name.values())
    assert by_name["target-only K=0"]["mean_accepted_len"] == pytest.approx(1.0)
    assert by_name["target-as-draft K=4"]["acceptance_rate"] == pytest.approx(1.0)  # the loop's upper bound
    assert by_name["self-draft K=2"]["acceptance_rate"] > 0.2  # the self-draft shares the target's behaviour
    assert [p["label"] for p in report["parity"]][-1] == "target-only vs HF generate"
    assert all(p["status"] == "PASS" for p in report["parity"])
    assert "== summary" in proc.stdout and report["device_name"] in report["summary"]


def test_tiny_cpu_run_passes_and_writes_the_json(tmp_path):
    proc, report = _run(tmp_path, "--device", "cpu", "--dtype", "float32", "--tiny", timeout=180)
    _check_report(proc, report)
    assert report["dtype"] == "float32"
    # float32: greedy speculative decoding is token-identical to target-only and to Hugging Face generate
    assert all(p["identical"] == p["prompts"] for p in report["parity"])


def test_no_cuda_is_an_environment_problem(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc, report = _run(tmp_path, "--device", "cuda", timeout=120)
    assert proc.returncode == 2 and report["result"].startswith("ENV"), proc.stdout


def test_helper_modes_need_only_the_standard_library():
    """gpu_wheels.sh and gpu_torch_check.sh call these before anything but Python is known to work."""
    code = ("import runpy, sys; sys.argv = ['x', '--wheel-list', 'all']; "
            "sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            "runpy.run_path(%r, run_name='__main__')" % str(SCRIPT))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    wheels = proc.stdout.split()
    assert "transformers==5.24.0" in wheels and not any(w.startswith("torch==") for w in wheels)
    # this environment has everything, so nothing is to be installed
    proc = subprocess.run([sys.executable, str(SCRIPT), "--missing-deps"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "", proc.stdout + proc.stderr


def _module():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_torch_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return gpu_torch_check


def test_wheel_list_pins_match_this_environment():
    """The carried wheels are the versions the test suite runs with, which `make` installs from constraints.txt."""
    import importlib.metadata

    module = _module()
    for dist, version, _, _ in module.WHEELS:
        assert importlib.metadata.version(dist) == version, dist
    pinned = [line for line in (REPO / "constraints.txt").read_text().splitlines() if line and line[0] != "#"]
    assert pinned == module.wheel_list("all")


def test_parity_rule_tolerates_near_ties_and_fails_clear_divergences(monkeypatch):
    """A divergence onto the target's second-best token passes when the top-2 margin is within the threshold and
    fails when it is not; one onto its worst token always fails."""
    import torch

    import pipeline.parity

    g = _module()
    target, _ = g.build_models(g.TINY, "cpu", torch.float32, 0, 0.1)
    prompt = [5, 17, 42, 99, 7]
    plain = g.hf_generate(target, [prompt], 8, "cpu")[0]
    with torch.inference_mode():
        logits = target(input_ids=torch.tensor([prompt + plain[:3]])).logits[0, -1].float()
    order = logits.argsort(descending=True).tolist()
    assert order[0] == plain[3]
    margin = float(logits[order[0]] - logits[order[1]])
    near = plain[:3] + [order[1]] + plain[4:]
    clear = plain[:3] + [order[-1]] + plain[4:]

    monkeypatch.setattr(pipeline.parity, "MARGIN_THRESHOLD", margin + 1e-4)
    ok = g.parity_check(target, [prompt], [plain], [near], "near", "cpu")
    row = ok["rows"][0]
    assert ok["status"] == "PASS" and row["position"] == 3 and row["near_tie"]
    assert row["margin"] == pytest.approx(margin, abs=1e-5) and row["gap"] == pytest.approx(margin, abs=1e-5)
    assert g.parity_check(target, [prompt], [plain], [clear], "clear", "cpu")["status"] == "FAIL"
    monkeypatch.setattr(pipeline.parity, "MARGIN_THRESHOLD", margin / 2)
    assert g.parity_check(target, [prompt], [plain], [near], "near", "cpu")["status"] == "FAIL"


@pytest.mark.gpu
@pytest.mark.slow
def test_full_size_on_cuda(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the full-size check (~0.85B bf16 target) runs only on a GPU")
    proc, report = _run(tmp_path, "--device", "cuda", "--dtype", "bfloat16", timeout=600)
    _check_report(proc, report)
    assert report["models"]["target_params"] > 8e8
