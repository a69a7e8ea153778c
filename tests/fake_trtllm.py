"""A FAKE TensorRT-LLM engine for contract tests: a torch model behind the EngineRunner boundary.

It stands in for ModelRunnerCpp over a built engine (which needs TensorRT-LLM and a GPU): it decodes with the
model itself and verifies draft tokens the way a `draft_tokens_external` target does with token comparison (keep
the prefix equal to its own tokens, then add one of its own). Recomputes the whole sequence each call: slow, but
tests use tiny models.
"""

from __future__ import annotations

import torch

from pipeline.backends.trtllm_runner import RunnerOutput
from pipeline.speculative import SamplingParams, logits_to_probs, sample


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
