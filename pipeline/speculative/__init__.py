"""The speculative step as pure tensor code: accept rules and the sampling transforms both models share."""

from .accept import accept_greedy, accept_matching, accept_rejection
from .sampling import SamplingParams, logits_to_probs, sample, sample_inverse_cdf

__all__ = ["accept_greedy", "accept_matching", "accept_rejection", "SamplingParams", "logits_to_probs", "sample",
           "sample_inverse_cdf"]
