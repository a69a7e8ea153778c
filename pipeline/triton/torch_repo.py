"""The torch backend's model repository: Python-backend models around one batched speculative engine.

- ``speculative_stream``  decoupled, one instance: hosts the engine (models loaded once); one response per target
                          step. Every request, from either model, joins the engine's running batch.
- ``speculative``         request/response: thin proxy instances (one per batch row, one request each at a time)
                          that forward to ``speculative_stream`` (BLS) and answer with one response holding the
                          text, ids and acceptance stats.

Both run ``python_model/model.py`` (copied in as ``<model>/1/model.py``); the ``role`` parameter picks the part.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from ..config import PipelineConfig
from ..serving_contract import ENGINE_INPUTS, INPUTS, MODEL, OUTPUTS, REQUIRED_INPUTS, STREAM_MODEL
from .pbtxt import cpu_instances, set_parameters, tensor_in, tensor_out, to_text, write_model

MODEL_FILE = Path(__file__).with_name("python_model") / "model.py"
PIPELINE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds the `pipeline` package


def model_config(config: PipelineConfig, name: str, engine: bool, engines_root: Path) -> mc.ModelConfig:
    model = mc.ModelConfig(name=name, backend="python", max_batch_size=config.build.max_batch_size)
    model.model_transaction_policy.decoupled = engine
    if engine:  # requests queue here and reach execute() together; it only hands them to the running batch
        model.dynamic_batching.max_queue_delay_microseconds = config.serve.max_queue_delay_us
    for tname, dtype, dims in INPUTS + (ENGINE_INPUTS if engine else []):
        # A cancel request carries nothing else, so the engine model checks max_tokens itself.
        required = tname in REQUIRED_INPUTS and not engine
        model.input.append(tensor_in(tname, dtype, dims, optional=not required, ragged=tname == "input_ids"))
    for tname, dtype, dims in OUTPUTS:
        model.output.append(tensor_out(tname, dtype, dims))
    # KIND_CPU even on a GPU box: the executor places the models itself (runtime.device). One engine instance (a
    # second would load the models again and batch separately). A proxy forwards one request at a time (no dynamic
    # batching: requests handed to one execute() together waited for each other, and the batch ran half full under
    # load), one proxy per batch row. More proxies add nothing measurable and each one slows the server's shutdown.
    proxies = max(config.serve.instances, config.build.max_batch_size)
    model.instance_group.append(cpu_instances(1 if engine else proxies))
    set_parameters(model, {
        "role": "engine" if engine else "proxy",
        "engine_model": STREAM_MODEL,
        "engines_dir": engines_root.resolve(),
        "pipeline_root": PIPELINE_ROOT,
        "device": "" if config.runtime.device == "auto" else config.runtime.device,
        "adaptive_draft_len": "true",
        "torch_compile": str(config.runtime.torch_compile).lower(),  # true, false or max-autotune
        "compile_max_width": config.runtime.compile_max_width,
        "method": config.speculative.method,
        "ngram_min_match": config.speculative.ngram.min_match,
        "ngram_max_match": config.speculative.ngram.max_match,
        "suffix": json.dumps(config.speculative.suffix.model_dump(), sort_keys=True),
        "config_name": config.name,
        "request_timeout_s": config.serve.request_timeout_s,
        "prefix_cache_metrics": config.serve.prefix_cache_metrics,
        # For clients: the largest num_draft_tokens the model takes (scripts/load_test.py reads it from here).
        "max_draft_len": config.speculative.medusa.tree().max_depth if config.speculative.medusa is not None
        and config.speculative.method == "medusa" else config.speculative.max_draft_len,
    })
    return model


def write_torch_repository(repo: Path, config: PipelineConfig, engines_root: Path) -> list[Path]:
    folders = []
    for model in model_configs(config, engines_root):
        folder = write_model(repo, model)
        shutil.copyfile(MODEL_FILE, folder / "1" / "model.py")
        folders.append(folder)
    return folders


def model_configs(config: PipelineConfig, engines_root: Path) -> list[mc.ModelConfig]:
    """The repository's two models as written: the request/response proxy and the engine model."""
    return [model_config(config, name, engine, engines_root) for name, engine in ((MODEL, False), (STREAM_MODEL, True))]


def configs_digest(config: PipelineConfig, engines_root: Path) -> str:
    """A digest of the config.pbtxt texts this code writes: a deployed repository is stale when it changes (a new
    input in the serving contract, a changed instance count), whatever the pipeline config says."""
    return hashlib.sha256("".join(to_text(m) for m in model_configs(config, engines_root)).encode()).hexdigest()
