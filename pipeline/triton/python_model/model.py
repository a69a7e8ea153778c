"""Triton Python-backend models that serve the batched speculative engine (torch backend).

Copied into the model repository as ``<model>/1/model.py`` by ``python -m pipeline deploy``; the config.pbtxt
parameter ``role`` says which part this instance plays:

- ``engine`` (model ``speculative_stream``, decoupled): loads the executor once and runs its engine on a background
  thread (pipeline.executor.serving_loop.ServingLoop). execute() only parses and submits, so every concurrent request,
  from any client, shares the same draft and verify forwards (in-flight batching). One response per target step;
  a client that cancels or disconnects frees its slot within a step.
- ``proxy`` (model ``speculative``, one response per request): a thin instance, several in parallel, that forwards
  its request to the engine model (BLS, decoupled), gathers the per-step responses into one, and cancels the engine
  request when its own client goes away. Python-backend instances are separate processes, so this is how a
  request/response model shares the engine instead of loading the models again.

Other config.pbtxt parameters: ``pipeline_root`` (put on sys.path so ``pipeline`` imports), ``engines_dir``,
``config_name``, ``device``, ``adaptive_draft_len``, ``method``, ``ngram_min_match``, ``ngram_max_match``, ``suffix``
(the config's drafting method, lookup settings and suffix trees' settings as JSON; without them the engines' recorded
ones), ``engine_model``,
``request_timeout_s`` (the proxy's deadline per request) and ``prefix_cache_metrics``. Both export the counters ``spec_*_total`` on Triton's metrics
port, the engine model also ``spec_drafted_at_position_total`` / ``spec_accepted_at_position_total`` per draft
position (label ``position``; for Medusa the tree depth) (the engine model counts all the work it did, proxied requests included; the
proxy the requests it answered);
the engine model also exports the gauges ``spec_batch_occupancy`` and ``spec_queue_depth``, the counters
``spec_prefix_prompt_tokens_total`` / ``spec_prefix_cached_tokens_total`` (prompt tokens looked up in the prefix
cache / reused from it; only with ``prefix_cache_metrics``), ``spec_engine_steps_total``, ``spec_engine_step_rows_total`` (mean occupancy over an
interval = rate(rows) / rate(steps) / max batch size) and ``spec_prefill_tokens_total``.
"""

import json
import locale
import queue
import sys
import threading
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

# (metric name, description, GenerationStats field) for the acceptance counters.
COUNTERS = [
    ("spec_draft_tokens_total", "Draft tokens proposed", "draft_tokens"),
    ("spec_accepted_tokens_total", "Draft tokens accepted by the target", "accepted_tokens"),
    ("spec_target_steps_total", "Target forward passes (verification steps)", "target_steps"),
    ("spec_generated_tokens_total", "Tokens returned to clients", "generated_tokens"),
]
POSITION_COUNTERS = [
    ("spec_drafted_at_position_total", "Steps that drafted a token at this position (Medusa: tree depth)",
     "drafted_at"),
    ("spec_accepted_at_position_total", "Steps whose token at this position (Medusa: tree depth) the target kept",
     "accepted_at"),
]
# (metric name, description, engine attribute, field) for the engine model's running totals: the prefix cache's
# reuse, and the batch each step ran (mean occupancy = rate(rows) / rate(steps) / max batch size).
ENGINE_COUNTERS = [
    ("spec_prefix_prompt_tokens_total", "Prompt tokens looked up in the prefix cache", "prefix_stats",
     "queried_tokens"),
    ("spec_prefix_cached_tokens_total", "Prompt tokens whose KV was reused from the prefix cache instead of computed",
     "prefix_stats", "hit_tokens"),
    ("spec_engine_steps_total", "Engine steps that ran a forward", "counters", "steps"),
    ("spec_engine_step_rows_total", "Running requests summed over engine steps", "counters", "rows"),
    ("spec_prefill_tokens_total", "Prompt tokens computed by prefill chunks", "counters", "prefill_tokens"),
]
KEY_INPUT = "request_key"  # set by the proxy on the requests it forwards
CANCEL_INPUT = "cancel_request"  # a request holding only this cancels the engine request with that key
FINAL_ONLY_INPUT = "final_only"  # set by the proxy: one response at the end instead of one per step
PROXY_POLL_S = 0.02  # how often a proxy waiting for its answer checks whether its client went away
OUTPUT_NAMES = ["text_output", "output_ids", "finish_reason", "prompt_tokens", "draft_tokens", "accepted_tokens",
                "target_steps", "acceptance_rate", "mean_accepted_len", "logprobs"]


def _utf8_locale() -> None:
    """The stub embeds the interpreter without setting the C locale, so files open as ASCII whatever LANG says;
    inductor reads its UTF-8 kernel templates that way (runtime.torch_compile failed to load the model)."""
    for name in ("C.UTF-8", "C.utf8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_CTYPE, name)
            return
        except locale.Error:
            continue


def _compile_options(params: dict) -> dict:
    """runtime.torch_compile ("true", "false" or "max-autotune") and runtime.compile_max_width, for open_executor."""
    mode = params.get("torch_compile", "false")
    width = params.get("compile_max_width")
    return {"compile": {"true": True, "false": False}.get(mode, mode),
            "compile_max_width": int(width) if width else None}


class TritonPythonModel:
    def initialize(self, args):
        _utf8_locale()
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.role = params.get("role", "engine")
        self.labels = {"model": args["model_name"], "version": args["model_version"]}
        self.families = []  # families must outlive their metrics (Triton refuses updates to a freed family)
        self.failed_requests = self._counter("spec_requests_total", "Requests by outcome",
                                             {**self.labels, "outcome": "error"})
        self.ok_requests = self.families[-1].Metric(labels={**self.labels, "outcome": "ok"})
        self.cancelled_requests = self.families[-1].Metric(labels={**self.labels, "outcome": "cancelled"})
        self.logger = pb_utils.Logger
        self.counters = {field: self._counter(name, description, self.labels)
                         for name, description, field in COUNTERS}
        if self.role == "proxy":
            self.engine_model = params["engine_model"]
            self.timeout_s = float(params.get("request_timeout_s") or 0) or None
            return
        # Per draft position (a Medusa tree's depth), on the engine model: how often a step drafted there and how
        # often the target kept it; one metric per position label, made when the position first occurs.
        self.position_families = {field: self._family(name, description, pb_utils.MetricFamily.COUNTER)
                                  for name, description, field in POSITION_COUNTERS}
        self.position_metrics = {}
        if params["pipeline_root"] not in sys.path:
            sys.path.insert(0, params["pipeline_root"])
        from pipeline.executor import RequestError, open_executor
        from pipeline.methods import NgramSettings, SuffixSettings
        from pipeline.executor.serving_loop import ServingLoop
        from pipeline.triton.logprob_outputs import logprobs_json
        from pipeline.triton.request_inputs import parse_request

        self.RequestError, self.parse_request, self.logprobs_json = RequestError, parse_request, logprobs_json
        self.executor = open_executor(
            params["engines_dir"], device=params.get("device") or None,
            adaptive_draft_len=params.get("adaptive_draft_len", "true") == "true",
            method=params.get("method") or None,
            ngram=NgramSettings(int(params["ngram_min_match"]), int(params["ngram_max_match"]))
            if "ngram_min_match" in params else None,
            suffix=SuffixSettings(**json.loads(params["suffix"])) if "suffix" in params else None,
            **_compile_options(params))
        self.engine_draft_len = self.executor.engine_draft_len or self.executor.max_draft_len
        self.model_source = f"the served model ({params.get('config_name') or args['model_name']})"
        self.occupancy = self._gauge("spec_batch_occupancy", "Running requests / max batch size")
        self.queue_depth = self._gauge("spec_queue_depth", "Requests waiting for a batch slot")
        # Counters advance by the engine totals' growth since the last step (Triton counters only increment); work
        # done while loading (warm-up) is not served work, so counting starts from the totals now.
        # The prefix-cache counters tell, block by block, whether some other client sent a prompt: exported only
        # when the config asks (serve.prefix_cache_metrics), the metrics port having no authentication.
        exported = [c for c in ENGINE_COUNTERS
                    if params.get("prefix_cache_metrics", "false") == "true" or c[2] != "prefix_stats"]
        self.engine_counters = [(self._counter(name, description, self.labels), source, field)
                                for name, description, source, field in exported]
        self.engine_seen = [getattr(getattr(self.executor.engine, source), field)
                            for _, source, field in self.engine_counters]
        # Responses leave through their own thread: IPC to Triton then overlaps the next step's forwards instead
        # of stalling the engine once per row per step.
        self.outbox = queue.SimpleQueue()
        self.sender_thread = threading.Thread(target=self._send_loop, name="responses", daemon=True)
        self.sender_thread.start()
        self.loop = ServingLoop(self.executor.engine, on_step=self._on_step)

    def finalize(self):
        if self.role == "engine":
            self.loop.stop()
            self.outbox.put(None)
            self.sender_thread.join(10)

    def _send_loop(self):
        while True:
            item = self.outbox.get()
            if item is None:
                return
            sender, response, flags = item
            try:
                sender.send(response, flags=flags)
            except Exception:  # noqa: BLE001 - the client is gone; the engine notices through is_cancelled
                pass

    def execute(self, requests):
        if self.role == "proxy":
            return [self._proxy(request) for request in requests]
        for request in requests:
            self._submit(request)
        return None

    # ---- engine role ---------------------------------------------------------------------------------------------

    def _submit(self, request):
        sender = request.get_response_sender()
        cancel_key = _string_input(request, CANCEL_INPUT)
        if cancel_key is not None:
            self.loop.cancel_key(cancel_key)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        try:
            args = self.parse_request(lambda name: _input(request, name), self.engine_draft_len,
                                      self.executor.max_input_len)
            prompt, turn_end = args.executor_prompt(self.executor.tokenizer, self.model_source)
            spec_request = self.executor.new_request(prompt, stop_token_ids=turn_end,
                                                     **args.executor_kwargs(self.executor.tokenizer))
        except Exception as exc:  # noqa: BLE001 - reported to this client; the model keeps serving others
            sender.send(self._error_response(exc), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        prompt_tokens = len(spec_request.prompt_ids)
        final_only = bool(_scalar_input(request, FINAL_ONLY_INPUT))
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

        def on_event(event):
            if isinstance(event, BaseException):
                self.outbox.put((sender, self._error_response(event), final))
                return
            if event.finish_reason == "cancelled":  # the client went away: count it, answer if it still listens
                self.cancelled_requests.increment(1)
            elif event.finished:
                self._count(event.stats)
            if final_only and not event.finished:
                return
            if final_only:  # the whole answer in one response
                text, ids = self.executor.decode(spec_request.generated), spec_request.generated
                logprobs = spec_request.token_logprobs if spec_request.logprobs is not None else None
            else:
                text, ids, logprobs = event.text, event.token_ids, event.logprobs
            response = pb_utils.InferenceResponse(output_tensors=_tensors(
                text, ids, event.finish_reason or "", prompt_tokens, event.stats,
                self.logprobs_json(logprobs, self.executor.tokenizer)))
            self.outbox.put((sender, response, final if event.finished else 0))

        self.loop.submit(spec_request, on_event, is_cancelled=sender.is_cancelled,
                         key=_string_input(request, KEY_INPUT))

    def _on_step(self, running, waiting):
        self.occupancy.set(running / self.executor.max_batch_size)
        self.queue_depth.set(waiting)
        engine = self.executor.engine
        for i, (metric, source, field) in enumerate(self.engine_counters):
            total = getattr(getattr(engine, source), field)
            if total > self.engine_seen[i]:
                metric.increment(total - self.engine_seen[i])
            self.engine_seen[i] = total

    # ---- proxy role -----------------------------------------------------------------------------------------------

    def _proxy(self, request):
        key = uuid.uuid4().hex
        inputs = [t for t in request.inputs() if t.name() not in (KEY_INPUT, CANCEL_INPUT, FINAL_ONLY_INPUT)]
        inputs.append(pb_utils.Tensor(KEY_INPUT, np.array([[key.encode()]], dtype=np.object_)))
        inputs.append(pb_utils.Tensor(FINAL_ONLY_INPUT, np.array([[True]], dtype=np.bool_)))
        forward = pb_utils.InferenceRequest(model_name=self.engine_model, inputs=inputs,
                                            requested_output_names=OUTPUT_NAMES)
        # The engine answers once, at the end; meanwhile this thread watches for the client going away and for the
        # request's deadline (a request past it is cancelled in the engine and answered with an error).
        answers = []
        worker = threading.Thread(target=lambda: answers.extend(forward.exec(decoupled=True)), daemon=True)
        worker.start()
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while worker.is_alive():
            worker.join(PROXY_POLL_S)
            late = deadline is not None and time.monotonic() > deadline
            if worker.is_alive() and (late or request.is_cancelled()):
                self._cancel_forward(key)
                worker.join()
                if late:
                    error = pb_utils.TritonError(f"request timed out: no answer within {self.timeout_s:g} s "
                                                 f"(serve.request_timeout_s); ask for fewer max_tokens")
                    return self._count_error(pb_utils.InferenceResponse(output_tensors=[], error=error))
                self.cancelled_requests.increment(1)
                error = pb_utils.TritonError("request cancelled by the client",
                                             getattr(pb_utils.TritonError, "CANCELLED", None))
                return pb_utils.InferenceResponse(output_tensors=[], error=error)
        text, ids, logprobs, last = [], [], [], None
        for response in answers:
            if response.has_error():
                return self._count_error(pb_utils.InferenceResponse(output_tensors=[], error=response.error()))
            outputs = {name: pb_utils.get_output_tensor_by_name(response, name) for name in OUTPUT_NAMES}
            if outputs["text_output"] is None:  # the empty final-flag response
                continue
            text.append(outputs["text_output"].as_numpy().reshape(-1)[0])
            ids.extend(outputs["output_ids"].as_numpy().reshape(-1).tolist())
            entries = outputs["logprobs"].as_numpy().reshape(-1)[0] if outputs["logprobs"] is not None else b""
            logprobs.append(entries)
            last = outputs
        if last is None:
            error = pb_utils.TritonError("internal error: the engine model returned no response")
            return self._count_error(pb_utils.InferenceResponse(output_tensors=[], error=error))
        self.ok_requests.increment(1)
        totals = {field: int(last[field].as_numpy().reshape(-1)[0])
                  for field in ("draft_tokens", "accepted_tokens", "target_steps")}
        totals["generated_tokens"] = len(ids)
        for field, metric in self.counters.items():  # this model's share; the engine model counts all its work
            if totals[field]:
                metric.increment(totals[field])
        merged = [pb_utils.Tensor("text_output", np.array([[b"".join(text)]], dtype=np.object_)),
                  pb_utils.Tensor("output_ids", np.array([ids], dtype=np.int32).reshape(1, -1)),
                  pb_utils.Tensor("logprobs", np.array([[merge_logprobs(logprobs)]], dtype=np.object_))]
        merged += [pb_utils.Tensor(name, last[name].as_numpy()) for name in OUTPUT_NAMES[2:-1]]
        return pb_utils.InferenceResponse(output_tensors=merged)

    def _cancel_forward(self, key):
        cancel = pb_utils.InferenceRequest(
            model_name=self.engine_model, requested_output_names=[],
            inputs=[pb_utils.Tensor(CANCEL_INPUT, np.array([[key.encode()]], dtype=np.object_))])
        for _ in cancel.exec(decoupled=True):
            pass

    # ---- helpers ---------------------------------------------------------------------------------------------------

    def _family(self, name, description, kind):
        family = pb_utils.MetricFamily(name=name, description=description, kind=kind)
        self.families.append(family)
        return family

    def _counter(self, name, description, labels):
        return self._family(name, description, pb_utils.MetricFamily.COUNTER).Metric(labels=labels)

    def _gauge(self, name, description):
        return self._family(name, description, pb_utils.MetricFamily.GAUGE).Metric(labels=self.labels)

    def _count(self, stats):
        self.ok_requests.increment(1)
        for field, metric in self.counters.items():
            value = getattr(stats, field)
            if value:
                metric.increment(value)
        for field, family in self.position_families.items():
            for position, value in enumerate(getattr(stats, field), 1):
                key = (field, position)
                if key not in self.position_metrics:
                    self.position_metrics[key] = family.Metric(labels={**self.labels, "position": str(position)})
                if value:
                    self.position_metrics[key].increment(value)

    def _count_error(self, response):
        self.failed_requests.increment(1)
        return response

    def _error_response(self, exc):
        self.failed_requests.increment(1)
        if isinstance(exc, self.RequestError):
            message, code = str(exc), getattr(pb_utils.TritonError, "INVALID_ARG", None)
        else:
            message, code = f"internal error: {type(exc).__name__}: {exc}", None
            self.logger.log_error(message)
        error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
        return pb_utils.InferenceResponse(output_tensors=[], error=error)


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _scalar_input(request, name):
    value = _input(request, name)
    return None if value is None or value.size == 0 else value.reshape(-1)[0]


def _string_input(request, name):
    value = _input(request, name)
    if value is None or value.size == 0:
        return None
    raw = value.reshape(-1)[0]
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


def merge_logprobs(parts):
    """The logprobs outputs of a request's steps (JSON lists, or empty) -> one JSON list, or b"" when none had any."""
    lists = [json.loads(part) for part in parts if part]
    return json.dumps([entry for entries in lists for entry in entries], ensure_ascii=False).encode() if lists else b""


def _tensors(text, token_ids, finish_reason, prompt_tokens, stats, logprobs=b""):
    """Output tensors for one response: batch dimension 1 on every output (max_batch_size > 0)."""

    def scalar(name, value, dtype):
        return pb_utils.Tensor(name, np.array([[value]], dtype=dtype))

    return [
        pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
        pb_utils.Tensor("output_ids", np.array([list(token_ids)], dtype=np.int32).reshape(1, -1)),
        pb_utils.Tensor("finish_reason", np.array([[finish_reason.encode("utf-8")]], dtype=np.object_)),
        scalar("prompt_tokens", prompt_tokens, np.int32),
        scalar("draft_tokens", stats.draft_tokens, np.int32),
        scalar("accepted_tokens", stats.accepted_tokens, np.int32),
        scalar("target_steps", stats.target_steps, np.int32),
        scalar("acceptance_rate", stats.acceptance_rate, np.float32),
        scalar("mean_accepted_len", stats.mean_accepted_len, np.float32),
        pb_utils.Tensor("logprobs", np.array([[logprobs]], dtype=np.object_)),
    ]
