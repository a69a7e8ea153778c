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

    def completion(self, text: str, finish_reason: str, usage: dict, speculative: dict) -> dict:
        """The whole answer of a request that did not stream."""
        choice = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._body(False, [choice]), "usage": usage, "speculative": speculative}

    def chunk(self, text: str = "", finish_reason: str | None = None, role: bool = False,
              include_usage: bool = False, speculative: dict | None = None) -> dict:
        """One streamed piece; ``role`` marks a chat's first chunk, ``speculative`` goes on the last one."""
        choice: dict = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if role else {"content": text} if text else {}
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


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "specpipe"}


def sse(body: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
