"""Who proposes draft tokens: the method names every layer shares (config, executors, Triton, bench), and the n-gram
lookup's settings with their one set of defaults."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Method(StrEnum):
    """``speculative.method``. A StrEnum, so configs, JSON and Triton parameters carry the plain string."""

    DRAFT_MODEL = "draft_model"  # a second, smaller model drafts K tokens
    NGRAM = "ngram"  # tokens that followed the current suffix earlier in the prompt or the output
    NGRAM_DRAFT = "ngram+draft"  # per step, whichever of the two promises more tokens per unit of cost
    MEDUSA = "medusa"  # heads on the target's last hidden state propose a tree, verified in one target pass

    @property
    def needs_draft_model(self) -> bool:
        return self in (Method.DRAFT_MODEL, Method.NGRAM_DRAFT)

    @property
    def needs_medusa_heads(self) -> bool:
        return self is Method.MEDUSA


def parse_method(value: object, has_draft_model: bool, error=ValueError, has_medusa_heads: bool = False) -> Method:
    """``value`` as a Method this runtime can serve; raises ``error`` naming the value and the fix."""
    try:
        method = Method(value)
    except ValueError:
        raise error(f"method: {value!r} is unknown; use one of {', '.join(m.value for m in Method)}") from None
    if method.needs_draft_model and not has_draft_model:
        raise error(f"method: {method.value!r} needs a draft model, and there is none; pass one, or use 'ngram'")
    if method.needs_medusa_heads and not has_medusa_heads:
        raise error(f"method: 'medusa' needs Medusa heads, and there are none; build with speculative.method: medusa "
                    f"(heads from `python -m pipeline train-draft CONFIG --kind medusa`), or use 'ngram'")
    return method


@dataclass(frozen=True)
class NgramSettings:
    """``speculative.ngram``: how proposals are looked up."""

    min_match: int = 1  # shortest suffix (tokens) that may be looked up
    max_match: int = 4  # longest suffix tried first (a longer match predicts better)

    def __post_init__(self):
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(f"ngram: min_match {self.min_match} and max_match {self.max_match} must satisfy "
                             f"1 <= min_match <= max_match")
