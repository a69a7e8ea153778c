"""The speculative executor: the draft proposes, the target verifies K tokens in one pass, requests batched.

``open_executor(engines/<name>)`` opens built engines with the executor of the backend that built them;
``SpeculativeExecutor`` is the torch runtime (``from_pretrained`` on HF models, ``from_engines`` on torch engines).
The names load on first use, so the CLI validates a request's values (request_values) without importing torch.
"""

import importlib

_HOME = {"SpeculativeExecutor": "speculative_executor", "open_executor": "open", "GenerationResult": "results",
         "GenerationStats": "results", "RequestError": "results", "StreamEvent": "results"}
__all__ = list(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
