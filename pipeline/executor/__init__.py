"""The speculative executor: the draft proposes, the target verifies K tokens in one pass, requests batched."""

from .results import GenerationResult, GenerationStats, RequestError, StreamEvent
from .speculative_executor import SpeculativeExecutor

__all__ = ["SpeculativeExecutor", "GenerationResult", "GenerationStats", "RequestError", "StreamEvent"]
