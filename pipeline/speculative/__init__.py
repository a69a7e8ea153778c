"""The speculative step as pure tensor code: accept rules and the sampling transforms both models share.

The names load on first use: the config imports this package's tree paths, and a CLI that refuses a bad flag or
config should not pay torch's import first.
"""

import importlib

_HOME = {"accept_greedy": "accept", "accept_matching": "accept", "accept_rejection": "accept",
         "SamplingParams": "sampling_params", "LogitsAdjust": "sampling_params", "adjust_logits": "penalties", "logits_to_probs": "sampling", "sample": "sampling",
         "sample_inverse_cdf": "sampling"}
__all__ = list(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
