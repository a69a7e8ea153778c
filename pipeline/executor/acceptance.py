"""How often a row's draft tokens are accepted: the one estimate the K policy and the proposer choice share.

The rate estimated is alpha of the speedup model (pipeline.speculative.analytic): the chance that one more draft
token is accepted given the ones before it were. Tokens after a step's first rejection were never judged, so a
step counts its accepted tokens and at most one rejection (accepted / drafted would read 0.5 for alpha 0.85 at
K = 8, and a policy planning with it would draft too little). Counts decay per drafting step, so the estimate
follows a text that turns predictable (or stops being so), and start as PRIOR_WEIGHT judged tokens at a prior
rate, which fades as the row's own evidence comes in.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..methods import GRAMMAR_PROPOSER, Method

PRIOR_WEIGHT = 2.0  # judged tokens at the prior rate that a new estimate starts with
DECAY = 0.9  # per drafting step: the counts describe about the last ten drafting steps
MAX_RATE = 0.999  # the speedup model divides by 1 - alpha
# A request's rate with a proposer before it drafted with it (ngram+draft compares the two); a few steps of its own
# outweigh these.
PROPOSER_PRIOR = {Method.DRAFT_MODEL: 0.6, Method.NGRAM: 0.4, Method.MEDUSA: 0.4, Method.SUFFIX: 0.4,
                  Method.EAGLE3: 0.6, GRAMMAR_PROPOSER: 0.9}


def judged_tokens(drafted: int, accepted: int) -> int:
    """Draft tokens the target judged in one step: the accepted ones and the first rejected one, if any."""
    return accepted + (1 if accepted < drafted else 0)


@dataclass
class AcceptanceEstimate:
    judged: float  # draft tokens judged, recent ones weighing most
    accepted: float  # of those, accepted

    @classmethod
    def starting_at(cls, rate: float) -> AcceptanceEstimate:
        return cls(judged=PRIOR_WEIGHT, accepted=rate * PRIOR_WEIGHT)

    @property
    def rate(self) -> float:
        return min(self.accepted / self.judged, MAX_RATE)

    def observe(self, drafted: int, accepted: int) -> int:
        """One drafting step's outcome (``drafted`` > 0); returns the tokens it judged."""
        judged = judged_tokens(drafted, accepted)
        self.judged = DECAY * self.judged + judged
        self.accepted = DECAY * self.accepted + accepted
        return judged
