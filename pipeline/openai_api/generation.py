"""One request's run: Triton's per-step responses -> text pieces, with stop strings applied and the totals kept.

Leaving early in any way (a stop string matched, the client went away, an error) closes the Triton stream, which
cancels the request in the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from .protocol import GenerationRequest
from .stop import StopMatcher
from .triton_stream import Step, TritonStreamClient

# The engine's finish reasons -> OpenAI's: an end-of-sequence or stop token is a natural stop.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


class Generation:
    """One request, used once: start() (optional), then pieces(), then close() whatever happened."""

    def __init__(self, client: TritonStreamClient, request: GenerationRequest, index: int = 0):
        self.index = index  # the choice this generation answers (n > 1: one generation per choice)
        self._steps = client.steps(request.choice_inputs(index))
        self._stop = StopMatcher(request.stop)
        self._first: Step | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0  # tokens the engine generated, up to the step where a stop string matched
        self.finish_reason: str | None = None  # OpenAI's "stop" or "length", once the last piece is out
        self.speculative: dict = {}  # the acceptance statistics of the last step received
        self.logprobs: list = []  # every step's logprobs entries so far (the request asked for them)
        self._fresh: list = []  # the entries not yet taken (take_logprobs)

    async def start(self) -> None:
        """Wait for the first engine step, so a request the model refuses fails before an HTTP status is sent."""
        self._first = await self._next()

    async def pieces(self) -> AsyncIterator[str]:
        """Non-empty text pieces as they are generated; afterwards finish_reason and the totals are set."""
        step = self._first if self._first is not None else await self._next()
        while True:
            self.prompt_tokens = step.prompt_tokens
            self.completion_tokens += len(step.token_ids)
            self.speculative = step.stats
            self.logprobs.extend(step.logprobs)
            self._fresh.extend(step.logprobs)
            text, stopped = self._stop.feed(step.text)
            if text:
                yield text
            if stopped:
                self.finish_reason = "stop"
                await self.close()  # cancels the engine request: the rest would be cut anyway
                return
            if step.finish_reason:
                rest = self._stop.flush()
                if rest:
                    yield rest
                self.finish_reason = FINISH_REASONS.get(step.finish_reason, "stop")
                return
            step = await self._next()

    def take_logprobs(self) -> list:
        """The logprobs entries of the steps read since the last call: a streamed piece's tokens (with a stop
        string, the whole step it matched in)."""
        fresh, self._fresh = self._fresh, []
        return fresh

    async def close(self) -> None:
        await self._steps.aclose()

    async def _next(self) -> Step:
        return await anext(self._steps)  # the stream ends with a final step or raises ApiError, never runs dry
