"""pipeline/backends/trtllm_loading.py over FAKE engine folders (tests/fake_trtllm.py): pre-flight checks over an
engines folder, the KV memory split shared with the Triton repository, n-gram engines without a draft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.backends import trtllm
from pipeline.backends.trtllm_api import PINNED_VERSION
from pipeline.backends.trtllm_loading import preflight_pair
from pipeline.config import load_config
from pipeline.errors import EngineError
from pipeline.methods import Method
from tests.conftest import REPO
from tests.fake_trtllm import fake_engine_config, seal_stage


CONFIG = REPO / "configs" / "llama3.1-8b_llama3.2-1b.yaml"


def test_preflight_pair_over_an_engines_folder(tmp_path):
    """engine.json as trtllm.build writes it, a manifest, and the engine's own config.json."""
    config = load_config(CONFIG)
    for role in ("target", "draft"):
        folder = tmp_path / role / "build"
        k = 4 if role == "target" else 0
        fake_engine_config(folder, spec_mode=2 if k else 1, max_draft_len=k, version="1.0.0")
        (folder / "engine.json").write_text(json.dumps(trtllm.engine_info(config, role, "1.0.0")))
        seal_stage(folder, {"stage": "build", "role": role})
    with pytest.raises(EngineError) as err:
        preflight_pair(tmp_path, PINNED_VERSION)
    assert str(err.value).count("version is '1.0.0'") == 2 and "\n" not in str(err.value)
    target, draft = preflight_pair(tmp_path, "1.0.0")
    assert target.backend == draft.backend == "trtllm" and target.max_draft_len == 4 and draft.max_draft_len == 0
    assert (target.role, draft.role) == ("target", "draft")
    assert set(target.extra) >= {"tp", "pp", "trtllm_version", "kv_cache_free_gpu_mem_fraction", "target_device_ids"}


def _tiny_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "a": 1, "b": 2}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<eos>")), eos_token="<eos>")
    fast.save_pretrained(folder)


@pytest.mark.parametrize("draft_ids, shared", [([0], True), ([1], False)])
def test_executor_engines_get_the_shared_kv_split(monkeypatch, tmp_path, draft_ids, shared):
    from pipeline.backends import trtllm_loading
    from pipeline.backends.trtllm_api import kv_cache_fractions

    config = load_config(CONFIG)
    for role in ("target", "draft"):
        folder = tmp_path / role / "build"
        k = 4 if role == "target" else 0
        fake_engine_config(folder, spec_mode=2 if k else 1, max_draft_len=k)
        (folder / "engine.json").write_text(json.dumps(trtllm.engine_info(config, role, PINNED_VERSION)))
        if role == "target":
            _tiny_tokenizer(folder / "tokenizer")
        seal_stage(folder, {"stage": "build", "role": role})
    opened = {}

    class RecordingEngine:  # FAKE ModelRunnerEngine: records what each engine would be opened with
        def __init__(self, engine_dir, device_ids, kv_fraction, *args, **kwargs):
            opened[Path(engine_dir).parent.name] = (list(device_ids), kv_fraction)

    monkeypatch.setattr(trtllm_loading, "import_tensorrt_llm", lambda what: type("M", (), {"__version__":
                                                                                              PINNED_VERSION}))
    monkeypatch.setattr(trtllm_loading, "require_cuda_gpu", lambda what: None)
    monkeypatch.setattr(trtllm_loading, "ModelRunnerEngine", RecordingEngine)
    trtllm_loading.open_engines(tmp_path, Method.DRAFT_MODEL, [0], draft_ids)
    fraction = config.build.kv_cache.free_gpu_mem_fraction
    target_kv, draft_kv = kv_cache_fractions(fraction, [0], draft_ids)
    assert opened == {"target": ([0], target_kv), "draft": (draft_ids, draft_kv)}
    assert (target_kv + draft_kv <= fraction + 1e-9) if shared else (target_kv == draft_kv == fraction)


def test_ngram_loads_only_the_target_engine(monkeypatch, tmp_path):
    """speculative.method: ngram builds no draft engine; loading must neither need nor open one."""
    from pipeline.backends import trtllm_loading
    from pipeline.executor.trtllm_executor import TrtllmSpeculativeExecutor

    config = load_config(CONFIG)
    folder = tmp_path / "target" / "build"
    fake_engine_config(folder, spec_mode=2, max_draft_len=4)
    (folder / "engine.json").write_text(json.dumps(trtllm.engine_info(config, "target", PINNED_VERSION)))
    _tiny_tokenizer(folder / "tokenizer")
    seal_stage(folder, {"stage": "build", "role": "target"})
    opened = []

    class RecordingEngine:  # FAKE ModelRunnerEngine
        vocab_size = 300

        def __init__(self, engine_dir, *args, **kwargs):
            opened.append(Path(engine_dir).parent.name)

    monkeypatch.setattr(trtllm_loading, "import_tensorrt_llm", lambda what: type("M", (), {"__version__":
                                                                                              PINNED_VERSION}))
    monkeypatch.setattr(trtllm_loading, "require_cuda_gpu", lambda what: None)
    monkeypatch.setattr(trtllm_loading, "ModelRunnerEngine", RecordingEngine)
    with pytest.raises(EngineError, match="draft"):  # the draft-model method still needs its engine
        TrtllmSpeculativeExecutor.from_engines(tmp_path)
    executor = TrtllmSpeculativeExecutor.from_engines(tmp_path, method="ngram")
    assert opened == ["target"] and executor.draft is None and executor.method == "ngram"

    # Built from an ngram config, the folder says so: no method argument needed.
    ngram_config = config.model_copy(update={"speculative": config.speculative.model_copy(
        update={"method": Method.NGRAM, "ngram": config.speculative.ngram.model_copy(update={"max_match": 3})})})
    (folder / "engine.json").write_text(json.dumps(trtllm.engine_info(ngram_config, "target", PINNED_VERSION)))
    seal_stage(folder, {"stage": "build", "role": "target"})
    executor = TrtllmSpeculativeExecutor.from_engines(tmp_path)
    assert executor.method == "ngram" and executor.draft is None and executor.ngram.max_match == 3
    from pipeline.executor import SpeculativeExecutor, open_executor

    # open_executor opens the folder with the executor of the backend that built it; the torch class says why not.
    with pytest.raises(EngineError, match="built by the trtllm backend.*open_executor"):
        SpeculativeExecutor.from_engines(tmp_path)
    with pytest.raises(EngineError, match="compile, adaptive_draft_len: torch-runtime options"):
        open_executor(tmp_path, compile=True, adaptive_draft_len=True)
    opened_here = open_executor(tmp_path)
    assert isinstance(opened_here, TrtllmSpeculativeExecutor) and opened_here.method == "ngram"
