"""pipeline/openai_api/triton_stream.py without a server: request values -> Triton tensors (dtypes from the model's
own input table), and the model's error messages -> HTTP statuses."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")

from pipeline.openai_api.triton_stream import infer_inputs, request_error  # noqa: E402
from pipeline.serving_contract import INPUTS  # noqa: E402


def test_values_become_batch_of_one_tensors_of_the_models_dtypes():
    tensors = {t.name(): t for t in infer_inputs({"text_input": "ü", "input_ids": [3, 4, 5], "max_tokens": 7,
                                                  "temperature": 0.5, "seed": 2**64 - 1, "num_draft_tokens": 0})}
    declared = {name: "BYTES" if dtype == "STRING" else dtype for name, dtype, _ in INPUTS}
    assert {name: t.datatype() for name, t in tensors.items()} == {name: declared[name] for name in tensors}
    assert tensors["text_input"].shape() == [1, 1] and tensors["input_ids"].shape() == [1, 3]
    assert tensors["max_tokens"].shape() == [1, 1]
    # the bytes that travel: UTF-8 text, exact 64-bit seed
    request = tensors["seed"]._get_content()  # noqa: SLF001 - the serialized tensor is what Triton receives
    assert np.frombuffer(request, dtype=np.uint64)[0] == 2**64 - 1
    assert "ü".encode() in tensors["text_input"]._get_content()  # noqa: SLF001


def test_max_tokens_fit_is_a_bool_tensor():
    assert ("max_tokens_fit", "BOOL", [1]) in INPUTS  # the models' own table (pipeline/serving_contract.py)
    tensor, = infer_inputs({"max_tokens_fit": True})
    assert (tensor.name(), tensor.datatype(), tensor.shape()) == ("max_tokens_fit", "BOOL", [1, 1])
    assert np.frombuffer(tensor._get_content(), dtype=np.bool_).tolist() == [True]  # noqa: SLF001


@pytest.mark.parametrize("message, status, param", [
    ("temperature: -1.0 must be a finite number >= 0 (0 = greedy)", 400, "temperature"),
    ("text_input: 9000 bytes is over the 8192-byte limit", 400, "prompt"),
    ("max_new_tokens: 6 prompt + 600 new tokens exceeds max_seq_len 512; ask for at most 506", 400, "max_tokens"),
    ("messages: message 0 role 'robot' is not one of system, user", 400, "messages"),
    ("text_input / input_ids / messages: send exactly one of them", 400, None),
    ("internal error: RuntimeError: CUDA out of memory", 500, None),
    ("Request for unknown model: 'speculative_stream' is not found", 503, None),
], ids=["value", "prompt-size", "room", "role", "no-field", "internal", "model-gone"])
def test_model_errors_become_statuses(message, status, param):
    error = request_error(message)
    assert (error.status, error.param) == (status, param)
    assert message in error.message
