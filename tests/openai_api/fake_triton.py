"""A fake tritonserver for the OpenAI endpoint's tests: the gRPC ModelStreamInfer of ``speculative_stream``, one
token ("a", id 1) per step, ``max_tokens`` steps ``step_s`` apart, the last with finish_reason "length".

It records every request's inputs and whether it ended early (the client cancelled it). ``python -m
tests.openai_api.fake_triton STEP_S`` runs it in its own process and prints its port, for tests that kill it.
"""

from __future__ import annotations

import struct
import sys
import threading
import time
from concurrent import futures

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

NUMPY = {"INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BOOL": np.bool_}
STATS = {"draft_tokens": "INT32", "accepted_tokens": "INT32", "target_steps": "INT32", "acceptance_rate": "FP32",
         "mean_accepted_len": "FP32"}


def _bytes_tensor(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<I", len(data)) + data


def _step(prompt_tokens: int, finish_reason: str) -> service_pb2.ModelStreamInferResponse:
    outputs = [("text_output", "BYTES", _bytes_tensor("a")), ("output_ids", "INT32", np.int32([1]).tobytes()),
               ("finish_reason", "BYTES", _bytes_tensor(finish_reason)),
               ("prompt_tokens", "INT32", np.int32([prompt_tokens]).tobytes())]
    outputs += [(name, dtype, np.array([1], NUMPY[dtype]).tobytes()) for name, dtype in STATS.items()]
    response = service_pb2.ModelInferResponse(model_name="speculative_stream")
    for name, dtype, raw in outputs:
        response.outputs.add(name=name, datatype=dtype, shape=[1, 1])
        response.raw_output_contents.append(raw)
    return service_pb2.ModelStreamInferResponse(infer_response=response)


def _inputs(request: service_pb2.ModelInferRequest) -> dict:
    values = {}
    for tensor, raw in zip(request.inputs, request.raw_input_contents):
        if tensor.datatype == "BYTES":
            values[tensor.name] = raw[4:].decode()
        else:
            values[tensor.name] = np.frombuffer(raw, NUMPY[tensor.datatype]).reshape(-1).tolist()
    return values


class FakeTriton(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, step_s: float = 0.0):
        self.step_s = step_s
        self.requests: list[dict] = []  # each request's inputs, in arrival order
        self.ended_early = 0  # requests whose client went away before the last step
        self._lock = threading.Lock()

    def ModelStreamInfer(self, request_iterator, context):  # noqa: N802 - the gRPC method's name
        request = next(request_iterator)
        inputs = _inputs(request)
        with self._lock:
            self.requests.append(inputs)
        steps, sent = inputs["max_tokens"][0], 0
        try:
            while sent < steps and context.is_active():
                time.sleep(self.step_s)
                sent += 1  # counted before the yield: the generator may be closed while it waits there
                yield _step(3, "length" if sent == steps else "")
        finally:
            if sent < steps:
                with self._lock:
                    self.ended_early += 1

    def serve(self, port: int = 0) -> tuple[grpc.Server, int]:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(self, server)
        port = server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        return server, port


if __name__ == "__main__":
    _, bound = FakeTriton(float(sys.argv[1])).serve()
    print(bound, flush=True)
    threading.Event().wait()
