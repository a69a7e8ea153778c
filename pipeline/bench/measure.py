"""Time one generation and keep what the records need: token count, wall time, arrival times, steps.

Latency definitions (the same for our runtime and for Hugging Face):
  ttft  call start to the first emitted token (prefill plus the first target step).
  itl   per emitted token after the first step: a step that brings n tokens after a gap of t gives each of its n
        tokens an inter-token latency of t / n, so tokens that arrive together share the wait that produced them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Sample:
    """One prompt generated once by one method."""

    tokens: int  # tokens emitted
    seconds: float  # wall time of the whole call
    ttft_s: float  # time to the first emitted token
    itl_s: list[float] = field(default_factory=list)  # [tokens after the first step] per-token latency
    steps: list[tuple[int, int]] = field(default_factory=list)  # [target steps] (drafted, accepted)


class _Clock:
    """Turns arrival times of token groups into a Sample."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last: float | None = None
        self.ttft = 0.0
        self.itl: list[float] = []
        self.tokens = 0

    def arrived(self, count: int) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.ttft = now - self.start
        elif count > 0:
            self.itl.extend([(now - self.last) / count] * count)
        if count > 0 or self.last is None:
            self.last = now
        self.tokens += count

    def sample(self, steps: list[tuple[int, int]]) -> Sample:
        return Sample(self.tokens, time.perf_counter() - self.start, self.ttft, self.itl, steps)


def stream_sample(executor, prompt_ids: Sequence[int], max_new_tokens: int, max_draft_len,
                  method: str | None = None) -> Sample:
    """Greedy generation on our runtime through generate_stream (one event per target step); ``method`` picks
    the proposer (None: the executor's)."""
    clock = _Clock()
    steps: list[tuple[int, int]] = []
    drafted = accepted = 0
    extra = {"method": method} if method else {}
    for event in executor.generate_stream(list(prompt_ids), max_new_tokens, temperature=0.0,
                                          max_draft_len=max_draft_len, **extra):
        clock.arrived(len(event.token_ids))
        # event.stats is the request's running total; the difference is this step.
        steps.append((event.stats.draft_tokens - drafted, event.stats.accepted_tokens - accepted))
        drafted, accepted = event.stats.draft_tokens, event.stats.accepted_tokens
    return clock.sample(steps)


class _HFTimingStreamer:
    """A transformers streamer that records when each group of tokens is handed over.

    generate() first puts the prompt, then one put per decoding step; in assisted decoding a step puts the
    accepted draft tokens plus the target's own token, so each put after the prompt is one target step.
    """

    def __init__(self, k: int) -> None:
        self.k = k
        self.clock: _Clock | None = None
        self.steps: list[tuple[int, int]] = []

    def put(self, value) -> None:
        if self.clock is None:  # the prompt
            self.clock = _Clock()
            return
        count = int(value.numel())
        self.clock.arrived(count)
        self.steps.append((self.k, max(count - 1, 0)) if self.k else (0, 0))

    def end(self) -> None:
        pass


def hf_sample(target_model, draft_model, prompt_ids: Sequence[int], max_new_tokens: int, k: int,
              pad_token_id: int | None, prompt_lookup: bool = False) -> Sample:
    """Greedy Hugging Face ``generate``: plain (``draft_model`` None) or assisted with K = ``k`` every step, or
    prompt-lookup decoding (``prompt_lookup``: HF's n-gram proposer, ``prompt_lookup_num_tokens=k``).

    The assistant's schedule is pinned to "constant" and its confidence early-exit turned off, so K is exactly
    the number of draft tokens per step, as in our runtime. The draft's generation_config is restored afterwards.
    """
    import torch

    streamer = _HFTimingStreamer(k if draft_model is not None or prompt_lookup else 0)
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=target_model.device)
    kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                  do_sample=False, streamer=streamer, pad_token_id=pad_token_id)
    saved = None
    if draft_model is not None:
        gen = draft_model.generation_config
        saved = (gen.num_assistant_tokens, gen.num_assistant_tokens_schedule, gen.assistant_confidence_threshold)
        gen.num_assistant_tokens, gen.num_assistant_tokens_schedule = k, "constant"
        gen.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = draft_model
    elif prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = k
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            target_model.generate(**kwargs)
    finally:
        if saved is not None:
            gen = draft_model.generation_config
            gen.num_assistant_tokens, gen.num_assistant_tokens_schedule, gen.assistant_confidence_threshold = saved
    if streamer.clock is None:
        return Sample(0, time.perf_counter() - start, 0.0)
    sample = streamer.clock.sample(streamer.steps)
    sample.seconds = time.perf_counter() - start  # include the prompt hand-over, as our runtime's timing does
    return sample
