"""Where a config's artifacts live: ``engines/<name>/<role>/<stage>/`` (the one place those paths are joined)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROLES = ("target", "draft")
STAGES = ("convert", "build")


@dataclass(frozen=True)
class Layout:
    root: Path  # engines/<name>

    @classmethod
    def for_config(cls, config, engines_dir: Path) -> Layout:
        return cls(Path(engines_dir) / config.name)

    def stage_dir(self, role: str, stage: str) -> Path:
        if role not in ROLES or stage not in STAGES:
            raise ValueError(f"no stage folder for role {role!r}, stage {stage!r}")
        return self.root / role / stage

    def engine_dir(self, role: str) -> Path:
        """The built engine of one role (the build stage's output)."""
        return self.stage_dir(role, "build")

    def distill_dir(self, part: str) -> Path:
        """train-draft's work: ``dataset`` (the target's generations), ``state``, ``medusa-state`` and
        ``eagle3-state`` (a draft model's, Medusa heads' and EAGLE-3 heads' checkpoints for --resume)."""
        if part not in ("dataset", "state", "medusa-state", "eagle3-state"):
            raise ValueError(f"no distill folder {part!r}")
        return self.root / "distill" / part
