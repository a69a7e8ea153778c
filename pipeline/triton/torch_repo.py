"""The torch backend's model repository: Python-backend models that run the SpeculativeExecutor.

- ``speculative``         request/response: one response per request with the text, ids and acceptance stats
- ``speculative_stream``  decoupled: one response per target step (the tokens that step accepted)

Both run ``python_model/model.py`` (copied in as ``<model>/1/model.py``); each instance loads its own executor,
so serving both doubles model memory (fine for the CPU reference path; the GPU production path is trtllm).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from ..config import PipelineConfig
from .pbtxt import cpu_instances, set_parameters, tensor_in, tensor_out, write_model

MODEL = "speculative"
STREAM_MODEL = "speculative_stream"
MODEL_FILE = Path(__file__).with_name("python_model") / "model.py"
PIPELINE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds the `pipeline` package

INPUTS: list[tuple[str, str, list[int]]] = [
    ("text_input", "STRING", [1]),
    ("input_ids", "INT32", [-1]),
    ("max_tokens", "INT32", [1]),
    ("temperature", "FP32", [1]),
    ("top_k", "INT32", [1]),
    ("top_p", "FP32", [1]),
    ("seed", "UINT64", [1]),
    ("num_draft_tokens", "INT32", [1]),
]
REQUIRED_INPUTS = {"max_tokens"}  # text_input XOR input_ids is checked by the model

OUTPUTS: list[tuple[str, str, list[int]]] = [
    ("text_output", "STRING", [1]),
    ("output_ids", "INT32", [-1]),
    ("finish_reason", "STRING", [1]),
    ("prompt_tokens", "INT32", [1]),
    ("draft_tokens", "INT32", [1]),
    ("accepted_tokens", "INT32", [1]),
    ("target_steps", "INT32", [1]),
    ("acceptance_rate", "FP32", [1]),
    ("mean_accepted_len", "FP32", [1]),
]


def model_config(config: PipelineConfig, name: str, decoupled: bool, engines_root: Path) -> mc.ModelConfig:
    model = mc.ModelConfig(name=name, backend="python", max_batch_size=config.build.max_batch_size)
    model.model_transaction_policy.decoupled = decoupled
    # Requests queue here and reach execute() together; the executor then runs them one after another.
    model.dynamic_batching.max_queue_delay_microseconds = config.serve.max_queue_delay_us
    for tname, dtype, dims in INPUTS:
        model.input.append(tensor_in(tname, dtype, dims, optional=tname not in REQUIRED_INPUTS,
                                     ragged=tname == "input_ids"))
    for tname, dtype, dims in OUTPUTS:
        model.output.append(tensor_out(tname, dtype, dims))
    # KIND_CPU even on a GPU box: the executor places the models itself (runtime.device).
    model.instance_group.append(cpu_instances(config.serve.instances))
    set_parameters(model, {
        "engines_dir": engines_root.resolve(),
        "pipeline_root": PIPELINE_ROOT,
        "device": "" if config.runtime.device == "auto" else config.runtime.device,
        "config_name": config.name,
        "max_draft_len": config.speculative.max_draft_len,
    })
    return model


def write_torch_repository(repo: Path, config: PipelineConfig, engines_root: Path) -> list[Path]:
    folders = []
    for name, decoupled in ((MODEL, False), (STREAM_MODEL, True)):
        folder = write_model(repo, model_config(config, name, decoupled, engines_root))
        shutil.copyfile(MODEL_FILE, folder / "1" / "model.py")
        folders.append(folder)
    return folders
