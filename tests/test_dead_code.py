"""No dead code in pipeline/ or scripts/: vulture finds what nothing uses (under a second)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

WHITELIST = Path(__file__).with_name("dead_code_whitelist.py")
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
SCANNED = ("pipeline", "scripts")


def _whitelisted_names() -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(WHITELIST.read_text())):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and node.id != "_":
            names.add(node.id)
    return names


def test_no_dead_code():
    result = subprocess.run([sys.executable, "-m", "vulture", *SCANNED, str(WHITELIST)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    if "No module named vulture" in result.stderr:
        raise AssertionError("vulture is not installed: pip install -e '.[test]' (or `make setup`)")
    whitelist = WHITELIST.relative_to(ROOT)
    assert result.returncode == 0 and not result.stdout, (
        f"vulture found code that nothing uses (exit {result.returncode}):\n{result.stdout}{result.stderr}\n"
        f"Delete it. If it is used where vulture cannot see (a framework calls it, it is read through asdict() "
        f"or getattr, only tests use it), add its name to {whitelist} under a comment saying why; "
        f"`vulture {' '.join(SCANNED)} --make-whitelist` prints the line to add.")
    source = "\n".join(p.read_text() for folder in SCANNED for p in (ROOT / folder).rglob("*.py"))
    stale = sorted(name for name in _whitelisted_names() if not re.search(rf"\b{re.escape(name)}\b", source))
    assert not stale, f"{whitelist} lists names that no longer occur in {', '.join(SCANNED)}: remove {stale}"
