"""Who proposes draft tokens: the method names every layer shares (config, executors, Triton, bench), and the
settings of the model-free methods (n-gram lookup, suffix tree) with their one set of defaults."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Method(StrEnum):
    """``speculative.method``. A StrEnum, so configs, JSON and Triton parameters carry the plain string."""

    DRAFT_MODEL = "draft_model"  # a second, smaller model drafts K tokens
    NGRAM = "ngram"  # tokens that followed the current suffix earlier in the prompt or the output
    NGRAM_DRAFT = "ngram+draft"  # per step, whichever of the two promises more tokens per unit of cost
    MEDUSA = "medusa"  # heads on the target's last hidden state propose a tree, verified in one target pass
    # the most frequent continuation in suffix trees over the request's prompt and output and over recent outputs
    SUFFIX = "suffix"
    EAGLE3 = "eagle3"  # one layer over three of the target's layers' hidden states drafts a chain (EAGLE-3 heads)

    @property
    def needs_draft_model(self) -> bool:
        return self in (Method.DRAFT_MODEL, Method.NGRAM_DRAFT)

    @property
    def needs_medusa_heads(self) -> bool:
        return self is Method.MEDUSA

    @property
    def needs_eagle3_heads(self) -> bool:
        return self is Method.EAGLE3


# Not a speculative.method: the proposer of the tokens a request's response_format forces, drafted ahead of any
# method (pipeline/executor/proposers/grammar.py); its name in statistics and acceptance estimates.
GRAMMAR_PROPOSER = "grammar"


def parse_method(value: object, has_draft_model: bool, error=ValueError, has_medusa_heads: bool = False,
                 has_eagle3_heads: bool = False) -> Method:
    """``value`` as a Method this runtime can serve; raises ``error`` naming the value and the fix."""
    try:
        method = Method(value)
    except ValueError:
        raise error(f"method: {value!r} is unknown; use one of {', '.join(m.value for m in Method)}") from None
    if method.needs_draft_model and not has_draft_model:
        raise error(f"method: {method.value!r} needs a draft model, and there is none; pass one, or use 'ngram'")
    if method is Method.SUFFIX and (problem := suffix_tree_problem()):
        raise error(problem)
    if method.needs_medusa_heads and not has_medusa_heads:
        raise error(f"method: 'medusa' needs Medusa heads, and there are none; build with speculative.method: medusa "
                    f"(heads from `python -m pipeline train-draft CONFIG --kind medusa`), or use 'ngram'")
    if method.needs_eagle3_heads and not has_eagle3_heads:
        raise error("method: 'eagle3' needs EAGLE-3 heads, and there are none; build with speculative.method: eagle3 "
                    "and eagle3: {model: HEADS_DIR} (heads from `python -m pipeline train-draft CONFIG --kind "
                    "eagle3`), or use 'ngram'")
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


@dataclass(frozen=True)
class SuffixSettings:
    """``speculative.suffix``: suffix decoding's trees and how far it drafts (vLLM's suffix_decoding_* defaults,
    except the cache of past outputs: a smaller default, as a CPU server's memory is smaller)."""

    max_tree_depth: int = 24  # a match plus its draft never spans more tokens than this
    max_cached_requests: int = 1000  # past outputs kept for every request to draft from (FIFO); 0: none
    max_spec_factor: float = 1.0  # a draft is at most this times its match's length (and at most K)
    min_token_prob: float = 0.1  # a drafted token's estimated probability (from the trees' counts) is at least this
    tree: bool = False  # draft a tree of the likeliest continuations (the torch engine verifies it in one pass)

    def __post_init__(self):
        if self.max_tree_depth < 2:
            raise ValueError(f"suffix: max_tree_depth {self.max_tree_depth} must be at least 2 (a one-token match "
                             f"and a one-token draft); 24 is the usual value")
        if self.max_cached_requests < 0:
            raise ValueError(f"suffix: max_cached_requests {self.max_cached_requests} must be 0 (no cache of past "
                             f"outputs) or more")
        if self.max_spec_factor <= 0:
            raise ValueError(f"suffix: max_spec_factor {self.max_spec_factor} must be above 0; 1.0 is the usual value")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"suffix: min_token_prob {self.min_token_prob} must be within 0..1; 0.1 is the usual "
                             f"value")


def suffix_tree_problem() -> str | None:
    """Why method suffix cannot run here (its suffix tree is not installed), or None."""
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except ImportError as exc:
        return (f"method: 'suffix' needs Arctic Inference's suffix tree ({exc}); `make setup` builds it "
                f"(scripts/install_suffix_tree.sh .venv/bin/python), or use 'ngram'")
    return None
