"""What Linux's /proc says about a running tritonserver: its Python-backend stub processes (which model each
serves, whether it is alive) and which TCP ports it listens on.

`serve` uses it to notice a model process that died (Triton itself keeps answering "ready" while every request to
that model fails with "Stub process ... is not healthy") and to make sure the server answering on its ports is
the one it started. Every reader tolerates processes that exit while it reads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

STUB_BINARY = "triton_python_backend_stub"
SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class Stub:
    pid: int
    model: str  # the repository folder name: <repo>/<model>/1/model.py is the stub's first argument
    shm_region: str  # its shared-memory region under /dev/shm (left behind when the server is SIGKILLed)


def children(pid: int) -> list[int]:
    kids = []
    for listing in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids += [int(p) for p in listing.read_text().split()]
        except OSError:  # the thread exited while we read
            continue
    return kids


def alive(pid: int) -> bool:
    """Running (a zombie has exited: Triton does not reap a stub that was killed)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def stubs(server_pid: int) -> list[Stub]:
    """The live Python-backend stubs of a tritonserver process."""
    found = []
    for pid in children(server_pid):
        try:
            argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        # argv: stub, model.py path, shm region, shm sizes..., parent pid, backend dir, ..., instance name, ...
        if not argv or not argv[0].endswith(STUB_BINARY) or len(argv) < 9 or not alive(pid):
            continue
        found.append(Stub(pid, Path(argv[1]).parent.parent.name, argv[2]))
    return found


def running_from(folder: Path) -> list[int]:
    """Live processes of this user whose program lies in ``folder`` (a stub linked from a scratch folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            program = (entry / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:
            continue
        if program and Path(program).is_relative_to(folder) and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes


def listening_ports(pid: int) -> set[int]:
    """TCP ports (IPv4 and IPv6) on which a socket held by ``pid`` is listening."""
    mine = _socket_inodes(pid)
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # sl, local_address (hex addr:port), rem_address, st (0A = LISTEN), ..., inode is field 9
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in mine:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports
