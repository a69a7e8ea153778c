"""The torch layout's Triton models as clients see them: the model names and the tensors they take and return.

The repository writer (pipeline/triton/torch_repo.py) declares the models from these tables, and the OpenAI proxy
(pipeline/openai_api/) builds its requests from them, so the two cannot disagree about a name or a dtype. Each row is
(name, Triton dtype, dims).
"""

from __future__ import annotations

MODEL = "speculative"  # request/response: one answer with the whole text, ids and statistics
STREAM_MODEL = "speculative_stream"  # decoupled: one response per engine step; hosts the engine

INPUTS: list[tuple[str, str, list[int]]] = [
    ("text_input", "STRING", [1]),
    ("input_ids", "INT32", [-1]),
    ("messages", "STRING", [1]),  # JSON text of [{"role": ..., "content": ...}, ...], through the chat template
    ("max_tokens", "INT32", [1]),
    ("temperature", "FP32", [1]),
    ("top_k", "INT32", [1]),
    ("top_p", "FP32", [1]),
    ("seed", "UINT64", [1]),
    ("num_draft_tokens", "INT32", [1]),  # the request's max_draft_len
    # True: max_tokens is lowered to what the KV pool holds for this prompt instead of the request being refused
    # (the OpenAI endpoint sends it for a request without max_tokens: it cannot count a chat's prompt tokens).
    ("max_tokens_fit", "BOOL", [1]),
    ("cache_salt", "STRING", [1]),  # requests share cached prefix blocks only with requests of the same salt
    # The request's drafting method (ngram, suffix, draft_model, ...; one the served engines can run), else the
    # config's: lets one server, and bench-serve, compare methods request by request.
    ("speculative_method", "STRING", [1]),
    # Output controls, applied to the target's distribution at every verified position (and to the draft's):
    ("presence_penalty", "FP32", [1]),  # OpenAI's, over the generated tokens
    ("frequency_penalty", "FP32", [1]),
    ("repetition_penalty", "FP32", [1]),  # over prompt and output; 1 disables it
    ("logit_bias", "STRING", [1]),  # JSON object {"token id": bias}
    ("min_tokens", "INT32", [1]),  # stop and EOS tokens are masked until this many were generated
    ("ignore_eos", "BOOL", [1]),
    ("logprobs", "INT32", [1]),  # present: every token's log-probability, with this many alternatives (0-20)
    ("response_format", "STRING", [1]),  # JSON: OpenAI's response_format (json_object, json_schema, regex, grammar)
    ("tools", "STRING", [1]),  # JSON: OpenAI's tools, rendered by the chat template (messages only)
    ("tool_choice", "STRING", [1]),  # JSON: "none", "auto", "required" or {"type": "function", ...}
]
REQUIRED_INPUTS = {"max_tokens"}  # one of text_input / input_ids / messages is checked by the model
# The engine model's extra inputs: the proxy tags what it forwards, and cancels by that tag.
ENGINE_INPUTS: list[tuple[str, str, list[int]]] = [("request_key", "STRING", [1]), ("cancel_request", "STRING", [1]),
                                                   ("final_only", "BOOL", [1])]

OUTPUTS: list[tuple[str, str, list[int]]] = [
    ("text_output", "STRING", [1]),
    ("output_ids", "INT32", [-1]),
    ("finish_reason", "STRING", [1]),
    ("prompt_tokens", "INT32", [1]),
    ("draft_tokens", "INT32", [1]),
    ("accepted_tokens", "INT32", [1]),
    ("target_steps", "INT32", [1]),
    ("acceptance_rate", "FP32", [1]),
    ("mean_accepted_len", "FP32", [1]),
    # JSON list, one entry per token of output_ids when the request asked for logprobs (else empty): [token id,
    # token text, logprob, [[id, text, logprob], ...alternatives]]
    ("logprobs", "STRING", [1]),
]
