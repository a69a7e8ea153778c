"""The bench-serve clients, one per path; a client belongs to one thread, and send(prompt_ids, max_tokens, k,
method) blocks until its request completed and returns the request's RequestTiming.

  engine         EngineClient: a ServingLoop in this process; every step's tokens are timed as they are emitted
  triton         TritonHttpClient: tritonclient HTTP against the request/response model ``speculative``; no
                 per-token arrival, so TTFT is not measured and ITL is the request's time spread over its tokens
  triton_stream  TritonStreamClient: tritonclient gRPC stream against the decoupled ``speculative_stream``; every
                 target step arrives as it happens
  openai         OpenAIClient: streamed /v1/completions of the OpenAI-compatible endpoint in front of that server

Each path also has a reader of the serving engine's running totals (engine_totals in this process, triton_totals
from the server's metrics), read before and after a cell for its prefix hit rate and batch occupancy.
"""

from __future__ import annotations

import queue
import re
import threading
import time

from .request_timing import RequestTiming, TokenArrivals

STAT_OUTPUTS = ("draft_tokens", "accepted_tokens", "target_steps")  # the request's running totals
# The engine's running totals (BatchingEngine.prefix_stats and .counters) by the names the engine model exports
# them under on Triton's metrics port (pipeline/triton/python_model/model.py).
TOTAL_METRICS = {"queried_tokens": "spec_prefix_prompt_tokens_total", "hit_tokens": "spec_prefix_cached_tokens_total",
                 "steps": "spec_engine_steps_total", "rows": "spec_engine_step_rows_total"}
# Per draft position (label ``position``, 1-based): steps that drafted a token there, and that kept it.
POSITION_METRICS = {"drafted_at": "spec_drafted_at_position_total", "accepted_at": "spec_accepted_at_position_total"}


def engine_totals(engine) -> dict[str, int]:
    """The running totals of a BatchingEngine in this process."""
    stats, counters = engine.prefix_stats, engine.counters
    return {"queried_tokens": stats.queried_tokens, "hit_tokens": stats.hit_tokens, "steps": counters.steps,
            "rows": counters.rows}


def triton_totals(metrics_url: str, timeout_s: float = 30.0) -> dict[str, float | None]:
    """The same totals scraped from a tritonserver's Prometheus text, summed over models; None for a counter the
    server does not export (an engine model older than these counters)."""
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
        text = response.read().decode()
    sums: dict[str, float] = {}
    by_position: dict[str, dict[int, float]] = {key: {} for key in POSITION_METRICS}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            value = float(line.rsplit(" ", 1)[1])
            sums[name] = sums.get(name, 0.0) + value
            for key, metric in POSITION_METRICS.items():
                if name == metric and (position := _position_label(line)) is not None:
                    by_position[key][position] = by_position[key].get(position, 0.0) + value
    totals: dict = {key: sums.get(name) for key, name in TOTAL_METRICS.items()}
    for key, counts in by_position.items():  # positions are 1-based labels; a list from position 1
        totals[key] = [counts.get(i, 0.0) for i in range(1, max(counts) + 1)] if counts else None
    return totals


def _position_label(line: str) -> int | None:
    match = re.search(r'position="(\d+)"', line)
    return int(match.group(1)) if match else None


class EngineClient:
    """A client of a ServingLoop in this process; events are timed on the loop thread as they are emitted."""

    def __init__(self, executor, loop):
        self.executor, self.loop = executor, loop

    def send(self, prompt_ids: list[int], max_tokens: int, k: int | None, method: str | None = None) -> RequestTiming:
        clock, finished = TokenArrivals(), threading.Event()
        request = self.executor.new_request(list(prompt_ids), max_tokens, max_draft_len=k, with_text=False,
                                            method=method)

        def on_event(event) -> None:
            if isinstance(event, BaseException):
                clock.timing.error = f"{type(event).__name__}: {event}"
                finished.set()
                return
            clock.arrived(len(event.token_ids), ids=event.token_ids)
            stats = event.stats
            clock.timing.take_stats(stats.draft_tokens, stats.accepted_tokens, stats.target_steps, stats.drafted_at,
                                    stats.accepted_at)
            if event.finished:
                finished.set()

        self.loop.submit(request, on_event)
        finished.wait()
        return clock.done()

    def close(self) -> None:
        pass


def _infer_inputs(module, prompt_ids: list[int], max_tokens: int, k: int | None, method: str | None) -> list:
    """The request's tensors for tritonclient ``module`` (http or grpc); num_draft_tokens only when K is named,
    speculative_method only when a method is."""
    import numpy as np

    arrays = {"input_ids": np.array([prompt_ids], dtype=np.int32),
              "max_tokens": np.array([[max_tokens]], dtype=np.int32)}
    if k is not None:
        arrays["num_draft_tokens"] = np.array([[k]], dtype=np.int32)
    if method is not None:
        arrays["speculative_method"] = np.array([[method.encode()]], dtype=np.object_)
    inputs = []
    for name, array in arrays.items():
        tensor = module.InferInput(name, list(array.shape), "BYTES" if array.dtype == np.object_ else "INT32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _stats(result) -> list[int]:
    return [int(result.as_numpy(name).reshape(-1)[0]) for name in STAT_OUTPUTS]


class TritonHttpClient:
    """tritonclient HTTP against the request/response model: one response holds every token."""

    def __init__(self, url: str, model: str = "speculative", timeout_s: float = 300.0):
        import tritonclient.http as httpclient

        self.module, self.model = httpclient, model
        self.client = httpclient.InferenceServerClient(url, connection_timeout=timeout_s, network_timeout=timeout_s)

    def send(self, prompt_ids: list[int], max_tokens: int, k: int | None, method: str | None = None) -> RequestTiming:
        timing = RequestTiming()
        result = self.client.infer(self.model, _infer_inputs(self.module, prompt_ids, max_tokens, k, method))
        timing.last_s = time.perf_counter() - timing.started
        timing.output = [int(x) for x in result.as_numpy("output_ids").reshape(-1)]
        timing.tokens = len(timing.output)
        # No per-token arrivals: ITL is the whole request's time spread evenly over its tokens.
        timing.itl_s = [timing.last_s / timing.tokens] * timing.tokens
        timing.take_stats(*_stats(result))
        return timing

    def close(self) -> None:
        self.client.close()


class TritonStreamClient:
    """tritonclient gRPC stream against the decoupled model: one response per target step."""

    def __init__(self, url: str, model: str = "speculative_stream", timeout_s: float = 300.0):
        import tritonclient.grpc as grpcclient

        self.module, self.model, self.timeout_s = grpcclient, model, timeout_s
        self.client = grpcclient.InferenceServerClient(url)
        self.responses: queue.SimpleQueue = queue.SimpleQueue()
        # Stamped in the callback (the stream's reader thread), not when this thread gets round to reading it.
        self.client.start_stream(callback=lambda result, error: self.responses.put(
            (time.perf_counter(), result, error)))

    def send(self, prompt_ids: list[int], max_tokens: int, k: int | None, method: str | None = None) -> RequestTiming:
        clock = TokenArrivals()
        self.client.async_stream_infer(self.model, _infer_inputs(self.module, prompt_ids, max_tokens, k, method))
        while True:
            now, result, error = self.responses.get(timeout=self.timeout_s)
            if error is not None:
                clock.timing.error = str(error)
                break
            ids = result.as_numpy("output_ids").reshape(-1)
            clock.arrived(int(ids.size), now, ids=[int(x) for x in ids])
            clock.timing.take_stats(*_stats(result))
            if result.as_numpy("finish_reason").reshape(-1)[0]:  # "" until the final response
                break
        return clock.done()

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


class OpenAIClient:
    """The OpenAI-compatible endpoint's streamed completions (server-sent events, one chunk per engine step).

    The stream carries text, not ids: the output compared for exact match is the text, the token count the final
    usage chunk's, and each chunk's gap is spread over the mean tokens per chunk (TTFT and TPOT are exact)."""

    def __init__(self, url: str, model: str, timeout_s: float = 300.0):
        import http.client
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        self.path, self.model = f"{parts.path.rstrip('/')}/completions", model
        self.connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)

    def send(self, prompt_ids: list[int], max_tokens: int, k: int | None, method: str | None = None) -> RequestTiming:
        import json

        body = {"model": self.model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        if k is not None:
            body["num_draft_tokens"] = k
        if method is not None:
            body["speculative_method"] = method
        timing, arrivals, text = RequestTiming(), [], []
        self.connection.request("POST", self.path, json.dumps(body), {"Content-Type": "application/json"})
        response = self.connection.getresponse()
        if response.status != 200:
            timing.error = f"HTTP {response.status}: {response.read()[:300]!r}"
            return timing
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                timing.error = str(chunk["error"])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter() - timing.started)
                text.append(chunk["choices"][0]["text"])
            if (stats := chunk.get("speculative")) is not None:
                timing.take_stats(stats["draft_tokens"], stats["accepted_tokens"], stats["target_steps"])
            if chunk.get("usage"):
                timing.tokens = int(chunk["usage"]["completion_tokens"])
        timing.last_s = time.perf_counter() - timing.started
        timing.output = "".join(text)
        _spread_chunks(timing, arrivals)
        return timing

    def close(self) -> None:
        self.connection.close()


def _spread_chunks(timing: RequestTiming, arrivals: list[float]) -> None:
    """First-token time and per-token gaps from chunk arrival times when only the total token count is known."""
    if not arrivals:
        return
    timing.first_s = arrivals[0]
    per_chunk = (timing.tokens - 1) / (len(arrivals) - 1) if len(arrivals) > 1 and timing.tokens > 1 else 1.0
    for earlier, later in zip(arrivals, arrivals[1:]):
        timing.itl_s.extend([(later - earlier) / per_chunk] * max(round(per_chunk), 1))
