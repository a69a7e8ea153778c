#!/usr/bin/env python3
"""Train, once, the code TARGET/DRAFT pair used by configs/code-pair.yaml (about 10-20 minutes on 2 CPU cores).

Usage: python scripts/train_code_pair.py [--out models/code-pair] [--threads 1] [--seed 0] [--force]
Skips the work when OUT/pair.json exists. The held-out loss of both models is written to OUT/pair.json.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.trained_pair import HELD_OUT_LOSS_GOAL, code_pair_spec, train_code_pair  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models/code-pair"),
                        help="output folder (default models/code-pair)")
    # One thread by default: on a shared machine two threads that wait on each other ran 8x slower per step.
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1; 2 on an idle box)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int, default=None, help="override the target's training steps")
    parser.add_argument("--draft-steps", type=int, default=None, help="override the draft's distillation steps")
    parser.add_argument("--force", action="store_true", help="retrain even if the pair exists")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    spec = code_pair_spec(args.seed)
    if args.target_steps is not None:
        spec.target_steps = args.target_steps
    if args.draft_steps is not None:
        spec.draft_steps = args.draft_steps
    info = train_code_pair(args.out, spec, force=args.force)
    if info.get("cached"):
        print(f"{args.out}: code pair already exists (use --force to retrain)")
    loss = info["target_held_out_loss"]
    print(f"{args.out}: target {info['target_params'] / 1e6:.1f}M params, held-out loss {loss:.2f} nats/token "
          f"(goal < {HELD_OUT_LOSS_GOAL}); draft {info['draft_params'] / 1e6:.2f}M params, held-out loss "
          f"{info['draft_held_out_loss']:.2f}; {info['seconds']}s")
    return 0 if loss < HELD_OUT_LOSS_GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
