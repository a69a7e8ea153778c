"""README.md and docs/*.md: every repository path and local link they name exists, commands are written as they run
(`.venv/bin/python ...`), the README stays a landing page, and `make help` lists every make target.

A path is checked where the docs write it as code (inline or in a fenced block) starting with one of the repository's
top-level folders (`pipeline/`, `tests/`, `configs/`, `scripts/`, `docs/`, `prompts/`, `.ci/`); generated folders
(`engines/`, `models/`) are not checked. `{a,b}` expands as in a shell, `*` must match at least one file, a trailing
`/` names a folder, and `tests/x.py::name` needs `def name` or `class name` in that file. Placeholders (`<name>`,
`...`) are skipped.
"""

from __future__ import annotations

import itertools
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 300  # the landing page; reference material goes to docs/ by topic

# Top-level folders a path in the docs may start with (checked), and paths that are not this repository's.
CHECKED_ROOTS = ("pipeline", "tests", "configs", "scripts", "docs", "prompts", ".ci")
NOT_OURS = {
    "scripts/launch_triton_server.py",  # TensorRT-LLM's launcher inside NVIDIA's container (docs/triton.md)
}
# docs/gpu.md: commands run inside NVIDIA's TensorRT-LLM container, with its own python and no .venv.
CONTAINER_PAGES = {"gpu.md"}

PATH_RE = re.compile(r"(?<![\w./~$-])((?:%s)/[\w.{},*<>/+-]*)(::\w+)?" % "|".join(re.escape(r) for r in CHECKED_ROOTS))
LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE_RE = re.compile(r"^(```|~~~)")


def code_parts(text: str) -> list[str]:
    """The text of every fenced block line and every inline code span."""
    parts, prose, fenced = [], [], False
    for line in text.splitlines():
        if FENCE_RE.match(line.strip()):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            parts.append(line)
        else:
            prose.append(line)
    parts += re.findall(r"`([^`\n]+)`", "\n".join(prose))
    return parts


def prose_without_code(text: str) -> str:
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE_RE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(re.sub(r"`[^`\n]*`", "", line))
    return "\n".join(kept)


def expand_braces(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    head, tail = path[:match.start()], path[match.end():]
    return list(itertools.chain.from_iterable(expand_braces(head + option + tail)
                                              for option in match.group(1).split(",")))


def missing_paths(text: str) -> list[str]:
    missing = []
    for part in code_parts(text):
        for match in PATH_RE.finditer(part):
            path, member = match.group(1).rstrip(".,;:)"), match.group(2)
            if "<" in path or ">" in path or "..." in path or path in NOT_OURS:
                continue
            for one in expand_braces(path):
                if "*" in one:
                    if not list(REPO.glob(one)):
                        missing.append(f"{one} (matches nothing)")
                    continue
                target = REPO / one
                if not (target.is_dir() if one.endswith("/") else target.exists()):
                    missing.append(one)
                elif member and not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{member[2:]}\b",
                                              target.read_text(), re.M):
                    missing.append(f"{one}{member}")
    return missing


def github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a markdown file."""
    anchors, seen, fenced = set(), {}, False
    for line in text.splitlines():
        if FENCE_RE.match(line.strip()):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def broken_links(doc: Path) -> list[str]:
    broken = []
    for target in LINK_RE.findall(prose_without_code(doc.read_text())):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in github_anchors(file.read_text()):
            broken.append(f"{target} (no such heading)")
    return broken


def bare_commands(text: str) -> list[str]:
    """Commands that run the system Python instead of the project's .venv (which has torch and the package)."""
    found = []
    for part in code_parts(text):
        command = re.sub(r"^\s*(?:\$\s+)?(?:[A-Z_]+=\S+\s+)*(?:nice -n \d+\s+)?", "", part)
        if re.match(r"(?:python3?|pytest)\s", command) and not any(path in command for path in NOT_OURS):
            found.append(part.strip())
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_repository_path_named_in_the_docs_exists(doc):
    assert missing_paths(doc.read_text()) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_local_link_and_anchor_in_the_docs_exists(doc):
    assert broken_links(doc) == []


@pytest.mark.parametrize("doc", [d for d in DOCS if d.name not in CONTAINER_PAGES],
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_commands_run_the_project_venv(doc):
    """After `make build-engines` the system Python has no torch: a command written `python -m pipeline ...` fails
    as written. Every command runs `.venv/bin/python` (docs/gpu.md runs inside NVIDIA's container instead)."""
    assert bare_commands(doc.read_text()) == []


def test_readme_is_a_landing_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move reference material to docs/"
    text = "\n".join(lines)
    assert "make build-engines" in text and "make test" in text
    assert not re.search(r"\(\d+[a-z]\)|\bissue \d+", text), "issue codes belong in the tracker, not the README"


def test_the_checks_find_what_they_look_for(tmp_path):
    """The checks above pass because the docs are right, not because the checks see nothing."""
    text = ("Run `.venv/bin/python -m pytest tests/test_config.py::test_defaults` and `tests/nowhere.py`, see\n"
            "`tests/test_config.py::no_such_test`, `configs/smollm2-135m*.yaml`, `configs/none*.yaml`,\n"
            "`docs/bench-smollm2-135m-distilled.{json,png}`, `docs/bench-gone.{json,png}` and `engines/<name>/`.\n"
            "```bash\npython -m pipeline run configs/tiny.yaml\nOMP_NUM_THREADS=1 pytest tests/x.py\n"
            "make test\n```\n")
    assert sorted(missing_paths(text)) == ["configs/none*.yaml (matches nothing)", "docs/bench-gone.json",
                                           "docs/bench-gone.png", "tests/nowhere.py",
                                           "tests/test_config.py::no_such_test", "tests/x.py"]
    assert bare_commands(text) == ["python -m pipeline run configs/tiny.yaml", "OMP_NUM_THREADS=1 pytest tests/x.py"]
    doc = tmp_path / "docs" / "page.md"
    doc.parent.mkdir()
    doc.write_text("# A page\n\n## Two `words`: here\n\n[ok](#two-words-here) [bad](#nowhere) [gone](other.md) "
                   "[web](https://example.com) `[not a link](missing.md)`\n")
    assert broken_links(doc) == ["#nowhere (no such heading)", "other.md"]


def test_make_help_lists_every_target():
    makefile = (REPO / "Makefile").read_text()
    phony = set(re.search(r"^\.PHONY:(.*?)(?<!\\)$", makefile, re.M | re.S).group(1).replace("\\", " ").split())
    described = dict(re.findall(r"^([a-z-]+):.*## (.+)$", makefile, re.M))
    assert phony == set(described), f"targets without a `## ` help text: {sorted(phony - set(described))}"
    result = subprocess.run(["make", "--no-print-directory", "help"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    for target, text in described.items():
        assert re.search(rf"^\s+{re.escape(target)}\s+{re.escape(text)}$", result.stdout, re.M), target
    assert re.search(r"^\s+CONFIG\s", result.stdout, re.M) and re.search(r"^\s+ARGS\s", result.stdout, re.M)
