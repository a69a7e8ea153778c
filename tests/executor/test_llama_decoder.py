"""pipeline/executor/llama_decoder.py and pipeline/decoder_support.py: the lean decoder gives Hugging Face's logits
and final hidden states for every Llama-family variant it accepts, leaves the model serving ``generate`` unchanged,
and every model it refuses runs through the Hugging Face modules with the reason said."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, \
    Qwen2ForCausalLM

from pipeline.decoder_support import LEAN, MODULES, runner_for
from pipeline.executor import huge_pages, matmul_choice, paged_attention, row_kernels
from pipeline.executor.llama_decoder import LlamaDecoder
from pipeline.executor.attention_choice import AttentionPlan
from pipeline.executor.matmul_choice import KernelPlan
from pipeline.executor.model_runner import BatchModelRunner
from pipeline.quantize import quantize_model

SIZES = dict(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def _model(cls, config_cls, dtype=torch.float32, **extra):
    torch.manual_seed(0)
    model = cls(config_cls(**SIZES, **extra)).eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: make them matter
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.3)
    return model.to(dtype)


VARIANTS = {
    "llama": lambda: _model(LlamaForCausalLM, LlamaConfig),
    "llama3-rope-tied": lambda: _model(LlamaForCausalLM, LlamaConfig, tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-biases": lambda: _model(LlamaForCausalLM, LlamaConfig, attention_bias=True, mlp_bias=True),
    "qwen2-qkv-bias": lambda: _model(Qwen2ForCausalLM, Qwen2Config),
    "mistral": lambda: _model(MistralForCausalLM, MistralConfig, sliding_window=None),
}


@torch.no_grad()
def _hf(model, ids):
    out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0].float(), out.hidden_states[-1][0]


def _packed(runner, ids, other):
    """ids through the runner as a prompt chunk beside another row, then a 5-token verify and one more step:
    (logits [len(ids), V], final hidden states [len(ids), d])."""
    runner.open("other", other)
    runner.open("seq", ids)
    parts = [runner.forward(["other", "seq"], [other, ids[:-6]], hidden=True),
             runner.forward(["seq"], [ids[-6:-1]], hidden=True), runner.forward(["seq"], [ids[-1:]], hidden=True)]
    logits = torch.cat([parts[0][0][1, :len(ids) - 6], parts[1][0][0, :5], parts[2][0][0, :1]])
    hidden = torch.cat([parts[0][1][1, :len(ids) - 6], parts[1][1][0, :5], parts[2][1][0, :1]])
    return logits, hidden


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_hidden_states_equal_the_hf_modules(variant):
    model = VARIANTS[variant]()
    gen = torch.Generator().manual_seed(3)
    ids, other = (torch.randint(0, 120, (n,), generator=gen).tolist() for n in (41, 13))
    expected_logits, expected_hidden = _hf(model, ids)
    runner = BatchModelRunner(model, "cpu", max_tokens=200, block_size=8, max_blocks=64)
    assert runner.runner == LEAN, runner.why_modules
    logits, hidden = _packed(runner, ids, other)
    assert (logits - expected_logits).abs().max() < 1e-4
    assert (hidden - expected_hidden).abs().max() < 1e-4
    # The projections are views into the fused matrices now: the model itself answers as before.
    after_logits, _ = _hf(model, ids)
    assert torch.equal(after_logits, expected_logits)


def test_bfloat16_stays_within_rounding_of_the_hf_modules():
    model = VARIANTS["llama"]().to(torch.bfloat16)
    ids = list(range(3, 40))
    expected, _ = _hf(model, ids)
    runner = BatchModelRunner(model, "cpu", max_tokens=200, block_size=8, max_blocks=64)
    assert runner.runner == LEAN
    logits, _ = _packed(runner, ids, [1, 2, 3])
    assert (logits - expected).abs().max() < 0.1 * expected.abs().max()
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


def test_the_modules_path_when_the_lean_decoder_is_off_gives_the_same_logits():
    model = VARIANTS["qwen2-qkv-bias"]()
    ids = list(range(5, 30))
    lean = BatchModelRunner(model, "cpu", max_tokens=200, block_size=8, max_blocks=64)
    modules = BatchModelRunner(model, "cpu", max_tokens=200, block_size=8, max_blocks=64, lean=False)
    assert (lean.runner, modules.runner, modules.why_modules) == (LEAN, MODULES, "the lean decoder is off")
    a, _ = _packed(lean, ids, [7, 8])
    b, _ = _packed(modules, ids, [7, 8])
    assert (a - b).abs().max() < 1e-4


def _int8_llama():
    model = VARIANTS["llama"]().to(torch.bfloat16)
    quantize_model(model, "int8_weight_only")  # in place
    return model


def _hooked_llama():
    model = VARIANTS["llama"]()
    model.lm_head.register_forward_hook(lambda module, inputs, logits: logits * 0.5)
    return model


@pytest.mark.parametrize("make, words", [
    (lambda: _model(MistralForCausalLM, MistralConfig, sliding_window=16), "16-token sliding window"),
    (_hooked_llama, "forward hooks on lm_head"),
], ids=["mistral-window", "hooks"])
def test_what_the_lean_decoder_refuses_runs_through_the_modules(make, words):
    model = make()
    ids = list(range(5, 17))  # within the window: paged attention has no sliding window on either path
    expected, _ = _hf(model, ids)
    runner = BatchModelRunner(model, "cpu", max_tokens=200, block_size=8, max_blocks=64)
    assert runner.runner == MODULES and words in runner.why_modules, runner.why_modules
    logits, _ = _packed(runner, ids, [1])
    tolerance = 1e-4 if runner.dtype == torch.float32 else 0.02  # bfloat16 rounds packed rows differently
    assert (logits - expected).abs().max() < tolerance * max(1.0, float(expected.abs().max()))


@pytest.mark.parametrize("config, positions, quantization, reason", [
    ({"model_type": "llama"}, 2048, "none", None),
    ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 4096}, 8192, "none", None),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096}, 8192, "none", "sliding window"),
    ({"model_type": "mistral", "sliding_window": 4096}, 4096, "none", None),
    ({"model_type": "gpt2"}, 1024, "none", "model_type 'gpt2'"),
    ({"model_type": "llama", "hidden_act": "gelu"}, 1024, "none", "hidden_act 'gelu'"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "dynamic"}}, 1024, "none", "rope_type 'dynamic'"),
    ({"model_type": "llama", "rope_scaling": {"type": "longrope"}}, 1024, "none", "rope_type 'longrope'"),
    ({"model_type": "llama", "layer_types": ["full_attention", "sliding_attention"]}, 1024, "none", "sliding"),
    ({"model_type": "llama"}, 1024, "int8_weight_only", None),
    ({"model_type": "llama"}, 1024, "fp8", "fp8 weights"),
])
def test_runner_for_reads_config_json(config, positions, quantization, reason):
    runner, why = runner_for(config, positions, quantization)
    assert (runner == LEAN) == (reason is None)
    assert reason is None and why is None or reason in why, why


@pytest.mark.parametrize("kind", ["linear", "w_xt", "rows"])
def test_every_matrix_product_gives_the_modules_logits(kind):
    if kind == "rows" and row_kernels.unavailable():
        pytest.skip(f"the rows kernel: {row_kernels.unavailable()}")
    model = VARIANTS["llama-biases"]()
    ids = list(range(3, 30))
    expected, _ = _hf(model, ids)
    runner = BatchModelRunner(model, "cpu", max_tokens=200, block_size=8, max_blocks=64)
    runner._decoder = LlamaDecoder(model, 200, KernelPlan(dict.fromkeys(range(1, 64), kind)))
    logits, _ = _packed(runner, ids, [4, 5])
    assert (logits - expected).abs().max() < 1e-4


def test_int8_layers_run_fused_on_the_lean_decoder_with_the_modules_numbers():
    model = _int8_llama()
    ids = list(range(3, 30))
    modules = BatchModelRunner(model, "cpu", max_tokens=200, block_size=8, max_blocks=64, lean=False)
    expected, _ = _packed(modules, ids, [4, 5])
    lean = BatchModelRunner(model, "cpu", max_tokens=200, block_size=8, max_blocks=64)
    assert lean.runner == LEAN, lean.why_modules
    got, _ = _packed(lean, ids, [4, 5])
    assert torch.equal(got, expected)  # per output channel the int8 kernel does the same work fused or not
    again, _ = _packed(BatchModelRunner(model, "cpu", max_tokens=200, block_size=8, max_blocks=64, lean=False),
                       ids, [4, 5])
    assert torch.equal(again, expected)  # the modules now read views of the fused int8 rows: the same numbers


@pytest.mark.parametrize("variant", ["llama", "qwen2-qkv-bias"])
@pytest.mark.parametrize("lean", [True, False])
def test_the_c_plus_plus_attention_gives_the_modules_logits(variant, lean):
    if row_kernels.unavailable():
        pytest.skip(f"the row kernels' library: {row_kernels.unavailable()}")
    model = VARIANTS[variant]()
    gen = torch.Generator().manual_seed(3)
    ids, other = (torch.randint(0, 120, (n,), generator=gen).tolist() for n in (41, 13))
    expected, _ = _hf(model, ids)
    runner = BatchModelRunner(model, "cpu", max_tokens=200, block_size=8, max_blocks=64, lean=lean)
    runner.cache.attention = AttentionPlan({16: "paged"})  # every decode and verify width; prompt chunks SDPA
    logits, _ = _packed(runner, ids, other)
    assert (logits - expected).abs().max() < 1e-4


def test_the_rows_kernel_runs_an_int8_model_within_bfloat16s_rounding_of_its_modules(monkeypatch):
    if row_kernels.unavailable():
        pytest.skip(f"the rows kernel: {row_kernels.unavailable()}")
    model = _int8_llama()
    ids = list(range(3, 30))
    expected, _ = _packed(BatchModelRunner(model, "cpu", max_tokens=200, block_size=8, max_blocks=64, lean=False),
                          ids, [4, 5])
    runner = BatchModelRunner(model, "cpu", max_tokens=200, block_size=8, max_blocks=64)
    runner._decoder = LlamaDecoder(model, 200, KernelPlan(dict.fromkeys(range(1, 64), "rows")))
    runner.cache.attention = AttentionPlan()  # the products one by one, each counted (no layer in one call)
    widths, call = [], row_kernels.rows_mm_int8
    monkeypatch.setattr(row_kernels, "rows_mm_int8", lambda x, layer: widths.append(x.shape[0]) or call(x, layer))
    logits, _ = _packed(runner, ids, [4, 5])
    assert set(widths) == {5, 1}  # the verify and the step; the prompt chunks are wider than the kernel takes
    assert (logits.float() - expected.float()).abs().max() < 0.02 * float(expected.abs().max())


@pytest.mark.parametrize("variant", ["llama", "qwen2-qkv-bias"])
def test_aux_layers_are_every_computed_tokens_layer_output_on_both_runners(variant):
    """What an EAGLE-style drafter reads: a middle layer's output for every token a forward computed, prompt chunks
    included, per row of the forward, the same on both runners and equal to Hugging Face's hidden_states[i + 1]."""
    model = VARIANTS[variant]()
    ids, other = list(range(3, 44)), list(range(50, 63))
    with torch.no_grad():
        expected = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[1][0]  # layer 0's output
    for lean in (True, False):
        runner = BatchModelRunner(model, "cpu", max_tokens=200, block_size=8, max_blocks=64, lean=lean,
                                  aux_layers=(0,))
        assert runner.runner == (LEAN if lean else MODULES)
        runner.open("other", other)
        runner.open("seq", ids)
        got = []
        runner.forward(["other", "seq"], [other, ids[:-6]], logits_for=[1, 1])  # two prompt chunks
        assert [a.shape for a in runner.aux_hidden] == [(len(other), 1, 64), (len(ids) - 6, 1, 64)]
        got.append(runner.aux_hidden[1])
        runner.forward(["seq"], [ids[-6:-1]])  # a 5-token verify
        got.append(runner.aux_hidden[0])
        runner.forward(["seq"], [ids[-1:]])
        got.append(runner.aux_hidden[0])
        assert (torch.cat(got)[:, 0] - expected).abs().max() < 1e-4, lean


def test_aux_layers_outside_the_model_are_refused():
    model = VARIANTS["llama"]()
    for wrong in ((1,), (0, 0), (-1,)):  # 2 layers: the last one's output is the final hidden state
        with pytest.raises(ValueError, match=r"aux_layers: .* must be distinct decoder layers from 0 to 0"):
            BatchModelRunner(model, "cpu", max_tokens=200, block_size=8, max_blocks=64, aux_layers=wrong)


@pytest.mark.skipif(row_kernels.unavailable() is not None, reason="the row kernels' library does not load here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_layer_ops_give_the_torch_paths_logits(monkeypatch, dtype):
    """Any model, however small, runs RMSNorm, RoPE and SiLU * up as the row kernels' operators in eager CPU
    forwards; the logits are the torch expressions' within rounding."""
    model = VARIANTS["qwen2-qkv-bias"]().to(dtype)  # QKV bias: rotated after the bias is added
    runner = BatchModelRunner(model, "cpu", max_tokens=64, block_size=8, max_blocks=16)
    assert runner._decoder.layer_ops
    runner.cache.attention = AttentionPlan()  # SDPA: the operators one by one, not a layer in one call
    calls = []
    for name in ("rms_norm", "rope_", "silu_mul"):
        monkeypatch.setattr(row_kernels, name, lambda *a, _f=getattr(row_kernels, name), _n=name: calls.append(_n)
                            or _f(*a))
    ids = [3, 9, 27, 4, 11, 30, 2]
    runner.open("s", ids)
    fused = runner.forward(["s"], [ids], logits_for=[len(ids)])
    assert set(calls) == {"rms_norm", "rope_", "silu_mul"}
    runner._decoder.layer_ops = False
    runner.truncate("s", 0)
    expected = runner.forward(["s"], [ids], logits_for=[len(ids)])
    layers = len(model.model.layers)
    assert len(calls) == 4 * layers + 1  # two norms, the rotation and the MLP's gate per layer, the final norm
    assert (fused.float() - expected.float()).abs().max() < (1e-4 if dtype == torch.float32 else 0.1)
    runner._decoder.layer_ops = True
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # what export sees: torch's operators
    calls.clear()
    runner.truncate("s", 0)
    runner.forward(["s"], [ids], logits_for=[len(ids)])
    assert calls == []


@pytest.mark.skipif(row_kernels.unavailable() is not None, reason="the row kernels' library does not load here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"])
def test_a_step_of_one_width_runs_in_one_call_per_layer_with_the_operators_numbers(monkeypatch, dtype):
    """With the fused layer ops, the rows kernel and the paged kernel, a forward whose rows share one width runs each
    layer as one C++ call (decoder_layer); with another product, its attention alone (RoPE, the KV write and the
    paged kernel: rope_write_attend); rows of different widths take the operators one by one. All three give the
    same logits and leave the same KV, bit for bit."""
    model = VARIANTS["qwen2-qkv-bias"]().to(torch.bfloat16 if dtype == "int8" else dtype)
    if dtype == "int8":  # int8 matrices (their biases inside them) through rows_mm_int8
        quantize_model(model, "int8_weight_only")
    steps = [(["a"], [[3, 9, 27, 4, 11, 30, 2]]), (["b"], [[5, 8, 13, 21, 34]]),
             (["a", "b"], [[7, 1, 4], [2, 6, 3]]),  # one width: one call
             (["a", "b"], [[9, 9], [1, 2, 5, 7]]),  # two widths: the operators
             (["b"], [[11]])]

    # the plan is set below: no whole forwards timed at construction (they would add to the calls counted)
    monkeypatch.setattr(BatchModelRunner, "_prefer_whole_layers", lambda self, leader: None)

    def run():
        runner = BatchModelRunner(model, "cpu", max_tokens=64, block_size=4, max_blocks=32)
        runner.cache.attention = AttentionPlan({16: "paged"})
        runner._decoder.kernels = KernelPlan(dict.fromkeys(range(1, 17), "rows"))
        assert runner._decoder.layer_ops and runner._decoder.layer_weights is not None
        runner.open("a", steps[0][1][0])
        runner.open("b", steps[1][1][0])
        logits = [runner.forward(seqs, tokens, logits_for=[len(t) for t in tokens]) for seqs, tokens in steps]
        return logits, [(layer.keys.clone(), layer.values.clone()) for layer in runner.cache.layers]

    def counted(name):
        calls, call = [], getattr(row_kernels, name)
        monkeypatch.setattr(row_kernels, name, lambda *a: calls.append(a[0].shape[0]) or call(*a))
        return calls

    attention_calls, layer_calls = counted("rope_write_attend"), counted("decoder_layer")
    with monkeypatch.context() as off:
        off.setattr(paged_attention, "one_paged_group", lambda *a: None)  # neither one-call path
        expected, expected_kv = run()
    with monkeypatch.context() as off:
        off.setattr(LlamaDecoder, "_whole_layers", lambda *a: False)
        attention_only, attention_only_kv = run()
    whole, whole_kv = run()
    layers = len(model.model.layers)
    one_width = [7] * layers + [5] * layers + [6] * layers + [1] * layers  # not the step of two widths
    assert attention_calls == one_width and layer_calls == one_width
    for got, kv in ((attention_only, attention_only_kv), (whole, whole_kv)):
        for step, (x, y) in enumerate(zip(got, expected)):
            assert torch.equal(x, y), f"step {step}"
        assert all(torch.equal(a, b) for pair, other in zip(kv, expected_kv) for a, b in zip(pair, other))


@pytest.mark.skipif(huge_pages.unavailable() is not None, reason="no transparent huge pages here")
@pytest.mark.parametrize("variant", ["llama3-rope-tied", "qwen2-qkv-bias"])
def test_a_large_models_matrices_move_into_one_huge_page_arena_and_the_model_follows(monkeypatch, variant):
    """From huge_pages.MIN_BYTES on, the decoder's matrices are copies in one arena, the model's own projections
    (and a tied embedding) views of them, and the logits are the same."""
    model = VARIANTS[variant]()
    ids = torch.tensor([[3, 9, 27, 4, 11]])
    with torch.no_grad():
        before = model(ids).logits
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 1)
    decoder = LlamaDecoder(model, 64, kernels=KernelPlan())
    layer, attn = decoder.layers[0], model.model.layers[0].self_attn
    base = decoder.layers[0].qkv.untyped_storage().data_ptr()
    for matrix in (layer.qkv, layer.o, layer.gate_up, layer.down, decoder.lm_head):
        assert matrix.untyped_storage().data_ptr() == base  # one mapping
    assert attn.k_proj.weight.data_ptr() == layer.qkv.data_ptr() + attn.q_proj.weight.numel() * 4
    assert attn.o_proj.weight.data_ptr() == layer.o.data_ptr()
    if variant.endswith("tied"):
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert decoder.embed.data_ptr() == decoder.lm_head.data_ptr()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
