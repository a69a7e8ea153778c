"""The speculative executor: the draft proposes, the target verifies K tokens in one pass, requests batched.

``open_executor(engines/<name>)`` opens built engines with the executor of the backend that built them;
``SpeculativeExecutor`` is the torch runtime (``from_pretrained`` on HF models, ``from_engines`` on torch engines).
"""

from .open import open_executor
from .results import GenerationResult, GenerationStats, RequestError, StreamEvent
from .speculative_executor import SpeculativeExecutor

__all__ = ["SpeculativeExecutor", "open_executor", "GenerationResult", "GenerationStats", "RequestError",
           "StreamEvent"]
