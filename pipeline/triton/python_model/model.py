"""Triton Python-backend model that serves the speculative executor (torch backend).

Copied into the model repository as ``<model>/1/model.py`` by ``python -m pipeline deploy``. config.pbtxt
parameters say where things are: ``pipeline_root`` (put on sys.path so ``pipeline`` imports), ``engines_dir``
(``engines/<name>`` with target/ and draft/ builds) and ``device``. A decoupled config streams one response per
target step; otherwise each request gets one response. Every request also updates the custom metrics
``spec_*_total`` exported on Triton's metrics port.
"""

import json
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

# (metric name, description, GenerationStats field) for the acceptance counters.
COUNTERS = [
    ("spec_draft_tokens_total", "Draft tokens proposed", "draft_tokens"),
    ("spec_accepted_tokens_total", "Draft tokens accepted by the target", "accepted_tokens"),
    ("spec_target_steps_total", "Target forward passes (verification steps)", "target_steps"),
    ("spec_generated_tokens_total", "Tokens returned to clients", "generated_tokens"),
]


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        if params["pipeline_root"] not in sys.path:
            sys.path.insert(0, params["pipeline_root"])
        from pipeline.executor import RequestError, SpeculativeExecutor
        from pipeline.triton.request_inputs import parse_request

        self.RequestError = RequestError
        self.parse_request = parse_request
        self.executor = SpeculativeExecutor.from_engines(params["engines_dir"], device=params.get("device") or None)
        self.k_limit = self.executor.draft_len_limit or self.executor.max_draft_len
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.logger = pb_utils.Logger
        labels = {"model": args["model_name"], "version": args["model_version"]}
        # Families must outlive their metrics (Triton refuses to update a metric whose family was freed).
        self.families, self.counters = [], {}
        for name, description, field in COUNTERS:
            family = pb_utils.MetricFamily(name=name, description=description, kind=pb_utils.MetricFamily.COUNTER)
            self.families.append(family)
            self.counters[field] = family.Metric(labels=labels)
        requests = pb_utils.MetricFamily(name="spec_requests_total", description="Requests by outcome",
                                         kind=pb_utils.MetricFamily.COUNTER)
        self.families.append(requests)
        self.ok_requests = requests.Metric(labels={**labels, "outcome": "ok"})
        self.failed_requests = requests.Metric(labels={**labels, "outcome": "error"})

    # ---- request handling ------------------------------------------------------------------------------------------

    def execute(self, requests):
        if self.decoupled:
            for request in requests:
                self._stream(request)
            return None
        return [self._respond(request) for request in requests]

    def _args(self, request):
        def get(name):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        return self.parse_request(get, self.k_limit)

    def _respond(self, request):
        try:
            args = self._args(request)
            result = self.executor.generate([args.prompt], **args.executor_kwargs())[0]
        except Exception as exc:  # noqa: BLE001 - one bad request must not take the server down
            return self._error_response(exc)
        self._count(result.stats)
        return pb_utils.InferenceResponse(output_tensors=_tensors(
            result.text, result.token_ids, result.finish_reason, result.prompt_tokens, result.stats))

    def _stream(self, request):
        sender = request.get_response_sender()
        try:
            args = self._args(request)
            prompt_tokens = len(self.executor.encode(args.prompt))
            event = None
            for event in self.executor.generate_stream(args.prompt, **args.executor_kwargs()):
                response = pb_utils.InferenceResponse(output_tensors=_tensors(
                    event.text, event.token_ids, event.finish_reason or "", prompt_tokens, event.stats))
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if event.finished else 0
                sender.send(response, flags=flags)
        except Exception as exc:  # noqa: BLE001 - reported to this client; the model keeps serving others
            sender.send(self._error_response(exc), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        if event is not None:
            self._count(event.stats)

    # ---- helpers ---------------------------------------------------------------------------------------------------

    def _count(self, stats):
        self.ok_requests.increment(1)
        for field, metric in self.counters.items():
            value = getattr(stats, field)
            if value:
                metric.increment(value)

    def _error_response(self, exc):
        self.failed_requests.increment(1)
        if isinstance(exc, self.RequestError):
            message, code = str(exc), getattr(pb_utils.TritonError, "INVALID_ARG", None)
        else:
            message, code = f"internal error: {type(exc).__name__}: {exc}", None
            self.logger.log_error(message)
        error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
        return pb_utils.InferenceResponse(output_tensors=[], error=error)


def _tensors(text, token_ids, finish_reason, prompt_tokens, stats):
    """Output tensors for one request: batch dimension 1 on every output (max_batch_size > 0)."""

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
    ]
