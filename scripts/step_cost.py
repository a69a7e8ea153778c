"""What one engine forward of W tokens costs, on the lean decoder and through the Hugging Face modules: the
verify-cost curve of a model on this machine (a verify of K draft tokens is a forward of K + 1).

    python scripts/step_cost.py MODEL_FOLDER [--dtype float32] [--int8] [--widths 1 2 3 4 5 8] [--threads 2]
                                [--compile [max-autotune]] [--context N] [--sdpa-twins] [--linear-twins]
                                [--torch-ops-twins] [--json FILE]

With --compile, the lean decoder compiled per width bucket is a third runner (its warm-up time is printed). With
--sdpa-twins each lean runner is timed twice, with the attention kernels measured per width (attention_choice) and
with SDPA at every width; with --linear-twins the eager lean runner is timed again with F.linear at every width in
place of the products measured per width (matmul_choice); with --torch-ops-twins it is timed again with RMSNorm,
RoPE and SiLU * up as torch operators in place of the row kernels' C++ operators (row_kernels). The runners hold
the same model (the lean one's fused matrices are the weights the modules read) and the same --context tokens of
KV; each forward of W tokens is rolled back, so every width is timed at the same length. Best of --rounds rounds,
the runners and widths interleaved in each (the machine is shared). Prints the CPU model, the lean decoder's
measured product and attention kernel per width, and a table: ms per forward and its ratio to a 1-token forward.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.draft_cost import cpu_model  # noqa: E402

SEQ = "seq"


def open_runners(model, context: int, compile: bool | str = False, max_width: int = 8,
                 sdpa_twins: bool = False, linear_twins: bool = False, torch_ops_twins: bool = False) -> dict:
    """The modules and the lean decoder, and with ``compile`` the lean decoder compiled per width bucket up to
    ``max_width`` (its warm-up is done here). ``sdpa_twins``: each lean runner also as a twin whose attention is
    SDPA at every width (what the measured attention kernels are compared with); ``linear_twins``: the eager lean
    runner also as a twin whose products are F.linear at every width."""
    from pipeline.executor.attention_choice import AttentionPlan
    from pipeline.executor.matmul_choice import KernelPlan
    from pipeline.executor.model_runner import BatchModelRunner

    vocab = model.get_output_embeddings().weight.shape[0]
    prompt = [(7 * i + 3) % vocab for i in range(context)]
    kinds = [("hf-modules", {"lean": False}), ("lean", {})]
    if compile:
        kinds.append(("compiled", {"compile": True, "max_width": max_width, "autotune": compile == "max-autotune"}))
    if sdpa_twins:
        kinds += [(f"{name}-sdpa", options) for name, options in kinds[1:]]
    if linear_twins:
        kinds.append(("lean-linear", {}))
    if torch_ops_twins:
        kinds.append(("lean-torch-ops", {}))
    runners = {}
    for name, options in kinds:
        runner = BatchModelRunner(model, "cpu", max_tokens=context + 64, block_size=16,
                                  max_blocks=-(-context // 16) + 8, **options)
        if name.endswith("-sdpa"):
            runner.cache.attention = AttentionPlan()
        if name == "lean-linear" and runner._decoder is not None:
            runner._decoder.kernels = KernelPlan()
        if name == "lean-torch-ops" and runner._decoder is not None:
            runner._decoder.layer_ops = False
        runner.open(SEQ, prompt)
        runner.forward([SEQ], [prompt], logits_for=[1])
        runners[name] = runner
    return runners


def time_widths(runners: dict, widths: list[int], context: int, rounds: int) -> dict:
    best = {(name, w): float("inf") for name in runners for w in widths}
    for _ in range(rounds):
        for width in widths:
            for name, runner in runners.items():
                start = time.perf_counter()
                runner.forward([SEQ], [[5] * width])
                best[name, width] = min(best[name, width], (time.perf_counter() - start) * 1e3)
                runner.truncate(SEQ, context)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a Hugging Face model folder")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8])
    parser.add_argument("--int8", action="store_true",
                        help="int8 weight-only layers (as build.quantization.mode int8_weight_only loads them)")
    parser.add_argument("--context", type=int, default=100, help="tokens of KV each forward attends over")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--compile", nargs="?", const=True, default=False, choices=["max-autotune"],
                        help="also time the lean decoder compiled per width bucket (as runtime.torch_compile; "
                             "'max-autotune' times candidate kernels too: minutes)")
    parser.add_argument("--sdpa-twins", action="store_true",
                        help="also time each lean runner with SDPA at every width in place of the measured "
                             "attention kernels")
    parser.add_argument("--linear-twins", action="store_true",
                        help="also time the eager lean runner with F.linear at every width in place of the measured "
                             "products")
    parser.add_argument("--torch-ops-twins", action="store_true",
                        help="also time the eager lean runner with RMSNorm, RoPE and SiLU * up as torch operators in "
                             "place of the row kernels' C++ operators")
    parser.add_argument("--json", type=Path, default=None, help="write the table here too")
    args = parser.parse_args(argv)
    if any(w < 1 for w in args.widths) or args.rounds < 1 or args.context < 1:
        parser.error("--widths, --rounds and --context take positive integers")
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    if args.int8:
        from pipeline.quantize import quantize_model

        quantize_model(model, "int8_weight_only")
    runners = open_runners(model, args.context, args.compile, max(args.widths), args.sdpa_twins,
                           args.linear_twins, args.torch_ops_twins)
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, {args.dtype}"
          + (" int8 weights" if args.int8 else ""))
    lean = runners["lean"]
    default = "the int8 kernel" if args.int8 else "F.linear"
    print(f"lean decoder: {lean.runner}" + (f" ({lean.why_modules})" if lean.why_modules else
                                            f"; product by width: {lean.kernels.to_dict()['by_width'] or default}"))
    print(f"attention kernel by width: {lean.cache.attention.to_dict()['by_width'] or 'SDPA'}")
    if lean.runner == "lean":
        ops = "the row kernels' C++ operators" if lean._decoder.layer_ops else "torch"
        print(f"per-token operations: {ops}")
    if "compiled" in runners:
        compiled = runners["compiled"].compiled
        print(f"compiled: buckets {compiled.sizes}, warm-up {compiled.warm_up_s:.1f} s ({compiled.built} graphs "
              f"compiled, the rest loaded), ms per bucket {compiled.bucket_ms}, route {compiled.route}" if compiled else
              "compiled: the modules, with dynamic shapes")
    best = time_widths(runners, args.widths, args.context, args.rounds)
    rows = [{"runner": name, "width": w, "ms": round(best[name, w], 2),
             "vs_one_token": round(best[name, w] / best[name, args.widths[0]], 3)}
            for name in runners for w in args.widths]
    print(f"{'runner':<14} " + " ".join(f"{'W=' + str(w):>14}" for w in args.widths))
    for name in runners:
        print(f"{name:<14} " + " ".join(f"{best[name, w]:7.1f} ({best[name, w] / best[name, args.widths[0]]:.2f})"
                                        for w in args.widths))
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_model(), "threads": torch.get_num_threads(), "dtype": args.dtype,
                                         "int8": args.int8, "attention": lean.cache.attention.to_dict(),
                                         "kernels": lean.kernels.to_dict() if lean.kernels else None, "rows": rows},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
