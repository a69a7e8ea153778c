"""The async gRPC client of Triton's decoupled ``speculative_stream`` model: one response per engine step.

Each request opens its own bidirectional stream (``tritonclient.grpc.aio``). Closing the iterator that
:meth:`TritonStreamClient.steps` returns cancels the gRPC call; Triton then marks the request cancelled, the model's
``response_sender.is_cancelled()`` turns true, and the engine frees the batch slot within a step (it counts the
request in ``spec_requests_total{outcome="cancelled"}``).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

from ..serving_contract import INPUTS, STREAM_MODEL
from .errors import ApiError

# tritonclient's own message limits; the reconnect backoff is bounded so the proxy finds a restarted tritonserver
# within about a second (gRPC's default backoff grows to two minutes of refusing requests).
CHANNEL_ARGS = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
NUMPY_DTYPES = {"BYTES": np.object_, "STRING": np.object_, "INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64,
                "BOOL": np.bool_}
TRITON_DTYPES = {name: "BYTES" if dtype == "STRING" else dtype for name, dtype, _ in INPUTS}
STAT_FIELDS = ("draft_tokens", "accepted_tokens", "target_steps", "acceptance_rate", "mean_accepted_len")
# Errors in the stream that mean "the model is not there right now" (loading, reloading after its process died),
# as opposed to a request the model refused.
UNAVAILABLE_MARKERS = ("unknown model", "is not ready", "not healthy")


@dataclass(frozen=True)
class Step:
    """One engine step's response."""

    text: str  # text added by this step
    token_ids: list[int]  # tokens added by this step
    finish_reason: str  # the engine's ("eos", "stop", "length"); "" until the last step
    prompt_tokens: int
    stats: dict  # STAT_FIELDS, running totals for the request
    # per token of token_ids when the request asked for logprobs: [id, text, logprob, [[id, text, logprob], ...]]
    logprobs: list = field(default_factory=list)


def infer_inputs(values: dict[str, object]) -> list[grpcclient.InferInput]:
    """Triton inputs with a batch dimension of 1, dtypes from the model's own input table."""
    inputs = []
    for name, value in values.items():
        dtype = TRITON_DTYPES[name]
        if isinstance(value, str):
            array = np.array([[value.encode("utf-8", "surrogatepass")]], dtype=np.object_)
        elif isinstance(value, list):
            array = np.array([value], dtype=NUMPY_DTYPES[dtype])
        else:
            array = np.array([[value]], dtype=NUMPY_DTYPES[dtype])
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _step(result) -> Step:
    def scalar(name):
        return result.as_numpy(name).reshape(-1)[0]

    return Step(text=scalar("text_output").decode("utf-8", "replace"),
                token_ids=result.as_numpy("output_ids").reshape(-1).tolist(),
                finish_reason=scalar("finish_reason").decode(), prompt_tokens=int(scalar("prompt_tokens")),
                stats={name: _plain(scalar(name).item()) for name in STAT_FIELDS}, logprobs=_logprobs(result))


def _logprobs(result) -> list:
    """The step's logprobs output (JSON text; empty when not asked for, or from a model without the output)."""
    raw = result.as_numpy("logprobs")  # None when the response lacks the output
    text = raw.reshape(-1)[0] if raw is not None and raw.size else b""
    return json.loads(text) if text else []


def _plain(value: int | float) -> int | float:
    """A float32 statistic without its binary noise (0.6000000238 -> 0.6)."""
    return round(value, 6) if isinstance(value, float) else value


def request_error(message: str) -> ApiError:
    """An error response of the model: its one-line message, as a 400 when the request was at fault."""
    if message.startswith("internal error"):
        return ApiError(500, message)
    if any(marker in message for marker in UNAVAILABLE_MARKERS):
        return ApiError(503, f"the Triton model {STREAM_MODEL} is not available ({message}); retry shortly")
    name = re.split(r"[.\[]", message.split(":", 1)[0], maxsplit=1)[0]  # response_format.json_schema -> the field
    # The model names its inputs; the OpenAI side calls the prompt inputs "prompt"/"messages".
    param = {"text_input": "prompt", "input_ids": "prompt", "max_new_tokens": "max_tokens"}.get(name, name)
    return ApiError(400, message, param=param if param.isidentifier() else None)


class TritonStreamClient:
    """One gRPC channel to tritonserver, shared by every request; create and use it inside one event loop."""

    def __init__(self, url: str, model: str = STREAM_MODEL):
        self.url = url
        self.model = model
        self._client = grpcaio.InferenceServerClient(url, channel_args=CHANNEL_ARGS)

    async def close(self) -> None:
        await self._client.close()

    async def steps(self, inputs: dict[str, object]) -> AsyncIterator[Step]:
        """The request's responses until the final one; raises ApiError. Closing the iterator early cancels the
        request in Triton."""
        done = asyncio.Event()

        async def requests():
            yield {"model_name": self.model, "inputs": infer_inputs(inputs)}
            await done.wait()  # the stream stays open (not half-closed) until this request is over

        call = self._client.stream_infer(requests())
        try:
            async for result, error in call:
                if error is not None:
                    raise request_error(str(error))
                step = _step(result)
                yield step
                if step.finish_reason:
                    return
            raise ApiError(502, f"Triton ended the stream of {self.model} without a final response")
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                raise ApiError(503, f"Triton at {self.url} is unreachable ({exc.details()}); is `serve` running?") \
                    from None
            raise ApiError(502, f"Triton at {self.url}: gRPC {exc.code().name}: {exc.details()}") from None
        finally:
            call.cancel()  # a no-op once the final response arrived; otherwise Triton cancels the request
            done.set()
