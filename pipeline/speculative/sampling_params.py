"""The sampling controls of one request, without torch: request validation and configs import them cheaply."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax); no randomness at all
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0  # 1 = no nucleus cut

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature: {self.temperature} must be finite and >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k: {self.top_k} must be >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: {self.top_p} must be in (0, 1] (1 disables it)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
