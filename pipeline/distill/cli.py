"""`python -m pipeline train-draft CONFIG`: distil a draft model for the config's target (see pipeline.distill).

Writes a Hugging Face folder (``--out``; default ``models/<config name>-distilled-draft``) that a config's
``draft.model`` can name: the target's architecture with a subset of its layers, its tokenizer files, the trained
weights, ``distill.json`` (the layers it started from, the training history, the dataset's hash) and
``training.png`` (held-out acceptance as training went on). Two stage
folders under ``engines/<name>/distill/``: ``dataset`` (the target's generations and top-k distributions,
reused while the target, the prompts and the data options are unchanged) and ``state`` (checkpoints; ``--resume``
continues a killed run from the last one). The output folder appears whole or not at all.

``--kind medusa`` trains Medusa heads on the frozen target instead, from the same dataset (``train_medusa.py``),
into ``models/<config name>-medusa-heads`` in the layout TensorRT-LLM's Medusa converter reads
(pipeline/medusa_heads.py), checkpoints in ``engines/<name>/distill/medusa-state``. ``--kind eagle3`` trains
EAGLE-3 heads on the frozen target (``train_eagle3.py``: one layer over three target layers' hidden states, with
training-time test) into ``speculative.eagle3.model`` of an eagle3 config, else ``models/<config name>-eagle3-heads``,
in vLLM's Eagle3 layout (pipeline/eagle3_heads.py), checkpoints in ``engines/<name>/distill/eagle3-state``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import PipelineError
from .cli_eagle3 import EAGLE3_LR, EAGLE3_VOCAB
from .plot import PLOT_FILE

DEFAULT_PROMPTS = 256
PROMPT_TOKENS = 48
MODEL_LR = 3e-4
MEDUSA_LR = 1e-3
TOP_K = 32  # target probabilities kept per position (the rest of the mass is renormalised away)


def add_train_parser(sub, common) -> None:
    p = sub.add_parser("train-draft", help="distil a draft model from the target's own outputs")
    common(p)
    p.add_argument("--out", type=Path, help="the draft's HF folder (default: models/<config name>-distilled-draft)")
    p.add_argument("--tokens", type=int, default=200_000, help="response tokens to train on (default 200000)")
    p.add_argument("--prompts", type=Path, help="prompt file (text lines, JSON, JSONL with text or messages); "
                   "default: prompts cut from the Python standard library's sources")
    p.add_argument("--num-prompts", type=int, default=DEFAULT_PROMPTS,
                   help=f"prompts cut from local text when no --prompts file is given (default {DEFAULT_PROMPTS}); "
                        f"more prompts, more distinct training data, longer generation")
    p.add_argument("--layers", help="--kind model: decoder layers of the draft, taken from the target (default: a "
                   "quarter of the target's, at least 1). --kind eagle3: the target layers whose outputs the heads "
                   "fuse, 0-based and comma-separated (default: after layer 1, the middle one and the fourth from "
                   "the end)")
    p.add_argument("--vocab", type=int, help="train the draft's LM head over only the N target tokens the target "
                   "writes most (its head's cost drops by V/N; lossless: the draft proposes only those tokens). "
                   "Default: the whole vocabulary")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="dtype the draft's weights are saved in (it trains in float32). A 16-bit draft costs about "
                        "half as much per token where the device runs that type natively (dtype: auto then picks "
                        "it; elsewhere auto upcasts it to float32). The target's output does not depend on the "
                        "draft's dtype. Default float32")
    p.add_argument("--new-tokens", type=int, default=64, help="target tokens generated per prompt (default 64)")
    p.add_argument("--lr", type=float, help=f"learning rate (default {MODEL_LR} for a model, {MEDUSA_LR} for "
                                            f"Medusa heads, {EAGLE3_LR} for EAGLE-3 heads)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue a killed run from its last checkpoint")
    p.add_argument("--ttt-steps", type=int, help="--kind eagle3: draft steps unrolled per position in training "
                   "(training-time test; default 5)")
    p.add_argument("--kind", choices=("model", "medusa", "eagle3"), default="model",
                   help="what to train: a draft model (default) or Medusa heads on the frozen target (written in the "
                        "layout TensorRT-LLM's Medusa converter reads; default out: speculative.medusa.model of a "
                        "medusa config, else models/<name>-medusa-heads; --vocab N: the heads propose from the N "
                        "tokens the target writes most); or EAGLE-3 heads (one layer over three target layers' hidden "
                        "states, in vLLM's Eagle3 layout; default out: speculative.eagle3.model of an eagle3 config, "
                        f"else models/<name>-eagle3-heads; --vocab default {EAGLE3_VOCAB})")
    p.add_argument("--heads", type=int, help="--kind medusa: heads, head h predicting h + 2 tokens ahead (default: "
                                             "speculative.medusa.heads of a medusa config, else 4)")
    p.add_argument("--head-layers", type=int, help="--kind medusa: residual blocks per head (default: "
                                                   "speculative.medusa.layers of a medusa config, else 1)")
    p.set_defaults(func=cmd_train_draft)


def _prompts(args, tokenizer, target_source: str) -> list[list[int]]:
    if args.prompts is not None:
        from ..prompt_files import encode_items, read_prompt_file

        encoded = encode_items(read_prompt_file(args.prompts), tokenizer, source=target_source)
        return [tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p)
                for p in encoded]
    from ..chat import has_chat_template
    from ..tinymodels import read_text, stdlib_files
    from .dataset import chat_prompts, text_prompts

    texts = read_text(stdlib_files(), 2_000_000)
    if has_chat_template(tokenizer):  # an instruct model: ask it things, as its users will
        return chat_prompts(tokenizer, texts, args.num_prompts, args.seed, source=target_source)
    return text_prompts(tokenizer, texts, args.num_prompts, PROMPT_TOKENS, args.seed)


def _layer_list(value: str | None, what: str) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(part) for part in value.split(",")]
    except ValueError:
        raise PipelineError(f"--layers: {value!r} is not {what}") from None


def cmd_train_draft(args) -> int:
    from ..config import load_config
    from ..layout import Layout
    from ..models import load_causal_lm, load_tokenizer, resolve_model

    for name, value, low in (("--tokens", args.tokens, 1), ("--new-tokens", args.new_tokens, 1),
                             ("--vocab", args.vocab, 1), ("--num-prompts", args.num_prompts, 1),
                             ("--heads", args.heads, 1), ("--head-layers", args.head_layers, 0),
                             ("--ttt-steps", args.ttt_steps, 1)):
        if value is not None and value < low:
            raise PipelineError(f"{name}: {value} must be >= {low}")
    if args.kind == "medusa" and args.layers is not None:
        raise PipelineError("--layers: applies to --kind model and eagle3; Medusa heads take --heads and "
                            "--head-layers")
    if args.kind != "eagle3" and args.ttt_steps is not None:
        raise PipelineError("--ttt-steps: applies to --kind eagle3 only")
    layers = _layer_list(args.layers, "a layer count" if args.kind == "model" else "comma-separated layer ids")
    if args.kind == "model" and layers is not None and len(layers) != 1:
        raise PipelineError(f"--layers: {args.layers!r} is not a layer count (--kind model takes one number)")
    config = load_config(args.config)
    layout = Layout.for_config(config, args.engines_dir)
    target_model = resolve_model(config.target, "target", config.base_dir, with_weights=True)
    tokenizer = load_tokenizer(target_model)
    target = load_causal_lm(target_model, "float32")
    vocab_size = target.get_output_embeddings().weight.shape[0]
    if args.vocab is not None and args.vocab > vocab_size:
        raise PipelineError(f"--vocab: {args.vocab} is above the target's {vocab_size} tokens; give fewer, or leave "
                            f"--vocab out to keep the whole vocabulary")
    if args.kind == "model":
        from .draft_init import default_layers

        try:
            layers = default_layers(target.config.num_hidden_layers,
                                    layers[0] if layers else max(1, target.config.num_hidden_layers // 4))
        except ValueError as exc:
            raise PipelineError(str(exc)) from None
    elif args.kind == "eagle3":
        layers = _eagle3_layers(layers, target.config.get_text_config().num_hidden_layers)
    data, data_key = _dataset(args, config, layout, target_model, tokenizer, target)
    if args.kind == "medusa":
        return _train_medusa(args, config, layout, target, data, data_key)
    if args.kind == "eagle3":
        from .cli_eagle3 import train_eagle3_heads

        return train_eagle3_heads(args, config, layout, target, data, data_key, layers)
    return _train_model(args, config, layout, target, tokenizer, data, data_key, layers, vocab_size)


def _eagle3_layers(layers: list[int] | None, count: int) -> list[int]:
    from ..eagle3_heads import FUSED_LAYERS, check_depth, default_layers

    try:
        check_depth(count)
    except ValueError as exc:
        raise PipelineError(f"--kind eagle3: {exc}") from None
    if layers is None:
        return default_layers(count)
    wrong = [layer for layer in layers if not 0 <= layer < count - 1]
    if wrong or len(set(layers)) != len(layers) or len(layers) != FUSED_LAYERS:
        raise PipelineError(f"--layers: {layers} must be {FUSED_LAYERS} distinct target layers from 0 to {count - 2} "
                            f"(the target has {count}; the last one's output is what the target's own head reads)")
    return sorted(layers)


def _dataset(args, config, layout, target_model, tokenizer, target):
    """The target's generations for this target, prompts and data options: made once, then reused."""
    from ..artifacts import canonical_hash, content_hashes, run_stage
    from ..chat import end_of_turn_ids, has_chat_template
    from .dataset import DistillSet, generate_dataset

    prompts = _prompts(args, tokenizer, config.target.model)
    target_hash = canonical_hash(content_hashes(target_model.path)) if not target_model.gguf_file \
        else target_model.gguf_sha256
    data_inputs = {"target": target_hash, "prompts": canonical_hash(prompts)}
    data_config = {"new_tokens": args.new_tokens, "top_k": TOP_K, "seed": args.seed}
    stops = end_of_turn_ids(tokenizer) if has_chat_template(tokenizer) else []
    data_stage = run_stage("dataset", "draft", layout.distill_dir("dataset"), data_inputs, data_config,
                           lambda tmp: generate_dataset(target, tokenizer, prompts, args.new_tokens, TOP_K,
                                                        args.seed, stop_ids=stops).save(tmp)
                           or {"prompts": len(prompts)})
    print(f"dataset {data_stage.status}: {data_stage.path}")
    return DistillSet.load(data_stage.path), data_stage.manifest["input_key"]


def _train_model(args, config, layout, target, tokenizer, data, data_key, layers, vocab_size) -> int:
    from ..artifacts import run_stage
    from ..models import torch_dtype
    from .draft_init import draft_from_target
    from .plot import plot_history
    from .train import TrainOptions, train_draft

    out = args.out or Path("models") / f"{config.name}-distilled-draft"
    options = TrainOptions(tokens=args.tokens, lr=args.lr or MODEL_LR, seed=args.seed, vocab=args.vocab)
    train_inputs = {"dataset": data_key, "layers": layers}

    def produce(tmp: Path) -> dict:
        draft = draft_from_target(target, layers)
        history = train_draft(draft, data, options, state_dir=layout.distill_dir("state"), resume=args.resume)
        draft.to(torch_dtype(args.dtype)).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        report = {"target": config.target.model, "layers_from_target": layers, "dtype": args.dtype,
                  "history": history}
        (tmp / "distill.json").write_text(json.dumps(report, indent=2) + "\n")
        plot_history(history, tmp / PLOT_FILE, f"{config.name}: draft from layers {layers} of the target"
                     + (f", head over {args.vocab} tokens" if args.vocab else ""))
        return {"layers_from_target": layers, "final_eval": history["evals"][-1]}

    result = run_stage("train", "draft", Path(out), train_inputs, {"options": options.__dict__, "dtype": args.dtype},
                       produce)
    final = result.manifest.get("final_eval") or {}
    head = f"; head over {args.vocab} of {vocab_size} tokens, covering {final.get('coverage', 1):.1%} of " \
           f"the target's probability" if args.vocab else ""
    print(f"draft {result.status}: {result.path} ({len(layers)} of the target's "
          f"{target.config.num_hidden_layers} layers: {layers}{head}); held-out acceptance "
          f"{final.get('acceptance', 0):.3f}, greedy agreement {final.get('agreement', 0):.3f}")
    print(f"name it in a config: draft: {{model: {result.path}}}")
    return 0


def _train_medusa(args, config, layout, target, data, data_key) -> int:
    from ..artifacts import run_stage
    from ..config import MedusaSpec
    from ..medusa_heads import MedusaHeads
    from ..models import torch_dtype
    from .plot import plot_history
    from .train_medusa import MedusaOptions, train_medusa

    spec = config.speculative.medusa
    out = args.out or (config.medusa_dir() if spec is not None else Path("models") / f"{config.name}-medusa-heads")
    spec_defaults = spec or MedusaSpec(model=str(out))  # a config without medusa: the defaults of the section
    heads_n = args.heads or spec_defaults.heads
    layers_n = args.head_layers if args.head_layers is not None else spec_defaults.layers
    options = MedusaOptions(tokens=args.tokens, heads=heads_n, layers=layers_n,
                            lr=args.lr or MEDUSA_LR, seed=args.seed, vocab=args.vocab)

    def produce(tmp: Path) -> dict:
        heads = MedusaHeads.from_target(target, options.heads, options.layers)
        history = train_medusa(heads, target, data, options, state_dir=layout.distill_dir("medusa-state"),
                               resume=args.resume)
        heads.to(torch_dtype(args.dtype)).save(tmp, base_model=config.target.model)
        report = {"target": config.target.model, "kind": "medusa", "dtype": args.dtype, "history": history}
        (tmp / "distill.json").write_text(json.dumps(report, indent=2) + "\n")
        plot_history(history, tmp / PLOT_FILE, f"{config.name}: {options.heads} Medusa heads of "
                                               f"{options.layers} layer(s)")
        return {"final_eval": history["evals"][-1]}

    result = run_stage("train", "medusa", Path(out), {"dataset": data_key},
                       {"options": options.__dict__, "dtype": args.dtype}, produce)
    final = result.manifest.get("final_eval") or {}
    by_head = " ".join(f"{h['acceptance']:.3f}" for h in final.get("by_head", []))
    print(f"medusa heads {result.status}: {result.path} ({options.heads} heads, {options.layers} layer(s) each); "
          f"held-out acceptance by head [{by_head}]")
    return 0
