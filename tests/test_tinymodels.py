"""pipeline/tinymodels.py: the tiny pair the default config uses: shared tokenizer, Llama architecture, reproducible."""

from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from pipeline.artifacts import sha256_file
from pipeline.tinymodels import TinyPairSpec, make_tiny_pair, split_files, stdlib_files


def test_pair_shares_tokenizer_and_draft_is_smaller(tiny_pair):
    t_cfg, d_cfg = AutoConfig.from_pretrained(tiny_pair / "target"), AutoConfig.from_pretrained(tiny_pair / "draft")
    assert t_cfg.architectures == ["LlamaForCausalLM"] == d_cfg.architectures
    assert t_cfg.vocab_size == d_cfg.vocab_size
    assert d_cfg.hidden_size < t_cfg.hidden_size and d_cfg.num_hidden_layers <= t_cfg.num_hidden_layers
    t_tok, d_tok = AutoTokenizer.from_pretrained(tiny_pair / "target"), AutoTokenizer.from_pretrained(tiny_pair / "draft")
    assert t_tok.get_vocab() == d_tok.get_vocab()
    assert (tiny_pair / "target" / "model.safetensors").is_file()
    text = "def add(a, b):\n    return a + b\n"
    assert t_tok.decode(t_tok(text)["input_ids"]) == text  # byte-level BPE round-trips source code


def test_generation_is_seeded_and_reproducible(tmp_path):
    spec = TinyPairSpec(target_steps=2, draft_steps=2, text_bytes=100_000, batch_size=2, seq_len=32)
    make_tiny_pair(tmp_path / "a", spec)
    make_tiny_pair(tmp_path / "b", spec)
    for rel in ("target/model.safetensors", "draft/model.safetensors", "target/tokenizer.json"):
        assert sha256_file(tmp_path / "a" / rel) == sha256_file(tmp_path / "b" / rel), rel


def test_train_and_held_out_split_by_file():
    files = stdlib_files()
    train, held = split_files(files, seed=0)
    assert held and train and not set(train) & set(held)
    assert set(train) | set(held) == set(files)
    assert all(isinstance(p, Path) for p in held)
