"""Mutation check of the sampling tests: plant each known sampling bug in a copy of the tree and run the tests.

Each mutant is one exact text substitution in one file. The script copies the project (without .venv, engines,
models, .git) to a temporary folder per mutant, applies the substitution, and runs the given tests there with
that copy's ``pipeline`` first on the import path. A mutant is *killed* when the tests fail, and *survived* when
they pass. The unmutated copy runs first and must pass, or every "killed" would mean nothing.

A substitution that no longer matches exactly once (the code it targets was rewritten) stops the script with an
error naming the mutant: adapt its ``old``/``new`` text here rather than letting a mutant silently vanish.

    .venv/bin/python scripts/mutants.py                      # all mutants, the default tests
    .venv/bin/python scripts/mutants.py --only shared_uniform -- tests/speculative/test_accept.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TESTS = ["tests/e2e/test_sampling_distribution.py", "tests/speculative/test_accept.py",
                 "tests/executor/test_batching_engine.py::test_seeded_sampling_does_not_depend_on_neighbours",
                 "tests/speculative/test_tree.py", "tests/executor/test_medusa_proposer.py",
                 "tests/executor/test_block_pool.py", "tests/executor/test_model_runner.py",
                 "tests/executor/test_batching_engine.py::test_chunked_prefill_and_prefix_reuse_change_no_result",
                 "tests/executor/test_suffix_proposer.py",
                 "tests/executor/test_proposers.py::test_sampled_output_follows_the_target_distribution",
                 "tests/executor/test_eagle3_proposer.py", "tests/executor/test_row_logits.py",
                 "tests/speculative/test_penalties.py"]
SKIP = shutil.ignore_patterns(".venv", "engines", "models", ".git", "__pycache__", "*.egg-info", ".pytest_cache",
                              ".hypothesis", "build")

ENGINE = "pipeline/executor/batching_engine.py"
DRAFT = "pipeline/executor/proposers/draft_model.py"
ACCEPT = "pipeline/speculative/accept.py"
TREE = "pipeline/speculative/tree.py"
CACHE = "pipeline/executor/paged_kv_cache.py"
POOL = "pipeline/executor/block_pool.py"
SUFFIX = "pipeline/executor/proposers/suffix.py"
EAGLE3 = "pipeline/executor/proposers/eagle3.py"
EAGLE3_TRAIN = "pipeline/distill/train_eagle3.py"
ROW_LOGITS = "pipeline/executor/row_logits.py"
PENALTIES = "pipeline/speculative/penalties.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # file to edit, relative to the repository root
    old: str  # exact text, must occur exactly once
    new: str
    bug: str  # what the substitution does, in words


MUTANTS = [
    Mutant("temperature_draft_only", ENGINE,
           "[logits_to_probs(judged[i], batch.requests[row].params) for i, row in enumerate(chosen)]",
           "[logits_to_probs(judged[i], type(batch.requests[row].params)(1.0, batch.requests[row].params.top_k, "
           "batch.requests[row].params.top_p)) for i, row in enumerate(chosen)]",
           "temperature applied to the draft's distribution only (the target's stays at 1)"),
    Mutant("temperature_target_only", DRAFT,
           "row_probs = logits_to_probs(row_logits, request.params)  # [1, V]",
           "row_probs = logits_to_probs(row_logits, type(request.params)(1.0, request.params.top_k, "
           "request.params.top_p))  # [1, V]",
           "temperature applied to the target's distribution only (the draft samples at 1)"),
    Mutant("draft_probs_shifted", DRAFT,
           "batch.put(row, tokens[row], torch.cat(probs[row]) if probs[row] else None, self.method)",
           "batch.put(row, tokens[row], torch.cat(probs[row][1:] + probs[row][:1]) if probs[row] else None, "
           "self.method)",
           "draft position i is judged with the draft distribution of position i+1 (invisible when K = 1)"),
    Mutant("greedy_accept_argmax", ENGINE,
           "flat = sample_inverse_cdf(target_probs.flatten(0, 1), uniforms.flatten())  # [s * (K+1)]",
           "flat = target_probs.flatten(0, 1).argmax(-1)  # [s * (K+1)]",
           "'greedy' acceptance under sampling compares draft tokens with the target's argmax, not its sample"),
    Mutant("row_draws_shared", ENGINE,
           "uniforms[i, :drawn] = torch.rand(drawn, generator=request.generator,",
           "uniforms[i, :drawn] = torch.rand(drawn, generator=batch.requests[chosen[0]].generator,",
           "every sampled row draws from the first sampled row's generator (results depend on the batch)"),
    Mutant("bonus_from_draft", ACCEPT,
           "target_at = target_probs[rows, num_accepted]  # [B, V]",
           "target_at = torch.cat([target_probs[:, :k], draft_probs[:, -1:]], 1)[rows, num_accepted]  # [B, V]",
           "after all K are accepted, the bonus token is drawn from the draft's last distribution"),
    Mutant("residual_from_target", ACCEPT,
           "residual = (target_at - draft_at).clamp_min(0)  # [B, V]",
           "residual = target_at.clamp_min(0)  # [B, V]",
           "the recovered token is drawn from the target instead of normalize(max(0, target - draft))"),
    Mutant("shared_uniform", ACCEPT,
           "keep = drafted & (draft_p > 0) & (uniforms[:, :k] * draft_p < target_p)  # [B, K]",
           "keep = drafted & (draft_p > 0) & (uniforms[:, :1] * draft_p < target_p)  # [B, K]",
           "one uniform shared by all K positions of a sequence"),
    Mutant("extra_reuses_judging_draw", ACCEPT,
           "extra = sample_inverse_cdf(final, uniforms[rows, num_draft])  # [B]",
           "extra = sample_inverse_cdf(final, uniforms[rows, num_accepted])  # [B]",
           "the recovered token reuses the uniform that rejected the draft token (correlated, biased)"),
    Mutant("padding_judged_as_draft", ACCEPT,
           "keep = drafted & (draft_p > 0) & (uniforms[:, :k] * draft_p < target_p)  # [B, K]",
           "keep = (draft_p > 0) & (uniforms[:, :k] * draft_p < target_p)  # [B, K]",
           "positions past a row's own draft tokens (padding) are judged as if drafted"),
    Mutant("accepted_len_plus_one", ACCEPT,
           "num_accepted = _prefix_length(keep)  # [B]",
           "num_accepted = (_prefix_length(keep) + 1).clamp(max=k)  # [B]",
           "the accepted length counts the first rejected draft token as accepted"),
    Mutant("accepted_len_minus_one", ACCEPT,
           "num_accepted = _prefix_length(keep)  # [B]",
           "num_accepted = (_prefix_length(keep) - 1).clamp(min=0)  # [B]",
           "the accepted length drops the last accepted draft token"),
    Mutant("tree_sibling_not_renormalised", TREE,
           "keep = bool(uniforms[b, used] * total < residual[x])",
           "keep = bool(uniforms[b, used] < residual[x])",
           "a tree candidate is kept with probability r(x), not r(x) / sum(r) after its siblings' rejections"),
    Mutant("tree_rejected_sibling_kept", TREE,
           "                residual[x] = 0.0\n",
           "                pass\n",
           "a rejected sibling's token stays in the residual the next sibling and the final draw use"),
    Mutant("tree_greedy_own_argmax", TREE,
           "ok[:, node] = ok[:, p] & (tokens[:, node] == target_argmax[:, p])",
           "ok[:, node] = ok[:, p] & (tokens[:, node] == target_argmax[:, node])",
           "a tree node is compared with the target's argmax after itself instead of after its parent"),
    Mutant("tree_kv_from_first_branch", CACHE,
           "src = self._slots(seq, [root + node for node in nodes])",
           "src = self._slots(seq, [root + 1 + i for i in range(len(nodes))])",
           "an accepted path keeps the KV of the first candidates after the root, whichever branch was accepted"),
    Mutant("tree_depth_position_off_by_one", CACHE,
           "positions[node:node + tree.size] = start + root + tree.depth",
           "positions[node:node + tree.size] = start + root + tree.depth + 1",
           "tree nodes sit one position past root + depth"),
    Mutant("paged_causal_off_by_one", CACHE,
           "allowed = keys[None, None, :] <= (starts_m[:, None] + last)[:, :, None]  # [n, W, L]",
           "allowed = keys[None, None, :] < (starts_m[:, None] + last)[:, :, None]  # [n, W, L]",
           "a token does not attend to its own key (the causal mask shifted by one)"),
    Mutant("paged_sees_past_its_row", CACHE,
           "allowed = keys[None, None, :] <= (starts_m[:, None] + last)[:, :, None]  # [n, W, L]",
           "allowed = keys[None, None, :] <= (starts_m[:, None] + last + 1)[:, :, None]  # [n, W, L]",
           "a token also sees the next position (a draft token sees the one after it)"),
    Mutant("prefix_reuse_includes_last_token", POOL,
           "usable = (len(prompt) - 1) // self.block_size  # whole blocks strictly before the last token",
           "usable = len(prompt) // self.block_size",
           "a prompt that is exactly cached blocks reuses them all, so its last token is never computed"),
    Mutant("prefix_hash_ignores_parent", POOL,
           "parent = digest(parent, tokens[start:start + block_size])",
           "parent = digest(ROOT, tokens[start:start + block_size])",
           "a block is reused whenever its own tokens match, whatever came before it"),
    Mutant("commit_uncommitted_tokens", CACHE,
           "self.pool.commit(seq, tokens[:self.lengths[seq]])",
           "self.pool.commit(seq, tokens + [0] * self.pool.block_size)",
           "blocks holding draft or future positions are hashed as if final"),
    Mutant("chunk_feeds_the_last_prompt_token", ENGINE,
           "chunk = request.sequence[have:min(have + left, len(request.sequence) - 1)]",
           "chunk = request.sequence[have:min(have + left, len(request.sequence))]",
           "a prompt chunk also feeds the last prompt token, which the first step feeds again"),
    Mutant("medusa_hidden_at_root", ENGINE,
           "last_position[row] = int(batch.first_logit[row]) + (path[-1] if path else accepted)",
           "last_position[row] = int(batch.first_logit[row]) + accepted",
           "the heads read the hidden state at the accepted depth's offset, not at the accepted node"),
    Mutant("suffix_probs_shifted", SUFFIX,
           "one_hot_probs(tokens, self.vocab_size, self.device)",
           "one_hot_probs([(t + 1) % self.vocab_size for t in tokens], self.vocab_size, self.device)",
           "a suffix draft's distribution names the next id, not the drafted token"),
    Mutant("suffix_seeded_reads_past_outputs", SUFFIX,
           "return request.seeded and not request.params.greedy",
           "return False",
           "seeded sampled requests draft from other requests' outputs (their tokens then depend on them)"),
    Mutant("suffix_salt_ignored", SUFFIX,
           "cache = self._own_trees() if _reproducible(request) else self._cache(request.cache_salt)",
           "cache = self._own_trees() if _reproducible(request) else self._cache(None)",
           "past outputs shared across cache salts"),
    Mutant("eagle3_samples_another_distribution", EAGLE3,
           "return int(sample(dist, request.generator)), dist",
           "return int(sample(torch.softmax(full[None, :self.vocab_size].float() * 0.3, -1), request.generator)), dist",
           "an EAGLE-3 draft sampled from one distribution and reported as drawn from another"),
    Mutant("eagle3_prefix_kv_not_reused", EAGLE3,
           "                self._reuse(row)",
           "                pass",
           "the heads' KV of a prompt prefix the target reused is not taken back (drafts then change)"),
    Mutant("eagle3_training_token_shifted", EAGLE3_TRAIN,
           "tokens[:, :max(length - j, 0)] = input_ids[:, 1 + j:]",
           "tokens[:, :max(length - j - 1, 0)] = input_ids[:, 2 + j:]",
           "training-time test feeds each draft step the token after the one it drafts from"),
    Mutant("eagle3_chain_position_stale", EAGLE3,
           "at = row.length - 1 + step",
           "at = row.length - 1",
           "every chained EAGLE-3 step drafts at the last pair's RoPE position"),
    Mutant("penalty_state_not_advanced", ROW_LOGITS,
           "[proposal[:j] for j in range(len(proposal) + 1)]",
           "[[] for j in range(len(proposal) + 1)]",
           "every verified position penalized with the state before the step (the draft tokens not counted)"),
    Mutant("penalty_state_one_ahead", ROW_LOGITS,
           "[proposal[:j] for j in range(len(proposal) + 1)]",
           "[proposal[:j + 1] for j in range(len(proposal) + 1)]",
           "position j penalized as if draft token j had already been generated"),
    Mutant("min_tokens_off_by_one", PENALTIES,
           "early = (lengths < adjust.min_tokens)[:, None]",
           "early = (lengths <= adjust.min_tokens)[:, None]",
           "stop tokens held back one token longer than min_tokens"),
    Mutant("draft_unadjusted", DRAFT,
           "if adjusts(request) else None",
           "if False else None",
           "the draft model proposes from unpenalized logits (lossless, but a self-draft is no longer always right)"),
    Mutant("logprobs_shifted", ROW_LOGITS,
           "return [first + j for j in range(accepted + 1)]",
           "return [first + j + 1 for j in range(accepted + 1)]",
           "each emitted token's log-probability read at the position after the one that judged it"),
]


def copy_tree(dest: Path) -> Path:
    shutil.copytree(REPO, dest, ignore=SKIP)
    return dest


def apply(mutant: Mutant, root: Path) -> None:
    path = root / mutant.path
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise SystemExit(f"mutant {mutant.name}: its text occurs {count} times in {mutant.path} (expected once); "
                         f"the code changed: adapt the mutant's old/new text in scripts/mutants.py\n"
                         f"  old: {mutant.old!r}")
    path.write_text(text.replace(mutant.old, mutant.new))


def run_tests(root: Path, tests: list[str], timeout: int, first_failure: bool = False) -> tuple[int, float, str]:
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # The venv may hold this project installed editable: make sure the copy's package is the one imported.
    where = subprocess.run([sys.executable, "-c", "import pipeline; print(pipeline.__file__)"], cwd=root, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(root.resolve()):
        raise SystemExit(f"{root}: imports pipeline from {where}, not from the copy; check PYTHONPATH")
    start = time.perf_counter()
    stop = ["-x"] if first_failure else []
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *stop, *tests], cwd=root,
                          env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, time.perf_counter() - start, proc.stdout + proc.stderr


def run_all(chosen: list[Mutant], work: Path, args) -> list[tuple[Mutant, str]]:
    # Check every substitution before spending minutes on tests: a stale pattern fails in seconds.
    for mutant in chosen:
        apply(mutant, copy_tree(work / mutant.name))
    rc, seconds, out = run_tests(copy_tree(work / "unmutated"), args.tests, args.timeout)
    if rc != 0:
        print(out[-4000:])
        raise SystemExit(f"the unmutated tree fails {args.tests} (exit {rc}): fix that first")
    print(f"{'unmutated':26} passes    {seconds:6.1f} s")

    rows = []
    for mutant in chosen:
        rc, seconds, out = run_tests(work / mutant.name, args.tests, args.timeout, args.first_failure)
        # pytest: 1 = tests failed; anything else (2 interrupted, 3 internal, 4 usage, 5 none) is not a verdict.
        verdict = {0: "SURVIVED", 1: "killed"}.get(rc, f"error {rc}")
        failed = [line.split(" - ")[0].removeprefix("FAILED ").split("::", 1)[-1] for line in out.splitlines()
                  if line.startswith("FAILED ")]
        rows.append((mutant, verdict))
        print(f"{mutant.name:26} {verdict:9} {seconds:6.1f} s  {len(failed):2} failed: {' '.join(failed)}",
              flush=True)
        if verdict.startswith("error"):
            print(out[-3000:])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", help="run only this mutant (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per test run")
    parser.add_argument("--keep", action="store_true", help="keep the mutated copies (paths are printed)")
    parser.add_argument("-x", "--first-failure", action="store_true",
                        help="stop each mutant's run at its first failing test (faster; lists one killer)")
    parser.add_argument("tests", nargs="*", default=DEFAULT_TESTS, help="test files/ids, relative to the repo")
    args = parser.parse_args(argv)
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:26} {m.path}: {m.bug}")
        return 0
    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        raise SystemExit(f"--only: unknown mutant(s) {sorted(unknown)}; see --list")
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]

    work = Path(tempfile.mkdtemp(prefix="mutants-"))
    try:
        rows = run_all(chosen, work, args)
    finally:
        if args.keep:
            print(f"copies kept in {work}")
        else:
            shutil.rmtree(work)
    bad = [m.name for m, verdict in rows if verdict != "killed"]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} mutants killed" + (f"; not killed: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
