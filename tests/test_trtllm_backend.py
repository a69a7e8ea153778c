"""The trtllm backend without TensorRT-LLM: one-line errors, pre-flight checks on fake engine config.json files,
and the executor loop's bookkeeping against FakeTrtllmRuntime (a fake at the TensorRT-LLM boundary only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO
from pipeline.artifacts import content_hashes, output_stats, write_manifest
from pipeline.backends import trtllm
from pipeline.backends.trtllm_api import INSTALL_HINT, PINNED_VERSION, TRITON_CONTAINER, require_cuda_gpu
from pipeline.backends.trtllm_loading import check_pair
from pipeline.methods import Method
from pipeline.backends.trtllm_preflight import preflight, read_engine_config
from pipeline.backends.trtllm_runner import EngineLimits, RunnerOutput
from pipeline.executor.trtllm_executor import TrtllmSpeculativeExecutor
from pipeline.config import load_config
from pipeline.errors import BackendUnavailable, ConfigError, EngineError
from pipeline.executor.results import RequestError
from pipeline.models import ResolvedModel

CONFIG = REPO / "configs" / "llama3.1-8b_llama3.2-1b.yaml"


# ---- one clear line when TensorRT-LLM or the GPU is missing --------------------------------------------------------

@pytest.fixture
def no_trtllm(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # `import tensorrt_llm` raises ImportError
    monkeypatch.setenv("PATH", str(tmp_path))  # and no trtllm-build on PATH


def _seal(folder, stage_facts):
    """Write the manifest a completed stage writes: loading verifies every listed output before trusting it."""
    write_manifest(folder, {**stage_facts, "outputs": content_hashes(folder), "output_stats": output_stats(folder)})


def _one_line(exc: BaseException) -> str:
    message = str(exc)
    assert "\n" not in message and message
    return message


def test_convert_without_trtllm_is_one_clear_line(no_trtllm, tmp_path):
    config = load_config(CONFIG)
    model = ResolvedModel("target", config.target, tmp_path, "local", None)
    with pytest.raises(BackendUnavailable) as err:
        trtllm.convert(config, "target", model, tmp_path / "out")
    message = _one_line(err.value)
    assert f"TensorRT-LLM {PINNED_VERSION}" in message and TRITON_CONTAINER in message
    assert "pip install .[trtllm]" in message


def test_build_without_trtllm_build_is_one_clear_line(no_trtllm, tmp_path):
    with pytest.raises(BackendUnavailable) as err:
        trtllm.build(load_config(CONFIG), "target", tmp_path / "ckpt", tmp_path / "out")
    message = _one_line(err.value)
    assert "trtllm-build" in message and "not on PATH" in message and INSTALL_HINT in message


def test_from_engines_without_trtllm_is_one_clear_line(no_trtllm, tmp_path):
    with pytest.raises(BackendUnavailable) as err:
        TrtllmSpeculativeExecutor.from_engines(tmp_path)
    assert "import tensorrt_llm" in _one_line(err.value)


def test_no_gpu_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailable) as err:
        require_cuda_gpu("build (target)")
    assert "NVIDIA GPU" in _one_line(err.value) and TRITON_CONTAINER in str(err.value)


def test_unpaged_kv_cache_is_refused_at_plan_time(tmp_path):
    config = load_config(CONFIG)
    config.build.kv_cache.paged = False
    with pytest.raises(ConfigError, match="build.kv_cache.paged"):
        trtllm.build_plan(config, "target", tmp_path, tmp_path)


# ---- pre-flight checks on fake engine config.json files ---------------------------------------------------------------

def fake_engine_config(folder: Path, *, version=PINNED_VERSION, spec_mode=2, max_draft_len=4, vocab=128256,
                       gather_context=False, gather_generation=True, tp=1) -> Path:
    """A config.json shaped like the one tensorrt_llm.builder.Engine.save writes (only the fields we read)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {"version": version,
            "pretrained_config": {"architecture": "LlamaForCausalLM", "dtype": "bfloat16", "vocab_size": vocab,
                                  "mapping": {"world_size": tp, "tp_size": tp, "pp_size": 1}},
            "build_config": {"max_batch_size": 8, "max_input_len": 4096, "max_seq_len": 8192 + max_draft_len,
                             "max_draft_len": max_draft_len, "speculative_decoding_mode": spec_mode,
                             "gather_context_logits": gather_context,
                             "gather_generation_logits": gather_generation, "kv_cache_type": "PAGED"}}
    (folder / "config.json").write_text(json.dumps(data))
    return folder


def _pair(tmp_path, target=None, draft=None):
    t = read_engine_config(fake_engine_config(tmp_path / "t", **(target or {})))
    d = read_engine_config(fake_engine_config(tmp_path / "d", **{"spec_mode": 1, "max_draft_len": 0,
                                                                 **(draft or {})}))
    return t, d


def _run(t, d, **kw):
    args = {"max_draft_len": 4, "acceptance": "rejection", "installed_version": PINNED_VERSION, **kw}
    return preflight(t, d, **args)


def test_preflight_accepts_a_good_pair(tmp_path):
    assert _run(*_pair(tmp_path)) == []


def test_target_without_spec_mode(tmp_path):
    (problem,) = _run(*_pair(tmp_path, target={"spec_mode": 1, "max_draft_len": 0}))
    assert "t/config.json" in problem and "build_config.speculative_decoding_mode is 1" in problem
    assert "--speculative_decoding_mode draft_tokens_external --max_draft_len 4" in problem


def test_target_with_smaller_max_draft_len(tmp_path):
    (problem,) = _run(*_pair(tmp_path, target={"max_draft_len": 3}))
    assert "build_config.max_draft_len is 3" in problem and "K = 4" in problem and "speculative.max_draft_len" in problem


def test_vocab_mismatch(tmp_path):
    t, d = _pair(tmp_path, target={"vocab": 152064}, draft={"vocab": 151936})
    (problem,) = _run(t, d)
    assert "vocab_size is 151936" in problem and "152064" in problem and "acceptance: greedy" in problem
    assert _run(t, d, acceptance="greedy") == []  # token ids only: padding rows never matter
    assert _run(t, d, tokenizer_len=151665) == []  # both cover every real token; the executor pads logits
    (short,) = _run(t, d, tokenizer_len=152000)
    assert "d/config.json" in short and "fewer rows than the tokenizer's 152000" in short


def test_engine_built_by_other_version(tmp_path):
    problems = _run(*_pair(tmp_path, target={"version": "1.2.1"}))  # a pip release no 25.12 container ships
    assert len(problems) == 1 and "version is '1.2.1'" in problems[0] and PINNED_VERSION in problems[0]
    assert "rebuild" in problems[0]


def test_gather_context_logits_with_draft_len(tmp_path):
    (problem,) = _run(*_pair(tmp_path, target={"gather_context": True}))
    assert "gather_context_logits is true with max_draft_len 4" in problem


def test_rejection_needs_generation_logits(tmp_path):
    problems = _run(*_pair(tmp_path, draft={"gather_generation": False}))
    assert len(problems) == 1 and "d/config.json" in problems[0] and "--gather_generation_logits" in problems[0]
    assert _run(*_pair(tmp_path, draft={"gather_generation": False}), acceptance="greedy") == []


def test_world_size_vs_device_ids(tmp_path):
    (problem,) = _run(*_pair(tmp_path, target={"tp": 4}), target_device_ids=[0])
    assert problem.startswith("runtime.target_device_ids: [0]") and "world_size 4" in problem


def test_check_pair_over_an_engines_folder(tmp_path):
    """engine.json as trtllm.build writes it, a manifest, and the engine's own config.json."""
    config = load_config(CONFIG)
    for role in ("target", "draft"):
        folder = tmp_path / role / "build"
        k = 4 if role == "target" else 0
        fake_engine_config(folder, spec_mode=2 if k else 1, max_draft_len=k, version="1.0.0")
        (folder / "engine.json").write_text(json.dumps(trtllm.engine_info(config, role, "1.0.0")))
        _seal(folder, {"stage": "build", "role": role})
    with pytest.raises(EngineError) as err:
        check_pair(tmp_path, PINNED_VERSION)
    assert str(err.value).count("version is '1.0.0'") == 2 and "\n" not in str(err.value)
    target, draft = check_pair(tmp_path, "1.0.0")
    assert target.backend == draft.backend == "trtllm" and target.max_draft_len == 4 and draft.max_draft_len == 0
    assert (target.role, draft.role) == ("target", "draft")
    assert set(target.extra) >= {"tp", "pp", "trtllm_version", "kv_cache_free_gpu_mem_fraction", "target_device_ids"}


# ---- the executor loop against a fake runtime -------------------------------------------------------------------------

VOCAB = 50
EOS = 49


def target_next(seq: list[int]) -> int:
    return (sum(seq) * 7 + len(seq)) % 40


def draft_next(seq: list[int]) -> int:
    # Agrees with the target except when the sequence length is a multiple of 3.
    return target_next(seq) if len(seq) % 3 else (target_next(seq) + 1) % 40


class FakeTrtllmRuntime:
    """A FAKE engine at the TensorRT-LLM boundary: greedy next-token rules instead of a compiled engine.

    As the target it verifies draft tokens the way TensorRT-LLM's greedy acceptance does: keep the prefix equal
    to its own tokens, then add one of its own. It records every call for the bookkeeping checks.
    """

    def __init__(self, rule, vocab_size=VOCAB, eos_at: int | None = None):
        self.rule, self.vocab_size, self.eos_at, self.calls = rule, vocab_size, eos_at, []

    def _next(self, seq):
        return EOS if self.eos_at is not None and len(seq) == self.eos_at else self.rule(seq)

    def generate(self, prompt, max_new_tokens, sampling, *, draft_tokens=None, draft_logits=None,
                 want_logits=False):
        self.calls.append({"prompt_len": len(prompt), "max_new_tokens": max_new_tokens,
                           "draft_tokens": draft_tokens, "want_logits": want_logits})
        seq, out = list(prompt), []
        for i in range(max_new_tokens):
            token = self._next(seq)
            out.append(token)
            seq.append(token)
            if token == EOS or (draft_tokens is not None and (i >= len(draft_tokens) or token != draft_tokens[i])):
                break
        logits = torch.zeros(len(out), self.vocab_size - 2) if want_logits else None
        return RunnerOutput(out, logits)


def make_executor(k=4, eos_at=None, acceptance="greedy"):
    target = FakeTrtllmRuntime(target_next, eos_at=eos_at)
    draft = FakeTrtllmRuntime(draft_next, vocab_size=VOCAB - 2, eos_at=eos_at)
    ex = TrtllmSpeculativeExecutor(target, draft, None, EngineLimits(64, 256, k), k, acceptance, [EOS])
    return ex, target, draft


def reference(prompt, n):
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(target_next(seq))
        seq.append(out[-1])
    return out


def test_speculative_output_equals_target_only_and_stats_add_up():
    ex, target, draft = make_executor(k=4)
    prompt = [1, 2, 3]
    (spec,) = ex.generate([prompt], 30)
    (plain,) = ex.generate([prompt], 30, max_draft_len=0)
    assert spec.token_ids == plain.token_ids == reference(prompt, 30)
    s = spec.stats
    assert s.generated_tokens == 30 and spec.finish_reason == "length"
    assert s.target_steps == len(target.calls) - 1  # the last call is the target-only run
    assert s.draft_tokens == sum(len(c["draft_tokens"] or []) for c in target.calls[:-1])
    assert 0 < s.accepted_tokens < s.draft_tokens  # the draft disagrees every third position
    assert s.generated_tokens == s.accepted_tokens + s.target_steps  # each step: accepted + 1
    assert sum(s.drafted_at) == s.draft_tokens and sum(s.accepted_at) == s.accepted_tokens
    assert plain.stats.draft_tokens == 0 and plain.stats.target_steps == 30


def test_never_drafts_past_max_new_tokens():
    ex, target, draft = make_executor(k=4)
    (result,) = ex.generate([[5]], 6)
    assert len(result.token_ids) == 6
    assert all(c["max_new_tokens"] <= 6 for c in draft.calls)
    assert result.stats.generated_tokens == 6


def test_eos_stops_and_is_emitted():
    ex, *_ = make_executor(k=3, eos_at=7)
    (result,) = ex.generate([[1, 2]], 20)
    assert result.finish_reason == "eos" and result.token_ids[-1] == EOS and len(result.token_ids) == 6


def test_rejection_sampling_passes_logits_padded_to_target_width():
    ex, target, draft = make_executor(k=2, acceptance="rejection")
    ex.generate([[3]], 4, temperature=0.8, seed=1)
    assert draft.calls[0]["want_logits"] is True
    padded = ex._fit_logits(torch.zeros(2, VOCAB - 2))
    assert padded.shape == (2, VOCAB) and torch.isinf(padded[:, -2:]).all()
    greedy_ex, _, greedy_draft = make_executor(k=2, acceptance="rejection")
    greedy_ex.generate([[3]], 4)  # temperature 0: token comparison is exact, no logits needed
    assert greedy_draft.calls[0]["want_logits"] is False


def test_request_errors_name_the_field():
    ex, *_ = make_executor(k=4)
    with pytest.raises(RequestError, match="max_draft_len: 5 is larger than the 4"):
        ex.generate([[1]], 3, max_draft_len=5)
    with pytest.raises(RequestError, match="max_new_tokens: 1 prompt \\+ 300"):
        ex.generate([[1]], 300)
    with pytest.raises(RequestError, match="temperature"):
        ex.generate([[1]], 3, temperature=-1)


def test_stream_yields_one_event_per_target_step():
    ex, target, _ = make_executor(k=4)
    events = list(ex.generate_stream([1, 2, 3], 12))
    assert len(events) == events[-1].stats.target_steps and events[-1].finished
    assert [t for e in events for t in e.token_ids] == reference([1, 2, 3], 12)


# ---- the Python path splits KV memory with the function the Triton repository uses -------------------------------

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
        _seal(folder, {"stage": "build", "role": role})
    opened = {}

    class RecordingEngine:  # FAKE ModelRunnerEngine: records what each engine would be opened with
        def __init__(self, engine_dir, device_ids, kv_fraction, *args):
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


def test_gpu_smoke_script_fails_on_a_version_mismatch(tmp_path):
    """Step 1 of scripts/gpu_smoke.sh against a FAKE tensorrt_llm package of another release: it must exit."""
    assert subprocess.run(["bash", "-n", str(REPO / "scripts" / "gpu_smoke.sh")]).returncode == 0
    fake = tmp_path / "site" / "tensorrt_llm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "1.2.1"\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "python3"  # the script runs python3; give it this venv's interpreter (torch)
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(tmp_path / "site"),
           "SMOKE_DIR": str(tmp_path / "smoke")}
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_smoke.sh")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode != 0
    assert f"installed TensorRT-LLM is 1.2.1 but this pipeline is pinned to {PINNED_VERSION}" in done.stderr
    assert "== 2." not in done.stdout  # stopped before any build


def test_ngram_loads_only_the_target_engine(monkeypatch, tmp_path):
    """speculative.method: ngram builds no draft engine; loading must neither need nor open one."""
    from pipeline.backends import trtllm_loading
    from pipeline.executor.trtllm_executor import TrtllmSpeculativeExecutor

    config = load_config(CONFIG)
    folder = tmp_path / "target" / "build"
    fake_engine_config(folder, spec_mode=2, max_draft_len=4)
    (folder / "engine.json").write_text(json.dumps(trtllm.engine_info(config, "target", PINNED_VERSION)))
    _tiny_tokenizer(folder / "tokenizer")
    _seal(folder, {"stage": "build", "role": "target"})
    opened = []

    class RecordingEngine:  # FAKE ModelRunnerEngine
        vocab_size = 300

        def __init__(self, engine_dir, *args):
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
    _seal(folder, {"stage": "build", "role": "target"})
    executor = TrtllmSpeculativeExecutor.from_engines(tmp_path)
    assert executor.method == "ngram" and executor.draft is None and executor.ngram.max_match == 3
    from pipeline.executor import SpeculativeExecutor

    with pytest.raises(EngineError, match="compile, adaptive_draft_len: torch-backend options"):
        SpeculativeExecutor.from_engines(tmp_path, compile=True, adaptive_draft_len=True)
    assert SpeculativeExecutor.from_engines(tmp_path).method == "ngram"
