"""pipeline/openai_api/generation.py with a scripted Triton stream: pieces, finish reasons, totals, and a stop string
that closes the stream (which is what cancels the engine request)."""

from __future__ import annotations

import asyncio

from pipeline.openai_api.generation import Generation
from pipeline.openai_api.protocol import GenerationRequest
from pipeline.openai_api.triton_stream import Step


def step(text: str, n: int, finish: str = "", steps: int = 1) -> Step:
    return Step(text, list(range(n)), finish, prompt_tokens=5,
                stats={"draft_tokens": 4 * steps, "accepted_tokens": 3 * steps, "target_steps": steps,
                       "acceptance_rate": 0.75, "mean_accepted_len": 4.0})


class ScriptedTriton:
    """Answers with the scripted steps; counts how many were read before the stream was closed."""

    def __init__(self, steps: list[Step]):
        self.script = steps
        self.sent = 0

    async def steps(self, inputs):
        for item in self.script:
            self.sent += 1
            yield item


def run(triton: ScriptedTriton, stop: tuple[str, ...] = (), start_first: bool = False) -> tuple[list[str], Generation]:
    async def go():
        generation = Generation(triton, GenerationRequest(chat=False, inputs={}, stop=stop))
        if start_first:
            await generation.start()
        pieces = [piece async for piece in generation.pieces()]
        await generation.close()
        return pieces, generation

    return asyncio.run(go())


def test_pieces_totals_and_the_finish_reason():
    triton = ScriptedTriton([step("def", 2), step("", 1), step(" f(x)", 3, "eos", steps=3)])
    pieces, generation = run(triton, start_first=True)  # start() holds the first step for pieces()
    assert pieces == ["def", " f(x)"]  # no empty pieces
    assert (generation.prompt_tokens, generation.completion_tokens) == (5, 6)
    assert generation.finish_reason == "stop"  # the engine's eos is OpenAI's "stop"
    assert generation.speculative["target_steps"] == 3 and triton.sent == 3


def test_length_is_length():
    assert run(ScriptedTriton([step("a", 1, "length")]))[1].finish_reason == "length"


def test_a_stop_string_cuts_the_text_and_closes_the_stream():
    triton = ScriptedTriton([step("x = 1", 2), step("\n\ny", 2), step(" = 2", 2), step("!", 1, "length")])
    pieces, generation = run(triton, stop=("\n\n",))
    assert "".join(pieces) == "x = 1" and generation.finish_reason == "stop"
    assert triton.sent == 2  # the rest was never read: closing the stream cancels the engine request
    assert generation.completion_tokens == 4  # what the engine generated up to the step that matched


def test_a_stop_string_split_across_steps():
    triton = ScriptedTriton([step("a #", 1), step("## b", 1), step("c", 1, "length")])
    pieces, generation = run(triton, stop=("###",))
    assert pieces == ["a "] and generation.finish_reason == "stop" and triton.sent == 2


def test_held_text_is_released_at_the_end():
    pieces, generation = run(ScriptedTriton([step("a #", 1), step("#", 1, "length")]), stop=("###",))
    assert pieces == ["a ", "##"] and generation.finish_reason == "length"
