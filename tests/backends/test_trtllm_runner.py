"""pipeline/backends/trtllm_runner.py: ModelRunnerEngine's calls bind to the ModelRunnerCpp signatures recorded for the
pinned release (tests/data/trtllm_<release>_api.json)."""

from __future__ import annotations

import inspect
import json
import sys
import types

import pytest
import torch

from pipeline.backends.trtllm_api import PINNED_VERSION
from pipeline.backends.trtllm_runner import Sampling
from tests.conftest import REPO


API_FILE = REPO / "tests" / "data" / f"trtllm_{PINNED_VERSION}_api.json"


API = json.loads(API_FILE.read_text())


def recorded_signature(name: str) -> tuple[inspect.Signature, set[str]]:
    """inspect.Signature built from the recorded parameters, and the **kwargs names the method reads."""
    spec = API["runtime"][f"ModelRunnerCpp.{name}"]
    params = [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in ["self", *spec["positional"]]]
    params += [inspect.Parameter(p, inspect.Parameter.KEYWORD_ONLY, default=d) for p, d in spec["keyword_only"].items()]
    if spec["var_keyword"]:
        params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params), set(spec.get("kwargs_read", []))


def check_call(name: str, args: tuple, kwargs: dict) -> None:
    signature, kwargs_read = recorded_signature(name)
    bound = signature.bind(None, *args, **kwargs)  # TypeError on a name the release does not take
    extra = set(bound.arguments.get("kwargs", {}))
    assert extra <= kwargs_read, f"{name}: {sorted(extra - kwargs_read)} would be silently ignored by **kwargs"


class RecordingModelRunnerCpp:
    """A FAKE tensorrt_llm.runtime.ModelRunnerCpp: checks each call against the recorded signature."""

    calls: list = []

    @classmethod
    def from_dir(cls, *args, **kwargs):
        check_call("from_dir", args, kwargs)
        cls.calls.append(("from_dir", kwargs))
        runner = cls()
        runner.vocab_size_padded = 64
        return runner

    def generate(self, *args, **kwargs):
        check_call("generate", args, kwargs)
        self.calls.append(("generate", kwargs))
        n = kwargs["max_new_tokens"]
        prompt = args[0][0].tolist()
        ids = torch.tensor([[prompt + list(range(n))]])
        return {"output_ids": ids, "sequence_lengths": torch.tensor([[len(prompt) + n]]),
                "generation_logits": torch.zeros(1, 1, n, 64)}


def test_model_runner_calls_bind_to_the_recorded_signatures(monkeypatch, tmp_path):
    runtime = types.ModuleType("tensorrt_llm.runtime")
    runtime.ModelRunnerCpp = RecordingModelRunnerCpp
    monkeypatch.setitem(sys.modules, "tensorrt_llm", types.ModuleType("tensorrt_llm"))
    monkeypatch.setitem(sys.modules, "tensorrt_llm.runtime", runtime)
    from pipeline.backends.trtllm_runner import ModelRunnerEngine

    RecordingModelRunnerCpp.calls = []
    engine = ModelRunnerEngine(tmp_path, [0], 0.17, True, True, 2, 2, 8191)
    out = engine.generate([5, 6], 3, Sampling(0.7, 20, 0.9, 11), draft_tokens=[1, 2], draft_logits=torch.zeros(2, 64),
                          want_logits=True)
    assert out.token_ids == [0, 1, 2] and out.logits.shape == (3, 64)
    engine.generate([5, 6], 2, Sampling())
    (_, from_dir), (_, spec), (_, greedy) = RecordingModelRunnerCpp.calls
    assert from_dir["kv_cache_free_gpu_memory_fraction"] == 0.17 and from_dir["is_orchestrator_mode"]
    assert from_dir["max_input_len"] == 8191  # contexts grow past the prompt limit: prompt + generated
    assert spec["draft_tokens_list"] == [[1, 2]] and spec["random_seed"] == 11 and spec["top_k"] == 20
    assert greedy["top_k"] == 1 and "draft_tokens_list" not in greedy
    with pytest.raises(TypeError):  # the check is real: a misspelt keyword does not bind
        check_call("from_dir", ("/e",), {"kv_cache_free_gpu_mem_fraction": 0.5})
    with pytest.raises(AssertionError, match="silently ignored"):
        check_call("generate", ([],), {"draft_token_list": [[1]]})


def test_medusa_choices_reach_from_dir_under_the_recorded_keyword(monkeypatch, tmp_path):
    runtime = types.ModuleType("tensorrt_llm.runtime")
    runtime.ModelRunnerCpp = RecordingModelRunnerCpp
    monkeypatch.setitem(sys.modules, "tensorrt_llm", types.ModuleType("tensorrt_llm"))
    monkeypatch.setitem(sys.modules, "tensorrt_llm.runtime", runtime)
    from pipeline.backends.trtllm_runner import ModelRunnerEngine

    RecordingModelRunnerCpp.calls = []
    tree = [[0], [1], [0, 0]]
    ModelRunnerEngine(tmp_path, [0, 1], 0.85, True, False, 2, 2, 8191, medusa_choices=tree)
    ModelRunnerEngine(tmp_path, [0], 0.85, True, False, 2, 2, 8191)
    (_, medusa), (_, plain) = RecordingModelRunnerCpp.calls  # both bound to the recorded from_dir signature
    assert medusa["medusa_choices"] == tree and medusa["gather_generation_logits"] is False
    assert plain["medusa_choices"] is None  # the recorded default: not a Medusa engine
