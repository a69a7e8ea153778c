"""Proposers: one module per way of drafting, registered here by the method that names it.

A new proposer is a module with a :class:`~.base.Proposer` subclass plus one entry in ``REGISTRY`` (a factory that
takes the engine's ProposerContext and the proposers built before it, and returns None where it cannot run, e.g.
the draft model without a draft runner). Which proposer drafts a step is :func:`~.dispatch.choose_drafter`'s call.
"""

from __future__ import annotations

from collections.abc import Callable

from ...methods import Method, suffix_tree_problem
from .base import Proposer, ProposerContext
from .dispatch import choose_drafter
from .draft_model import DraftModelProposer
from .eagle3 import Eagle3Proposer
from .medusa import MedusaProposer
from .ngram import NgramProposer
from .ngram_or_draft import CostRatio, NgramOrDraftProposer
from .suffix import SuffixProposer


def _draft_model(context: ProposerContext, built: dict) -> Proposer | None:
    return DraftModelProposer(context) if context.draft_runner is not None else None


def _ngram(context: ProposerContext, built: dict) -> Proposer | None:
    return NgramProposer(context)


def _ngram_or_draft(context: ProposerContext, built: dict) -> Proposer | None:
    return NgramOrDraftProposer(built[Method.DRAFT_MODEL]) if Method.DRAFT_MODEL in built else None


def _medusa(context: ProposerContext, built: dict) -> Proposer | None:
    return MedusaProposer(context) if context.medusa is not None else None


def _eagle3(context: ProposerContext, built: dict) -> Proposer | None:
    return Eagle3Proposer(context) if context.eagle3 is not None else None


def _suffix(context: ProposerContext, built: dict) -> Proposer | None:
    return SuffixProposer(context) if suffix_tree_problem() is None else None


# In dependency order: a factory sees the proposers registered above it.
REGISTRY: dict[Method, Callable[[ProposerContext, dict], Proposer | None]] = {
    Method.DRAFT_MODEL: _draft_model,
    Method.NGRAM: _ngram,
    Method.NGRAM_DRAFT: _ngram_or_draft,
    Method.MEDUSA: _medusa,
    Method.SUFFIX: _suffix,
    Method.EAGLE3: _eagle3,
}


def build_proposers(context: ProposerContext) -> dict[Method, Proposer]:
    built: dict[Method, Proposer] = {}
    for method, factory in REGISTRY.items():
        proposer = factory(context, built)
        if proposer is not None:
            built[method] = proposer
    return built


__all__ = ["CostRatio", "Proposer", "ProposerContext", "REGISTRY", "build_proposers", "choose_drafter"]
