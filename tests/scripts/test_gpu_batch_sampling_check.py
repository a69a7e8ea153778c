"""scripts/gpu_batch_sampling_check.py: every kind of row in one batch, run here on the CPU (on a GPU box with CUDA)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_batch_sampling_check.py"


def test_passes_on_the_cpu():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and report["ok"], proc.stdout + proc.stderr
    assert report["rows"] == 8 and report["drafted"] > 0 and report["problems"] == []


@pytest.mark.gpu
def test_passes_on_cuda():
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
