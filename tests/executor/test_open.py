"""pipeline/executor/open.py: built engines opened from what the build wrote, without the check stage.

The TensorRT-LLM side (open_executor returning a TrtllmSpeculativeExecutor, refusing torch options) is tested over a
fake engine folder in tests/backends/test_trtllm_loading.py.
"""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from pipeline.errors import EngineError
from pipeline.executor import SpeculativeExecutor, open_executor
from tests.conftest import tiny_config_dict, write_config


def _config_like_the_build(tiny_pair, tmp_path, **overrides):
    """The config the shared engines (built_engines: tiny-built) were built from, with ``overrides``."""
    return load_config(write_config(tmp_path, tiny_config_dict(tiny_pair, name="tiny-built", **overrides)))


def test_opening_with_the_config_runs_no_check_stage_and_takes_k_from_engine_json(built_engines, tiny_pair,
                                                                                  tmp_path, monkeypatch):
    import pipeline.checks
    import pipeline.models

    def refused(*args, **kwargs):
        raise AssertionError("opening engines re-ran the check stage's model resolution")

    monkeypatch.setattr(pipeline.models, "resolve_model", refused)
    monkeypatch.setattr(pipeline.checks, "with_resolved_defaults", refused)
    _, engines = built_engines
    executor = open_executor(engines / "tiny-built", _config_like_the_build(tiny_pair, tmp_path))
    assert isinstance(executor, SpeculativeExecutor)
    assert (executor.max_draft_len, executor.engine_draft_len, executor.max_seq_len) == (4, 4, 512)
    assert executor.method == "draft_model" and str(executor.device) == "cpu"


def test_the_config_picks_the_method_and_engine_json_does_without_one(built_engines, tiny_pair, tmp_path):
    _, engines = built_engines
    swapped = _config_like_the_build(tiny_pair, tmp_path, speculative={"method": "ngram+draft"})
    assert open_executor(engines / "tiny-built", swapped).method == "ngram+draft"  # a method swap rebuilds nothing
    assert open_executor(engines / "tiny-built").method == "draft_model"  # what the engines were built for
    assert open_executor(engines / "tiny-built", swapped, method="ngram").method == "ngram"  # an argument wins


def test_engines_built_from_another_config_are_refused_by_field(built_engines, tiny_pair, tmp_path):
    _, engines = built_engines
    other_k = _config_like_the_build(tiny_pair, tmp_path, speculative={"max_draft_len": 6})
    with pytest.raises(EngineError, match="built from a different config .*max_draft_len: 4 then, 6 now"):
        open_executor(engines / "tiny-built", other_k)


def test_the_compiled_width_cap_comes_from_the_config_and_an_argument_wins(built_engines, tiny_pair, tmp_path,
                                                                          monkeypatch):
    seen = []
    monkeypatch.setattr(SpeculativeExecutor, "from_engines", classmethod(lambda cls, root, **kw: seen.append(kw)))
    _, engines = built_engines
    capped = _config_like_the_build(tiny_pair, tmp_path, runtime={"device": "cpu", "torch_compile": True,
                                                                  "compile_max_width": 4})
    open_executor(engines / "tiny-built", capped)
    open_executor(engines / "tiny-built", capped, compile_max_width=8)
    open_executor(engines / "tiny-built")
    assert [(kw["compile"], kw["compile_max_width"]) for kw in seen] == [(True, 4), (True, 8), (False, 16)]
