"""FAKE TensorRT-LLM engines for contract tests: a torch model behind the EngineRunner boundary, and engine folders
(fake_engine_config, seal_stage) for the pre-flight and loading checks.

It stands in for ModelRunnerCpp over a built engine (which needs TensorRT-LLM and a GPU): it decodes with the
model itself and verifies draft tokens the way a `draft_tokens_external` target does with token comparison (keep
the prefix equal to its own tokens, then add one of its own). Recomputes the whole sequence each call: slow, but
tests use tiny models.
"""

from __future__ import annotations

from pathlib import Path
import json

import torch

from pipeline.backends.trtllm_runner import RunnerOutput
from pipeline.speculative import SamplingParams, logits_to_probs, sample
from pipeline.backends.trtllm_api import PINNED_VERSION
from pipeline.artifacts import content_hashes, output_stats, write_manifest


class FakeTrtllmEngine:
    def __init__(self, model):
        self.model = model
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.calls: list[dict] = []

    @torch.no_grad()
    def generate(self, prompt, max_new_tokens, sampling, *, draft_tokens=None, draft_logits=None,
                 want_logits=False):
        self.calls.append({"prompt_len": len(prompt), "max_new_tokens": max_new_tokens, "seed": sampling.seed,
                           "draft_tokens": draft_tokens, "want_logits": want_logits})
        params = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p)
        generator = torch.Generator().manual_seed(sampling.seed or 0)
        seq, out, rows = list(prompt), [], []
        for i in range(max_new_tokens):
            logits = self.model(torch.tensor([seq])).logits[0, -1].float()  # [V]
            token = int(logits.argmax()) if params.greedy else int(sample(logits_to_probs(logits[None], params),
                                                                          generator))
            out.append(token)
            rows.append(logits)
            seq.append(token)
            if draft_tokens is not None and (i >= len(draft_tokens) or token != draft_tokens[i]):
                break
        return RunnerOutput(out, torch.stack(rows) if want_logits and rows else None)


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


def seal_stage(folder, stage_facts):
    """Write the manifest a completed stage writes: loading verifies every listed output before trusting it."""
    write_manifest(folder, {**stage_facts, "outputs": content_hashes(folder), "output_stats": output_stats(folder)})
