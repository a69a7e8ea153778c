"""OpenAI response bodies: completions, chat completions, their stream chunks, the model list, server-sent events.

Every body follows OpenAI's schema; the one addition is ``speculative`` (the acceptance statistics of the request:
draft_tokens, accepted_tokens, target_steps, acceptance_rate, mean_accepted_len) on the final response or chunk.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Reply:
    """What every body of one request shares."""

    chat: bool
    model: str
    id: str
    created: int  # Unix seconds

    @classmethod
    def new(cls, chat: bool, model: str) -> Reply:
        return cls(chat, model, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()))

    def _body(self, chunk: bool, choices: list[dict]) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def choice(self, text: str | None, finish_reason: str, index: int = 0, logprobs: dict | None = None,
               tool_calls: list[dict] | None = None) -> dict:
        """One choice of a whole answer; a chat's ``tool_calls`` go into its message (content None when empty)."""
        choice = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if tool_calls:
                choice["message"]["tool_calls"] = tool_calls
        else:
            choice["text"] = text
        return choice

    def completions(self, choices: list[dict], usage: dict, speculative: dict) -> dict:
        """The whole answer of a request that did not stream: its choices (Reply.choice), in index order."""
        return {**self._body(False, choices), "usage": usage, "speculative": speculative}

    def chunk(self, text: str = "", finish_reason: str | None = None, role: bool = False,
              include_usage: bool = False, speculative: dict | None = None, index: int = 0,
              logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
        """One streamed piece of choice ``index``; ``role`` marks a chat's first chunk, ``speculative`` goes on the
        last one; ``tool_calls``: a chat's tool-call deltas (OpenAI's streaming shape)."""
        choice: dict = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            delta: dict = {"role": "assistant", "content": text} if role else {"content": text} if text else {}
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice["delta"] = delta
        else:
            choice["text"] = text
        body = self._body(True, [choice])
        if include_usage:  # OpenAI: every chunk has usage null, the last one (choices empty) the totals
            body["usage"] = None
        if speculative is not None:
            body["speculative"] = speculative
        return body

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._body(True, []), "usage": usage}


def merged_stats(stats: list[dict]) -> dict:
    """The acceptance statistics of a request's choices together (one choice: its own)."""
    if len(stats) == 1:
        return stats[0]
    total = {name: sum(s.get(name, 0) for s in stats) for name in ("draft_tokens", "accepted_tokens", "target_steps")}
    generated = sum(s.get("mean_accepted_len", 0) * s.get("target_steps", 0) for s in stats)
    total["acceptance_rate"] = round(total["accepted_tokens"] / total["draft_tokens"], 6) if total["draft_tokens"] \
        else 0.0
    total["mean_accepted_len"] = round(generated / total["target_steps"], 6) if total["target_steps"] else 0.0
    return total


def tool_call_body(call) -> dict:
    """A parsed ToolCall (pipeline.tool_calls) in a chat message's tool_calls."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "specpipe"}


def sse(body: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
