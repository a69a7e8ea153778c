"""The pipeline on a real pretrained model (SmolLM2-135M-Instruct, float32: the shipped configs' dtype on a CPU):
the engine's logits equal Hugging Face's, greedy output equals HF `generate` for target-only, n-gram, draft-model and
suffix drafting, and check/build/run work from the shipped config with a chat prompt."""

from __future__ import annotations

import subprocess

import pytest
import torch

from pipeline.chat import encode_chat
from pipeline.config import load_config
from pipeline.executor import SpeculativeExecutor
from pipeline.methods import NgramSettings
from tests.conftest import PY, REPO

CHATS = [
    [{"role": "user", "content": "Add type hints to this function:\n\ndef scale(values, factor):\n"
                                 "    return [v * factor for v in values]\n"}],
    [{"role": "user", "content": "Name three rivers in Europe and one city on each."}],
    [{"role": "system", "content": "You answer in one short paragraph."},
     {"role": "user", "content": "Why is the sky blue?"}],
]
TOKENS = 48
SHIPPED = {"ngram": "smollm2-135m-ngram.yaml", "draft_model": "smollm2-135m.yaml"}


@pytest.fixture(scope="module")
def target(real_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_ids(real_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    ids = [encode_chat(tokenizer, chat) for chat in CHATS]
    for chat, found in zip(CHATS, ids):  # plain messages: exactly what the tokenizer's own template renders
        expected = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert found == list(expected["input_ids"])
    return ids


@pytest.fixture(scope="module")
def hf_greedy(target, chat_ids):
    out = []
    with torch.inference_mode():
        for ids in chat_ids:
            generated = target.generate(torch.tensor([ids]), max_new_tokens=TOKENS, do_sample=False,
                                        attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            out.append(generated[0, len(ids):].tolist())
    return out


def _trim_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:i + 1]
    return tokens


def test_engine_logits_match_hf(real_model_dir, target, chat_ids):
    """The engine's model runner (paged KV, packed rows, position ids, the paged attention) against a plain HF
    forward: a prefill of the prompt beside another row, then 5 more tokens in one forward through the cache, the
    verify path's shape."""
    from pipeline.executor.model_runner import BatchModelRunner

    ids = chat_ids[0] + [504, 3575, 282, 4649, 314]  # the prompt plus five tokens to verify
    with torch.inference_mode():
        expected = target(input_ids=torch.tensor([ids])).logits[0].float()  # [len, vocab]
    runner = BatchModelRunner(target, "cpu", max_tokens=1024, block_size=16, max_blocks=256)
    runner.open("other", chat_ids[1])
    runner.open("seq", ids)
    first = runner.forward(["other", "seq"], [chat_ids[1][:7], ids[:-5]])[1, :len(ids) - 5]  # rows stay apart
    second = runner.forward(["seq"], [ids[-5:]])[0, :5]
    got = torch.cat([first, second])
    assert got.shape == expected.shape
    # float32 sums in other orders than aten's (the measured products, RMSNorm's squares in the C++ operators)
    # over 30 layers: 1.1e-4 on logits up to 38 (3e-6 of their scale) measured; a wrong position, mask or rotation
    # is off by orders of magnitude more
    assert (got - expected).abs().max().item() < 1e-5 * expected.abs().max().item()


# Each generates 3 x 48 tokens on the real model beside Hugging Face's own generate: slow (the quick loop keeps
# test_engine_logits_match_hf on it).
@pytest.mark.slow
@pytest.mark.parametrize("method", ["target-only", "ngram", "draft_model", "suffix"])
def test_greedy_equals_hf_generate(real_model_dir, real_draft_dir, chat_ids, hf_greedy, method):
    """At the shipped configs' K and n-gram settings (suffix: the n-gram config's K with the suffix trees'
    defaults); target-only is max_draft_len=0 on the same runtime."""
    spec = load_config(REPO / "configs" / SHIPPED.get(method, SHIPPED["ngram"])).speculative
    k = 0 if method == "target-only" else spec.max_draft_len
    draft = real_draft_dir if method == "draft_model" else None
    ex = SpeculativeExecutor.from_pretrained(real_model_dir, draft, max_draft_len=spec.max_draft_len,
                                             method="suffix" if method == "suffix" else spec.method,
                                             acceptance=spec.acceptance,
                                             ngram=NgramSettings(spec.ngram.min_match, spec.ngram.max_match))
    results = ex.generate(chat_ids, TOKENS, temperature=0.0, max_draft_len=k)
    eos = set(ex.eos_token_ids)
    for result, expected in zip(results, hf_greedy):
        assert result.token_ids == _trim_at_eos(expected, eos)
    if k:
        assert sum(r.stats.draft_tokens for r in results) > 0  # drafting really happened


@pytest.mark.slow
def test_check_build_run_chat_from_the_shipped_config(real_model_dir, real_draft_dir, tmp_path):
    config = REPO / "configs" / "smollm2-135m.yaml"
    engines = tmp_path / "engines"
    check = subprocess.run([PY, "-m", "pipeline", "check", str(config)], capture_output=True, text=True, cwd=REPO)
    assert check.returncode == 0, check.stderr
    assert "target.dtype: float32 (auto: checkpoint float32 on CPU)" in check.stdout
    build = subprocess.run([PY, "-m", "pipeline", "build", str(config), "--engines-dir", str(engines)],
                           capture_output=True, text=True, cwd=REPO)
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([PY, "-m", "pipeline", "run", str(config), "--engines-dir", str(engines), "--chat",
                          "What is the capital of France?", "--max-new-tokens", "24"],
                         capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Paris" in run.stdout
    assert "<|im_start|>" not in run.stdout  # the reply, not the rendered template


ORDER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "rivers": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                            "minItems": 1, "maxItems": 3},
    "country": {"type": "string", "enum": ["France", "Germany", "Italy", "Spain"]}},
    "required": ["city", "rivers", "country"], "additionalProperties": False}


@pytest.mark.slow
def test_output_controls_under_speculation_equal_speculation_off(real_model_dir, chat_ids):
    """A JSON schema, penalties, bias and logprobs on the real model: greedy speculative output (n-gram drafts, and
    the grammar's forced tokens) equals target-only decoding with the same settings, every answer validates, the
    logprobs agree within 1e-4, and the forced tokens cut the target steps."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    ex = SpeculativeExecutor.from_pretrained(real_model_dir, None, max_draft_len=4, method="ngram")
    controls = dict(response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": ORDER}},
                    frequency_penalty=0.3, presence_penalty=0.2, logit_bias={"28": -2.0}, logprobs=2)
    spec = ex.generate(chat_ids, 64, **controls)
    plain = ex.generate(chat_ids, 64, max_draft_len=0, **controls)
    for result, base in zip(spec, plain):
        assert result.token_ids == base.token_ids and result.finish_reason == "eos"
        jsonschema.validate(json.loads(result.text), ORDER)
        assert [round(e.logprob, 4) for e in result.logprobs] == pytest.approx(
            [round(e.logprob, 4) for e in base.logprobs], abs=2e-4)
    steps, plain_steps = (sum(r.stats.target_steps for r in results) for results in (spec, plain))
    assert steps < 0.7 * plain_steps, (steps, plain_steps)
