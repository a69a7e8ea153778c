"""pipeline/triton/server.py without a server: scratch folders of killed serves are swept."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def test_scratch_folders_of_killed_serves_are_swept(tmp_path):
    from pipeline.triton.server import sweep_dead_scratch

    dead = subprocess.Popen(["true"])
    dead.wait()
    mine = Path(tempfile.mkdtemp(prefix=f"specpipe-triton-{os.getpid()}-"))
    left = Path(tempfile.mkdtemp(prefix=f"specpipe-triton-{dead.pid}-"))
    (left / "backends").mkdir()
    try:
        sweep_dead_scratch()
        assert not left.exists() and mine.exists()  # a live serve's folder (this process) is kept
    finally:
        shutil.rmtree(mine, ignore_errors=True)
        shutil.rmtree(left, ignore_errors=True)


def test_model_processes_left_by_a_killed_serve_are_killed_with_its_folder():
    from pipeline.triton.server import sweep_dead_scratch

    dead = subprocess.Popen(["true"])
    dead.wait()
    left = Path(tempfile.mkdtemp(prefix=f"specpipe-triton-{dead.pid}-"))
    stub = left / "backends" / "python" / "triton_python_backend_stub"
    stub.parent.mkdir(parents=True)
    stub.symlink_to(shutil.which("sleep"))
    orphan = subprocess.Popen([str(stub), "600"])  # what a stuck model process looks like after its server left
    bystander = subprocess.Popen(["sleep", "600"])
    try:
        sweep_dead_scratch()
        assert orphan.wait(timeout=10) == -9
        assert bystander.poll() is None  # only processes run from the dead server's folder
    finally:
        for process in (orphan, bystander):
            process.kill()
            process.wait()
        shutil.rmtree(left, ignore_errors=True)
