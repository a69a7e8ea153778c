"""`train-draft --kind eagle3`: EAGLE-3 heads for the config's target, trained on the shared dataset, written whole
or not at all (a stage folder) in vLLM's Eagle3 layout, with distill.json and the training curve."""

from __future__ import annotations

import json
from pathlib import Path

TTT_STEPS = 5
EAGLE3_LR = 3e-3
EAGLE3_VOCAB = 8192  # the draft vocabulary unless --vocab says otherwise (all of a smaller one)


def train_eagle3_heads(args, config, layout, target, data, data_key, layers: list[int]) -> int:
    import torch

    from ..artifacts import run_stage
    from ..eagle3_heads import Eagle3Heads
    from ..models import torch_dtype
    from .plot import PLOT_FILE, plot_history
    from .train_eagle3 import Eagle3Options, draft_vocab, train_eagle3

    spec = config.speculative.eagle3
    out = args.out or (config.eagle3_dir() if spec is not None else Path("models") / f"{config.name}-eagle3-heads")
    vocab_size = target.get_output_embeddings().weight.shape[0]
    vocab = args.vocab or min(EAGLE3_VOCAB, vocab_size)
    options = Eagle3Options(tokens=args.tokens, ttt_steps=args.ttt_steps or TTT_STEPS, lr=args.lr or EAGLE3_LR,
                            seed=args.seed, vocab=vocab)

    def produce(tmp: Path) -> dict:
        torch.manual_seed(args.seed)
        heads = Eagle3Heads.for_target(target, layers, draft_vocab(data, vocab, vocab_size, options))
        history = train_eagle3(heads, target, data, options, state_dir=layout.distill_dir("eagle3-state"),
                               resume=args.resume)
        heads.save(tmp, torch_dtype(args.dtype))
        report = {"target": config.target.model, "kind": "eagle3", "target_layers": layers, "dtype": args.dtype,
                  "history": history}
        (tmp / "distill.json").write_text(json.dumps(report, indent=2) + "\n")
        plot_history(history, tmp / PLOT_FILE, f"{config.name}: EAGLE-3 heads, layers {layers}, "
                                               f"{vocab} tokens")
        return {"final_eval": history["evals"][-1], "target_layers": layers}

    result = run_stage("train", "eagle3", Path(out), {"dataset": data_key, "layers": layers},
                       {"options": options.__dict__, "dtype": args.dtype}, produce)
    final = result.manifest.get("final_eval") or {}
    by_position = " ".join(f"{p['acceptance']:.3f}" for p in final.get("by_position", []))
    print(f"eagle3 heads {result.status}: {result.path} (target layers {layers}, {vocab} of {vocab_size} tokens, "
          f"covering {final.get('coverage', 1):.1%} of the target's probability); held-out acceptance by draft "
          f"position [{by_position}], about {final.get('accepted_per_step', 0):.2f} greedy tokens accepted per step")
    print(f"name it in a config: speculative: {{method: eagle3, eagle3: {{model: {result.path}}}}}")
    return 0
