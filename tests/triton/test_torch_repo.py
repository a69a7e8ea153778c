"""pipeline/triton/torch_repo.py: the torch backend's Python-backend model configs, parsed back into tritonclient's
ModelConfig."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from pipeline.config import parse_config
from pipeline.methods import SuffixSettings
from pipeline.triton import torch_repo
from pipeline.triton.pbtxt import parse, to_text
from tests.conftest import tiny_config_dict


def test_deploy_passes_the_method_to_the_served_engine(tiny_pair, tmp_path):
    from tests.conftest import tiny_config_dict

    from pipeline.config import parse_config
    from pipeline.triton import torch_repo

    data = tiny_config_dict(tiny_pair)
    config = parse_config({**data, "speculative": {"method": "ngram+draft", "ngram": {"max_match": 3}}})
    model = torch_repo.model_config(config, "speculative_stream", True, tmp_path)
    params = {k: v.string_value for k, v in model.parameters.items()}
    assert params["method"] == "ngram+draft" and params["ngram_max_match"] == "3"
    suffix = parse_config({**data, "speculative": {"method": "suffix", "suffix": {"max_cached_requests": 5,
                                                                                   "min_token_prob": 0.25}}})
    params = {k: v.string_value for k, v in torch_repo.model_config(suffix, "speculative_stream", True,
                                                                    tmp_path).parameters.items()}
    # model.py reads it back as SuffixSettings(**json.loads(...))
    assert params["method"] == "suffix" and SuffixSettings(**json.loads(params["suffix"])) == SuffixSettings(
        max_cached_requests=5, min_token_prob=0.25)


def params(config: mc.ModelConfig) -> dict[str, str]:
    return {key: value.string_value for key, value in config.parameters.items()}


def _tensors(config, kind):
    return {t.name: t for t in getattr(config, kind)}


@pytest.mark.parametrize("instances, proxies", [(2, 4), (6, 6)])
def test_torch_model_configs(tmp_path, instances, proxies):
    config = parse_config(tiny_config_dict(tmp_path, serve={"instances": instances, "max_queue_delay_us": 50}))
    for name, engine in (("speculative", False), ("speculative_stream", True)):
        model = parse(to_text(torch_repo.model_config(config, name, engine, tmp_path / "engines" / "x")))
        assert model.backend == "python" and model.max_batch_size == 4
        assert model.model_transaction_policy.decoupled is engine
        # one engine instance (the models load once and batch together); a proxy per batch row, each taking one
        # request at a time (requests batched into one proxy execute() would wait for each other)
        assert model.instance_group[0].count == (1 if engine else proxies)
        assert model.HasField("dynamic_batching") is engine
        if engine:
            assert model.dynamic_batching.max_queue_delay_microseconds == 50
        inputs, outputs = _tensors(model, "input"), _tensors(model, "output")
        # the engine model also takes cancel-only requests, so it checks max_tokens itself
        assert inputs["max_tokens"].optional is engine
        assert inputs["text_input"].optional and inputs["input_ids"].optional
        assert ("request_key" in inputs and "cancel_request" in inputs) is engine
        assert inputs["seed"].data_type == mc.TYPE_UINT64
        for stat in ("draft_tokens", "accepted_tokens", "target_steps", "acceptance_rate", "mean_accepted_len"):
            assert stat in outputs
        p = params(model)
        assert Path(p["engines_dir"]).is_absolute() and (Path(p["pipeline_root"]) / "pipeline").is_dir()
        assert p["device"] == "cpu" and p["role"] == ("engine" if engine else "proxy")
        assert p["torch_compile"] == "false" and p["compile_max_width"] == "16"  # runtime.*, read by model.py
        assert p["engine_model"] == "speculative_stream"
        # the prefix-cache counters stay off the unauthenticated metrics port unless the config asks
        assert p["prefix_cache_metrics"] == "false" and float(p["request_timeout_s"]) == 600
        assert inputs["max_tokens_fit"].data_type == mc.TYPE_BOOL and inputs["cache_salt"].optional


def test_a_repository_written_by_older_code_is_written_again(tiny_pair, tmp_path, monkeypatch):
    """The deployed repository's key covers the config.pbtxt texts this code writes: a new input in the serving
    contract redeploys it (a stale repository would drop the input silently: Triton's generate endpoint takes an
    unknown JSON field as a parameter)."""
    from pipeline.stages import run_stages
    from pipeline.triton.repository import deploy

    config = parse_config(tiny_config_dict(tiny_pair))
    run_stages(config, tmp_path / "engines", ("convert", "build"))
    repo = deploy(config, tmp_path / "engines").path
    assert deploy(config, tmp_path / "engines").path == repo  # unchanged: kept
    monkeypatch.setattr(torch_repo, "INPUTS", [*torch_repo.INPUTS, ("new_input", "INT32", [1])])
    again = deploy(config, tmp_path / "engines").path
    assert "new_input" in (again / "speculative_stream" / "config.pbtxt").read_text()
