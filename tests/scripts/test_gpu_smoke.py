"""scripts/gpu_smoke.sh: it stops at step 1 when the installed TensorRT-LLM is another release."""

from __future__ import annotations

import os
import subprocess
import sys

from pipeline.backends.trtllm_api import PINNED_VERSION
from tests.conftest import REPO


def test_gpu_smoke_script_fails_on_a_version_mismatch(tmp_path):
    """Step 1 of scripts/gpu_smoke.sh against a FAKE tensorrt_llm package of another release: it must exit."""
    assert subprocess.run(["bash", "-n", str(REPO / "scripts" / "gpu_smoke.sh")]).returncode == 0
    fake = tmp_path / "site" / "tensorrt_llm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "1.2.1"\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "python3"  # the script runs python3; give it this venv's interpreter (torch)
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(tmp_path / "site"),
           "SMOKE_DIR": str(tmp_path / "smoke")}
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_smoke.sh")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode != 0
    assert f"installed TensorRT-LLM is 1.2.1 but this pipeline is pinned to {PINNED_VERSION}" in done.stderr
    assert "== 2." not in done.stdout  # stopped before any build


def test_every_test_file_the_script_runs_exists():
    """The smoke test's step 1 runs named test files: one renamed away would stop it on the GPU box, untested here."""
    import re

    named = set(re.findall(r"tests/[\w/]+\.py", (REPO / "scripts" / "gpu_smoke.sh").read_text()))
    assert named and all((REPO / path).is_file() for path in named), sorted(named)
