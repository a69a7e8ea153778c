"""Tensor names and dtypes of tensorrtllm_backend's models, as in TensorRT-LLM 1.2.x
(``triton_backend/all_models/inflight_batcher_llm/*/config.pbtxt``).

The upstream Python models (preprocessing, postprocessing, tensorrt_llm_bls) look these names up by string, so
they are kept exactly as upstream spells them. Each row is ``(name, dtype, dims, flags)``; flags: ``o`` optional,
``r`` allow_ragged_batch, ``s`` reshape a per-request [1] to a scalar (what the C++ backend expects).
Encoder-decoder and multimodal-only tensors whose dtype upstream leaves to a template variable are omitted.
"""

from __future__ import annotations

Row = tuple[str, str, list[int], str]

_SCALAR_OPTIONS: list[tuple[str, str]] = [
    ("num_return_sequences", "INT32"), ("draft_acceptance_threshold", "FP32"), ("end_id", "INT32"),
    ("pad_id", "INT32"), ("beam_width", "INT32"), ("temperature", "FP32"), ("runtime_top_k", "INT32"),
    ("runtime_top_p", "FP32"), ("runtime_top_p_min", "FP32"), ("runtime_top_p_decay", "FP32"),
    ("runtime_top_p_reset_ids", "INT32"), ("len_penalty", "FP32"), ("early_stopping", "BOOL"),
    ("repetition_penalty", "FP32"), ("min_tokens", "INT32"), ("beam_search_diversity_rate", "FP32"),
    ("presence_penalty", "FP32"), ("frequency_penalty", "FP32"), ("seed", "UINT64"),
    ("return_log_probs", "BOOL"), ("return_context_logits", "BOOL"), ("return_generation_logits", "BOOL"),
    ("return_perf_metrics", "BOOL"), ("return_num_input_tokens", "BOOL"), ("return_num_output_tokens", "BOOL"),
    ("exclude_input_in_output", "BOOL"), ("stop", "BOOL"), ("streaming", "BOOL"), ("prompt_vocab_size", "INT32"),
    ("lora_task_id", "UINT64"),
]

TENSORRT_LLM_INPUTS: list[Row] = [
    ("input_ids", "INT32", [-1], "or"),
    ("input_lengths", "INT32", [1], "s"),
    ("request_output_len", "INT32", [1], "s"),
    ("draft_input_ids", "INT32", [-1], "or"),
    ("decoder_input_ids", "INT32", [-1], "or"),
    ("decoder_input_lengths", "INT32", [1], "os"),
    ("draft_logits", "FP32", [-1, -1], "or"),
    ("stop_words_list", "INT32", [2, -1], "or"),
    ("bad_words_list", "INT32", [2, -1], "or"),
    ("embedding_bias", "FP32", [-1], "or"),
    *[(name, dtype, [1], "os") for name, dtype in _SCALAR_OPTIONS],
    ("prompt_embedding_table", "FP16", [-1, -1], "or"),
    ("prompt_table_extra_ids", "UINT64", [-1], "or"),
    ("lora_weights", "FP16", [-1, -1], "or"),
    ("lora_config", "INT32", [-1, 3], "or"),
    ("context_phase_params", "UINT8", [-1], "or"),
    ("retention_token_range_starts", "INT32", [-1], "or"),
    ("retention_token_range_ends", "INT32", [-1], "or"),
    ("retention_token_range_priorities", "INT32", [-1], "or"),
    ("retention_token_range_durations_ms", "INT32", [-1], "or"),
    ("retention_decode_priority", "INT32", [1], "or"),
    ("retention_decode_duration_ms", "INT32", [1], "or"),
    ("guided_decoding_guide_type", "STRING", [1], "or"),
    ("guided_decoding_guide", "STRING", [1], "or"),
    ("lookahead_window_size", "INT32", [1], "or"),
    ("lookahead_ngram_size", "INT32", [1], "or"),
    ("lookahead_verification_set_size", "INT32", [1], "or"),
]

# Per-request statistics, shared by tensorrt_llm, tensorrt_llm_bls and the ensemble. The last four are the
# speculative-decoding acceptance numbers TensorRT-LLM reports when `return_perf_metrics` is set.
STATS_OUTPUTS: list[Row] = [
    ("batch_index", "INT32", [1], ""),
    ("sequence_index", "INT32", [1], ""),
    ("kv_cache_alloc_new_blocks", "INT32", [1], ""),
    ("kv_cache_reused_blocks", "INT32", [1], ""),
    ("kv_cache_alloc_total_blocks", "INT32", [1], ""),
    ("arrival_time_ns", "INT64", [1], ""),
    ("first_scheduled_time_ns", "INT64", [1], ""),
    ("first_token_time_ns", "INT64", [1], ""),
    ("last_token_time_ns", "INT64", [1], ""),
    ("acceptance_rate", "FP32", [1], ""),
    ("total_accepted_draft_tokens", "INT32", [1], ""),
    ("total_draft_tokens", "INT32", [1], ""),
    ("num_input_tokens", "INT32", [1], ""),
    ("num_output_tokens", "INT32", [1], ""),
]

LOGPROB_OUTPUTS: list[Row] = [
    ("cum_log_probs", "FP32", [-1], ""),
    ("output_log_probs", "FP32", [-1, -1], ""),
    ("context_logits", "FP32", [-1, -1], ""),
    ("generation_logits", "FP32", [-1, -1, -1], ""),
]

TENSORRT_LLM_OUTPUTS: list[Row] = [
    ("output_ids", "INT32", [-1, -1], ""),
    ("sequence_length", "INT32", [-1], ""),
    *LOGPROB_OUTPUTS,
    ("context_phase_params", "UINT8", [-1], ""),
    *STATS_OUTPUTS,
]

PREPROCESSING_INPUTS: list[Row] = [
    ("QUERY", "STRING", [1], ""),
    ("DECODER_QUERY", "STRING", [1], "o"),
    ("IMAGE_BYTES", "UINT8", [-1, -1, -1, -1], "o"),
    ("IMAGE_URL", "STRING", [1], "o"),
    ("IMAGES", "STRING", [-1], "o"),
    ("VIDEO_BYTES", "UINT8", [-1, -1, -1, -1], "o"),
    ("REQUEST_OUTPUT_LEN", "INT32", [1], ""),
    ("BAD_WORDS_DICT", "STRING", [-1], "o"),
    ("STOP_WORDS_DICT", "STRING", [-1], "o"),
    ("EMBEDDING_BIAS_WORDS", "STRING", [-1], "o"),
    ("EMBEDDING_BIAS_WEIGHTS", "FP32", [-1], "o"),
    ("END_ID", "INT32", [1], "o"),
    ("PAD_ID", "INT32", [1], "o"),
    ("PROMPT_TABLE_EXTRA_ID", "UINT64", [1], "o"),
]

# The BLS model asks preprocessing for all of these by name (multimodal ones included), so all are declared.
PREPROCESSING_OUTPUTS: list[Row] = [
    ("INPUT_ID", "INT32", [-1], ""),
    ("REQUEST_INPUT_LEN", "INT32", [1], ""),
    ("DECODER_INPUT_ID", "INT32", [-1], ""),
    ("REQUEST_DECODER_INPUT_LEN", "INT32", [1], ""),
    ("BAD_WORDS_IDS", "INT32", [2, -1], ""),
    ("STOP_WORDS_IDS", "INT32", [2, -1], ""),
    ("EMBEDDING_BIAS", "FP32", [-1], ""),
    ("REQUEST_OUTPUT_LEN", "INT32", [-1], ""),
    ("OUT_END_ID", "INT32", [1], ""),
    ("OUT_PAD_ID", "INT32", [1], ""),
    ("OUT_PROMPT_TABLE_EXTRA_IDS", "UINT64", [-1], ""),
    ("PIXEL_VALUES", "FP16", [-1, -1, -1, -1], ""),
    ("ASPECT_RATIO_IDS", "INT64", [-1], ""),
    ("ASPECT_RATIO_MASK", "INT64", [-1, -1], ""),
    ("CROSS_ATTENTION_MASK", "INT64", [-1, -1, -1], ""),
    ("IMAGE_SIZES", "INT64", [-1, 2], ""),
    ("IS_VIDEO_INPUT", "BOOL", [1], ""),
    ("ATTENTION_MASK", "INT64", [-1], ""),
    ("IMAGE_GRID_THW", "INT64", [3], ""),
    ("VISION_INPUT_ID", "INT32", [-1], ""),
]

POSTPROCESSING_INPUTS: list[Row] = [
    ("TOKENS_BATCH", "INT32", [-1, -1], ""),
    ("SEQUENCE_LENGTH", "INT32", [-1], ""),
]
POSTPROCESSING_OUTPUTS: list[Row] = [("OUTPUT", "STRING", [-1], "")]

# Request-level inputs of the BLS model and the ensemble (text in, sampling knobs).
TEXT_REQUEST_INPUTS: list[Row] = [
    ("text_input", "STRING", [1], ""),
    ("max_tokens", "INT32", [1], ""),
    ("bad_words", "STRING", [-1], "o"),
    ("stop_words", "STRING", [-1], "o"),
    ("exclude_input_in_output", "BOOL", [1], "o"),
    ("end_id", "INT32", [1], "o"),
    ("pad_id", "INT32", [1], "o"),
    ("top_k", "INT32", [1], "o"),
    ("top_p", "FP32", [1], "o"),
    ("temperature", "FP32", [1], "o"),
    ("length_penalty", "FP32", [1], "o"),
    ("repetition_penalty", "FP32", [1], "o"),
    ("min_tokens", "INT32", [1], "o"),
    ("presence_penalty", "FP32", [1], "o"),
    ("frequency_penalty", "FP32", [1], "o"),
    ("seed", "UINT64", [1], "o"),
    ("beam_width", "INT32", [1], "o"),
    ("stream", "BOOL", [1], "o"),
    ("embedding_bias_words", "STRING", [-1], "o"),
    ("embedding_bias_weights", "FP32", [-1], "o"),
]

BLS_INPUTS: list[Row] = [
    *TEXT_REQUEST_INPUTS,
    ("return_log_probs", "BOOL", [1], "os"),
    ("return_context_logits", "BOOL", [1], "os"),
    ("return_generation_logits", "BOOL", [1], "os"),
    ("return_perf_metrics", "BOOL", [1], "os"),
    ("return_num_input_tokens", "BOOL", [1], "os"),
    ("return_num_output_tokens", "BOOL", [1], "os"),
    ("num_return_sequences", "INT32", [1], "os"),
    # Speculative decoding through the BLS: K per request, and logits-based (rejection) acceptance.
    ("num_draft_tokens", "INT32", [1], "o"),
    ("use_draft_logits", "BOOL", [1], "os"),
]

TEXT_OUTPUTS: list[Row] = [("text_output", "STRING", [-1], ""), *LOGPROB_OUTPUTS, *STATS_OUTPUTS]
