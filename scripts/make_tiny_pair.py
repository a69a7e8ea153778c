#!/usr/bin/env python3
"""Create the tiny TARGET/DRAFT pair used by configs/tiny.yaml (and by nothing that needs a GPU or a hub).

Usage: python scripts/make_tiny_pair.py [--out models/tiny] [--target-steps N] [--draft-steps N] [--force]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.tinymodels import TinyPairSpec, make_tiny_pair  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models/tiny"), help="output folder (default models/tiny)")
    parser.add_argument("--target-steps", type=int, default=TinyPairSpec.target_steps)
    parser.add_argument("--draft-steps", type=int, default=TinyPairSpec.draft_steps)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="recreate even if the pair exists")
    args = parser.parse_args()
    if (args.out / "pair.json").exists() and not args.force:
        print(f"{args.out}: tiny pair already exists (use --force to recreate)")
        return 0
    spec = TinyPairSpec(target_steps=args.target_steps, draft_steps=args.draft_steps, seed=args.seed)
    info = make_tiny_pair(args.out, spec)
    print(f"{args.out}: target loss {info['target_train_loss']:.2f}, draft distill loss "
          f"{info['draft_distill_loss']:.3f}, {info['seconds']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
