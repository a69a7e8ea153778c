"""Stage outputs that describe themselves: atomic folders, manifests, "up to date" checks and a build lock.

A stage writes into ``<out>.tmp-<pid>`` and renames it to ``<out>`` only after ``manifest.json`` (written last) is
in place, so a killed build never leaves a folder that looks complete. The manifest records a key over the
stage's inputs (content hashes, resolved config, versions); the next run compares keys and skips the stage, once
it has checked that the outputs are still the ones the manifest lists (verify_outputs).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import stat
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

from .errors import EngineError

MANIFEST = "manifest.json"
SCHEMA_VERSION = 1
# Outputs this small (engine.json, config.json, tokenizer files) are hashed on every up-to-date decision: a hand
# edit that keeps size and mtime is still caught. Larger ones (weights) are compared by size and mtime, and hashed
# only when those differ or with --verify.
ALWAYS_HASHED_BYTES = 1 << 20
# errno values that mean the file system is full, in OSError or in the "(os error N)" of safetensors' Rust errors.
_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
         errno.EFBIG: "File too large"}


def cache_root() -> Path:
    """Where fetched and dequantized models and measured kernel plans are kept: $SPECPIPE_CACHE, else
    ~/.cache/specpipe."""
    return Path(os.environ.get("SPECPIPE_CACHE") or Path.home() / ".cache" / "specpipe")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def content_hashes(folder: Path, skip: tuple[str, ...] = (MANIFEST,)) -> dict[str, str]:
    """sha256 of every file under ``folder`` (relative path -> hex digest).

    Hub snapshots are symlinks into ``blobs/<sha256>`` for large files; that name already is the content hash,
    so multi-GB weights are not read again.
    """
    hashes = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel in skip or "/." in f"/{rel}":
            continue
        target = Path(os.path.realpath(path))
        blob = target.name
        if path.is_symlink() and target.parent.name == "blobs" and len(blob) == 64:
            hashes[rel] = blob
        else:
            hashes[rel] = sha256_file(path)
    return hashes


def canonical_hash(data: object) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def tool_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    found = {"pipeline": __version__, "python": platform.python_version()}
    for pkg in ("torch", "transformers", "safetensors", "tokenizers", "tensorrt_llm", "tensorrt"):
        with contextlib.suppress(PackageNotFoundError):
            found[pkg] = version(pkg)
    return found


def output_stats(folder: Path) -> dict[str, list[int]]:
    """[size, mtime_ns] of every file under ``folder``, the cheap fingerprint verify_outputs compares."""
    stats = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel != MANIFEST and "/." not in f"/{rel}":
            info = path.stat()
            stats[rel] = [info.st_size, info.st_mtime_ns]
    return stats


def output_problems(folder: Path, manifest: dict, full: bool = False) -> list[str]:
    """How the files under a completed stage folder differ from what its manifest recorded (empty: they match).

    Cheap by default: every recorded file must exist with its recorded size; small files are hashed, large ones
    only when their mtime changed (then the hash decides), or all of them with ``full``.
    """
    hashes = manifest.get("outputs")
    if not isinstance(hashes, dict):
        return [f"{folder / MANIFEST}: lists no outputs"]
    stats = manifest.get("output_stats") if isinstance(manifest.get("output_stats"), dict) else {}
    problems = []
    for rel, digest in sorted(hashes.items()):
        path = folder / rel
        try:
            info = os.stat(path)
        except OSError:
            problems.append(f"{path}: missing")
            continue
        if not stat.S_ISREG(info.st_mode):
            problems.append(f"{path}: not a regular file")
            continue
        size, mtime_ns = (stats.get(rel) or [None, None])[:2]
        if size is not None and info.st_size != size:
            problems.append(f"{path}: size {info.st_size} bytes, {size} when built")
            continue
        # A manifest written before sizes were recorded (no mtime): large files are hashed only with ``full``.
        changed = mtime_ns is not None and info.st_mtime_ns != mtime_ns
        if full or info.st_size <= ALWAYS_HASHED_BYTES or changed:
            if sha256_file(path) != digest:
                problems.append(f"{path}: content differs from when it was built")
    return problems


def verify_outputs(folder: Path, manifest: dict, full: bool = False) -> None:
    """Refuse a completed stage folder whose files were deleted, truncated or edited since its manifest was
    written (an engine.json edited to claim larger limits, weights cut short by a full disk); names the file.

    Call it before reading anything in the folder: engine metadata is trusted only after this check.
    """
    problems = output_problems(folder, manifest, full)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise EngineError(f"{problems[0]}{more}: modified after it was built; rebuild it with `python -m pipeline "
                          f"build CONFIG` (which redoes a stage whose outputs changed)")


def read_manifest(folder: Path) -> dict | None:
    """The manifest of a completed stage, or None when the folder is absent or incomplete.

    Raises EngineError when the manifest exists but was edited by hand (its checksum no longer matches).
    """
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_bytes())
    except ValueError:  # invalid JSON or not text at all
        raise EngineError(f"{path}: manifest is not valid JSON; delete {folder} and rebuild "
                          f"(or rerun with --force)") from None
    if not isinstance(data, dict):
        raise EngineError(f"{path}: manifest holds a JSON {type(data).__name__}, not an object; delete {folder} "
                          f"and rebuild (or rerun with --force)")
    claimed = data.pop("manifest_sha256", None)
    if claimed != canonical_hash(data):
        raise EngineError(f"{path}: manifest was modified after it was written (checksum mismatch); delete "
                          f"{folder} or rerun with --force to rebuild it")
    return data


def completed_manifest(folder: Path, stage: str) -> dict:
    """The manifest of ``stage``'s completed output in ``folder``; raises EngineError naming the command to run when
    there is none."""
    manifest = read_manifest(folder) if folder.exists() else None
    if manifest is None:
        raise EngineError(f"{folder}: no completed {stage} output; run `python -m pipeline {stage} CONFIG` first")
    return manifest


def write_manifest(folder: Path, data: dict) -> None:
    data = dict(data)
    data["manifest_sha256"] = canonical_hash(data)
    tmp = folder / (MANIFEST + ".partial")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, folder / MANIFEST)


@dataclass
class StageResult:
    stage: str
    role: str
    path: Path
    status: str  # "built" or "up to date"
    seconds: float
    manifest: dict


def run_stage(stage: str, role: str, out_dir: Path, inputs: dict, config: dict,
              produce: Callable[[Path], dict | None], force: bool = False, verify: bool = False) -> StageResult:
    """Run ``produce(tmp_dir)`` unless ``out_dir`` already holds a manifest for the same inputs and the outputs
    that manifest lists (checked by size and mtime, small files and ``verify`` by content hash).

    ``inputs`` must capture everything the output depends on (hashes, resolved config, versions); ``produce``
    may return extra facts (argv, timings) to store in the manifest.
    """
    start = time.perf_counter()
    key = canonical_hash({"stage": stage, "role": role, "inputs": inputs, "config": config})
    if out_dir.parent.exists():
        _remove_stale_temps(out_dir)  # also when up to date: a killed `--force` run leaves a full-size copy
    existing = read_manifest(out_dir) if out_dir.exists() else None
    if existing and existing.get("input_key") == key and not force:
        problems = output_problems(out_dir, existing, full=verify)
        if not problems:
            return StageResult(stage, role, out_dir, "up to date", time.perf_counter() - start, existing)
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        print(f"warning: {problems[0]}{more}; rebuilding {role} {stage}", file=sys.stderr, flush=True)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        extra = _produce_reporting_full_disk(produce, tmp, role, stage, out_dir)
        # Fault-injection hook for the kill test: widens the window in which outputs exist but no manifest does.
        time.sleep(float(os.environ.get("PIPELINE_STAGE_DELAY_S") or 0))
        manifest = {
            "schema": SCHEMA_VERSION, "stage": stage, "role": role, "input_key": key, "inputs": inputs,
            "config": config, "versions": tool_versions(), "created": datetime.now(timezone.utc).isoformat(),
            "timings": {"seconds": round(time.perf_counter() - start, 3)},
            "outputs": content_hashes(tmp), "output_stats": output_stats(tmp), **extra,
        }
        _produce_reporting_full_disk(lambda folder: write_manifest(folder, manifest), tmp, role, stage, out_dir)
        _swap_in(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return StageResult(stage, role, out_dir, "built", time.perf_counter() - start, manifest)


def _write_errno(exc: Exception) -> int | None:
    """The errno of a failed write: OSError's, or the "(os error N)" safetensors' Rust writer puts in its text."""
    if isinstance(exc, OSError):
        return exc.errno
    found = re.search(r"\(os error (\d+)\)", str(exc))
    return int(found.group(1)) if found else None


def _produce_reporting_full_disk(produce: Callable[[Path], dict | None], tmp: Path, role: str, stage: str,
                                 out_dir: Path) -> dict:
    """``produce(tmp)``; a failed write (a full disk above all) becomes one EngineError naming the stage."""
    try:
        return produce(tmp) or {}
    except Exception as exc:  # noqa: BLE001 - only write errors are translated; anything else is re-raised
        code = _write_errno(exc)
        if code is None:
            raise
        reason = _FULL.get(code) or os.strerror(code)
        where = f" ({exc.filename})" if isinstance(exc, OSError) and exc.filename else ""
        raise EngineError(f"{role} {stage}: writing {out_dir} failed: {reason}{where}; the partial output was "
                          f"deleted: free space (or raise the quota or file-size limit) on that file system and "
                          f"rerun") from None


def _swap_in(tmp: Path, out_dir: Path) -> None:
    # rename() cannot replace a non-empty folder, so the old output moves aside first; between the two renames
    # no folder named out_dir exists, which readers treat as "not built", never as complete.
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _remove_stale_temps(out_dir: Path) -> None:
    """Delete temp folders left by killed runs (their pid is gone)."""
    for leftover in out_dir.parent.glob(f".{out_dir.name}.*-*"):
        pid = leftover.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def build_lock(root: Path) -> Iterator[None]:
    """One build per engines/<name> at a time; a second waits for the first, saying so on stderr."""
    root.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(root / ".lock", f"another build of {root.name}"):
        yield


@contextlib.contextmanager
def exclusive_lock(lock_path: Path, holder_label: str) -> Iterator[None]:
    """An exclusive flock on ``lock_path`` (made if missing) for the block: a second process waits, saying on
    stderr that it waits for ``holder_label`` and the holder's pid. The kernel frees it when a holder dies."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with _open_lock_file(lock_path) as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            print(f"waiting for {holder_label} (pid {holder}) to finish...", file=sys.stderr, flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _open_lock_file(lock_path: Path):
    """The lock file, opened without following a symlink (whose target the pid would overwrite)."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        kind = {errno.ELOOP: "is a symlink", errno.EISDIR: "is a folder"}.get(exc.errno, exc.strerror)
        raise EngineError(f"{lock_path}: {kind}, not a lock file; remove it (nothing else uses that "
                          f"name) and rerun") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise EngineError(f"{lock_path}: not a regular file; remove it and rerun")
    return os.fdopen(fd, "r+")
