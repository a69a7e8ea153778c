"""pipeline/built_config.py: whether engines were built from a config, decided from the build manifests alone.

The folders here hold only what a build stage leaves for this check (a sealed manifest recording role_config of the
resolved config); the models named in the config do not exist, so any attempt to read them fails the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.built_config import as_built, check_built_from, role_config
from pipeline.config import load_config
from pipeline.errors import EngineError
from tests.conftest import tiny_config_dict, write_config
from tests.fake_trtllm import seal_stage


LIMITS = tiny_config_dict(Path("."))["build"]  # max_batch_size 4, max_input_len 256, max_seq_len 512


def _config(tmp_path, build: dict | None = None, **overrides):
    data = tiny_config_dict(tmp_path / "no-such-pair", name="built", **overrides)
    if build is not None:
        data["build"] = build
    return load_config(write_config(tmp_path, data))


def _build_record(config, root, **resolved):
    """Sealed build folders whose manifests record ``config`` resolved with ``resolved`` (build limits and dtypes
    as a build derives them)."""
    build = config.build.model_copy(update={k: v for k, v in resolved.items() if k.startswith("max_")})
    update = {"build": build}
    for role in config.roles:
        update[role] = getattr(config, role).model_copy(update={"dtype": resolved.get("dtype", "float32")})
    built = config.model_copy(update=update)
    for role in config.roles:
        folder = root / role / "build"
        folder.mkdir(parents=True)
        (folder / "engine.json").write_text("{}")
        seal_stage(folder, {"stage": "build", "role": role, "config": role_config(built, role)})


def test_what_the_build_derived_is_taken_as_recorded_and_what_the_config_states_must_match():
    recorded = {"model": {"model": "m", "dtype": "bfloat16"}, "build": {"max_seq_len": 512, "max_input_len": 256}}
    written = {"model": {"model": "m", "dtype": "auto"}, "build": {"max_seq_len": None, "max_input_len": None}}
    assert as_built(written, recorded) == recorded
    stated = {"model": {"model": "m", "dtype": "float32"}, "build": {"max_seq_len": 1024, "max_input_len": None}}
    assert as_built(stated, recorded) == {"model": {"model": "m", "dtype": "float32"},
                                          "build": {"max_seq_len": 1024, "max_input_len": 256}}
    assert written["model"]["dtype"] == "auto"  # the caller's dict is left alone


def test_a_config_that_leaves_limits_and_dtypes_to_the_build_matches_without_reading_models(tmp_path, monkeypatch):
    import pipeline.models

    def no_models(*args, **kwargs):
        raise AssertionError("opening engines read a model")

    monkeypatch.setattr(pipeline.models, "resolve_model", no_models)
    monkeypatch.setattr(pipeline.models, "read_hf_config", no_models)
    written = _config(tmp_path, target={"model": "org/target", "dtype": "auto"},
                      draft={"model": "org/draft", "dtype": "auto"}, build={"max_batch_size": 4})
    assert written.build.max_seq_len is None and written.target.dtype == "auto"
    _build_record(written, tmp_path / "engines" / "built", max_seq_len=2048, max_input_len=1024, dtype="bfloat16")
    check_built_from(written, tmp_path / "engines" / "built")


@pytest.mark.parametrize("change, field", [
    ({"speculative": {"max_draft_len": 6}}, "speculative.max_draft_len: 4 then, 6 now"),
    ({"build": {**LIMITS, "max_seq_len": 1024}}, "build.max_seq_len: 512 then, 1024 now"),
    ({"target": {"model": "org/other", "dtype": "float32"}}, "model.model: "),
    ({"target": {"model": "org/target", "dtype": "bfloat16"}}, "model.dtype: 'float32' then, 'bfloat16' now"),
])
def test_a_stated_value_the_build_did_not_use_is_refused_by_name(tmp_path, change, field):
    base = dict(target={"model": "org/target", "dtype": "float32"}, draft={"model": "org/draft", "dtype": "float32"})
    root = tmp_path / "engines" / "built"
    _build_record(_config(tmp_path, **base), root)
    with pytest.raises(EngineError, match="built from a different config") as caught:
        check_built_from(_config(tmp_path, **{**base, **change}), root)
    assert field in str(caught.value) and "rebuild" in str(caught.value)


def test_a_method_swap_matches_and_a_missing_engine_is_named(tmp_path):
    root = tmp_path / "engines" / "built"
    _build_record(_config(tmp_path), root)
    check_built_from(_config(tmp_path, speculative={"method": "ngram+draft"}), root)  # a method swap rebuilds nothing
    with pytest.raises(EngineError, match="no completed build output"):
        check_built_from(_config(tmp_path), tmp_path / "engines" / "other")
