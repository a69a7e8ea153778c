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
