"""Make a tiny Llama-architecture TARGET/DRAFT pair on local text, so the pipeline runs with no model hub.

The text is the Python standard library's own sources (present wherever Python is), split by file into train and
held-out sets. A byte-level BPE tokenizer is trained on the train split and shared by both models; the target is
trained briefly on next-token prediction and the draft is distilled from the target, so acceptance is far above
chance. Everything is seeded: the same machine and Python produce the same files.
"""

from __future__ import annotations

import json
import random
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

EOS = "<|endoftext|>"


@dataclass
class TinyModelShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


@dataclass
class TinyPairSpec:
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    target: TinyModelShape = field(default_factory=lambda: TinyModelShape(96, 3, 4, 2, 256))
    draft: TinyModelShape = field(default_factory=lambda: TinyModelShape(48, 1, 2, 1, 128))
    target_steps: int = 300  # next-token training steps of the target
    draft_steps: int = 300  # distillation steps of the draft
    seq_len: int = 128
    batch_size: int = 16
    lr: float = 3e-3
    text_bytes: int = 3_000_000  # how much stdlib source to read
    seed: int = 0


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.glob("*.py")] + [p for p in root.glob("*/*.py") if "test" not in p.parts[-2]]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_files(files: list[Path], seed: int, held_out: float = 0.1) -> tuple[list[Path], list[Path]]:
    """Split by file (not by line) so held-out text shares no file with training text."""
    shuffled = list(files)
    random.Random(seed).shuffle(shuffled)
    n_held = max(1, int(len(shuffled) * held_out))
    return sorted(shuffled[n_held:]), sorted(shuffled[:n_held])


def read_text(files: list[Path], limit: int) -> list[str]:
    texts, total = [], 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= limit:
            break
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS)


def llama_config(shape: TinyModelShape, tokenizer, max_pos: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=max_pos,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, **asdict(shape))


def token_stream(texts: list[str], tokenizer):
    import torch

    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def batches(stream, seq_len: int, batch_size: int, generator):
    import torch

    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([stream[s:s + seq_len] for s in starts.tolist()])


def _train(model, steps: int, spec: TinyPairSpec, stream, loss_fn, desc: str) -> float:
    import torch
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(spec.seed + len(desc))
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=spec.lr, total_steps=max(steps, 1), pct_start=0.1)
    model.train()
    loss_value = float("nan")
    for _ in tqdm(range(steps), desc=desc, unit="step", disable=steps == 0):
        batch = batches(stream, spec.seq_len, spec.batch_size, gen)
        loss = loss_fn(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = loss.item()
    model.eval()
    return loss_value


def _lm_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


def _distill_loss(teacher):
    import torch
    import torch.nn.functional as F

    def loss(student, batch):
        with torch.no_grad():
            teacher_logp = F.log_softmax(teacher(input_ids=batch).logits.float(), dim=-1)
        student_logp = F.log_softmax(student(input_ids=batch).logits.float(), dim=-1)
        return F.kl_div(student_logp, teacher_logp, log_target=True, reduction="batchmean") / batch.shape[1]

    return loss


def make_tiny_pair(out_dir: Path, spec: TinyPairSpec | None = None) -> dict:
    """Write ``out_dir/{target,draft}`` (safetensors + shared tokenizer) and ``out_dir/pair.json``."""
    import torch
    from transformers import LlamaForCausalLM

    spec = spec or TinyPairSpec()
    start = time.perf_counter()
    torch.manual_seed(spec.seed)
    train_files, held_files = split_files(stdlib_files(), spec.seed)
    texts = read_text(train_files, spec.text_bytes)
    tokenizer = train_tokenizer(texts, spec.vocab_size)
    stream = token_stream(texts, tokenizer)

    target = LlamaForCausalLM(llama_config(spec.target, tokenizer, spec.max_position_embeddings))
    target_loss = _train(target, spec.target_steps, spec, stream, _lm_loss, "train target")
    torch.manual_seed(spec.seed + 1)
    draft = LlamaForCausalLM(llama_config(spec.draft, tokenizer, spec.max_position_embeddings))
    draft_loss = _train(draft, spec.draft_steps, spec, stream, _distill_loss(target), "distill draft")

    out_dir.mkdir(parents=True, exist_ok=True)
    for role, model in (("target", target), ("draft", draft)):
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(out_dir / role, safe_serialization=True)
        tokenizer.save_pretrained(out_dir / role)
    info = {"spec": asdict(spec), "target_train_loss": target_loss, "draft_distill_loss": draft_loss,
            "train_files": len(train_files), "held_out_files": [p.name for p in held_files],
            "seconds": round(time.perf_counter() - start, 1)}
    (out_dir / "pair.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
