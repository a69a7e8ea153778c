"""Argument checks and list parsers shared by the bench subcommands (bench, profile, bench-serve)."""

from __future__ import annotations

from ..errors import PipelineError


def check_range(flag: str, value: int, low: int, high: int | None = None, fix: str = "") -> None:
    """PipelineError naming ``flag`` unless low <= value (<= high when given); ``fix`` says what to do."""
    if value < low or (high is not None and value > high):
        span = f"between {low} and {high}" if high is not None else f">= {low}"
        raise PipelineError(f"{flag}: {value} must be {span}{'; ' + fix if fix else ''}")


def check_known(flag: str, values: list[str], known: tuple[str, ...]) -> None:
    """PipelineError naming ``flag`` and the unknown values unless every value is one of ``known``."""
    bad = [v for v in values if v not in known]
    if bad:
        raise PipelineError(f"{flag}: {', '.join(bad)} unknown; choose from {', '.join(known)}")


def int_list(text: str) -> list[int]:
    """An argparse type: "1,4,16" -> [1, 4, 16]."""
    return [int(x) for x in text.split(",") if x.strip()]


def name_list(text: str) -> list[str]:
    """An argparse type: "a, b" -> ["a", "b"]."""
    return [x.strip() for x in text.split(",") if x.strip()]
