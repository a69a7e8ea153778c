"""Names vulture reports as unused that are in use where it cannot see: tests/test_dead_code.py passes this file
to vulture beside pipeline/ and scripts/, and a name listed here counts as used everywhere.

Never imported or run (``_`` is any object). List a name only with the reason it is used; delete the line when
its code goes. ``vulture pipeline scripts --make-whitelist`` prints the line for a finding.
"""

# pydantic runs the validators its decorators register (pipeline/config.py).
_._model_not_empty
_._ordered
_._k_in_range
_._power_of_two
_._input_fits
_._distinct_ports
_._draft_for_method
_._known_tree
_._depth_fits
_._medusa_heads
_._eagle3_on_torch
_._quantization_on_backend

# Dataclass fields read through asdict(): results.json's cost terms, a tiny pair's LlamaConfig (pipeline/tinymodels.py).
context_tokens
hidden_size
num_hidden_layers
num_attention_heads
num_key_value_heads
intermediate_size
agreement  # pipeline/distill/train.py EvalResult: the training history (distill.json) holds it via asdict()
coverage  # the same, and the training plot reads it from the history

# Settings read by the library that owns the object: reprlib.Repr (pipeline/errors.py), transformers models and
# configs (pipeline/gguf.py, scripts/), tokenizers (pipeline/tinymodels.py), torch, zipfile.
_.maxlevel
_.maxother
_.maxstring
_.maxdict
_.maxlist
_.maxset
_.maxtuple
_.hf_quantizer
_.is_quantized
_._name_or_path
_._attn_implementation
_.num_hidden_layers
_.pre_tokenizer
_.decoder
_.allow_tf32
_.compress_type

# Protobuf fields of Triton's ModelConfig, printed into config.pbtxt (pipeline/triton/).
_.string_value
_.decoupled
_.max_queue_delay_microseconds

# The Triton Python backend loads TritonPythonModel and calls these (pipeline/triton/python_model/model.py).
TritonPythonModel
_.initialize
_.execute
_.finalize

# Hugging Face's Cache interface, called by the models' attention layers (pipeline/executor/paged_kv_cache.py).
_.get_seq_length

# uvicorn's Server reads these flags from its own loop (pipeline/openai_api/server.py stops it through them).
_.should_exit
_.force_exit

# Engine totals the Triton engine model exports through getattr (ENGINE_COUNTERS in
# pipeline/triton/python_model/model.py).
_.prefill_tokens
# The lifetime hit rate of engine.prefix_stats, for a reader of the engine; bench-serve and the metrics take deltas
# of the totals over an interval instead.
_.hit_rate

# A signal handler's signature (pipeline/triton/cli.py).
signum
frame

# Read by tests only: the server's metrics URL, the template parameters deliberately left unset.
_.metrics_url
TENSORRT_LLM_UNSET
tensorrt_llm_unset
PREPROCESSING_UNSET
sampled_tree_accept
tree_attention_bias

# nn.Module.__repr__ calls it: printing a quantized model shows each int8 layer (pipeline/quantize.py).
_.extra_repr

# grpc.GenericRpcHandler.service: gRPC calls it for every incoming call (pipeline/front/grpc_proxy.py).
_.service
# uvicorn's RequestResponseCycle reads it (pipeline/front/http_server.py).
_.disconnected

# Module __getattr__ (PEP 562): Python calls it for a name the package loads on first use
# (pipeline/executor/__init__.py, pipeline/speculative/__init__.py).
__getattr__
# The public greedy accept rule (DESIGN.md's interface, exported by pipeline/speculative through __getattr__); the
# batching engine inlines the same rule over its whole batch.
accept_greedy
# BatchModelRunner.aux_hidden: the chosen layers' outputs of every computed token, for an EAGLE-style drafter; the
# tests read it, and no shipped proposer reads a target's middle layers yet.
_.aux_hidden
