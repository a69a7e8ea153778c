"""`python -m pipeline run CONFIG`: generate from prompts with the built engines; print text and statistics.

Raw prompts (--prompt, --prompts-file) are tokenized as they are and printed with their continuation; chats
(--chat, --messages, with --system) go through the tokenizer's chat template (pipeline.chat), stop at the end of the
assistant's turn, and print the reply alone. Every prompt runs in one batch; each one's speed is printed (and in
--json: ttft_ms, seconds, tokens_per_s): its tokens over the time to its last token, and its time to first token,
both from the start of the batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import PipelineError

if TYPE_CHECKING:
    from .prompt_files import PromptItem


def add_run_parser(sub, common) -> None:
    p = sub.add_parser("run", help="generate from prompts with the built engines; prints text and acceptance")
    common(p)
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompts-file", type=Path,
                   help="prompts file: one per line (\\n for newlines), a JSON list, or JSONL with text or messages")
    p.add_argument("--chat", action="append", default=[], metavar="TEXT",
                   help="a user message, sent through the tokenizer's chat template (repeatable: one chat each)")
    p.add_argument("--messages", type=Path, metavar="FILE",
                   help='chat file: a JSON list of {"role", "content"} messages (one conversation), or a JSON list '
                        'or JSONL of conversations')
    p.add_argument("--system", metavar="TEXT", help="system message for --chat / --messages conversations without one")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-draft-len", type=int, default=None, help="K for this run (0 = target only)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are accepted (first prompt)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    controls = p.add_argument_group("output controls (as the OpenAI endpoint's; speculation stays on)")
    controls.add_argument("--presence-penalty", type=float, default=0.0)
    controls.add_argument("--frequency-penalty", type=float, default=0.0)
    controls.add_argument("--repetition-penalty", type=float, default=1.0)
    controls.add_argument("--min-tokens", type=int, default=0)
    controls.add_argument("--logprobs", type=int, default=None, metavar="N",
                          help="each token's log-probability and its N likeliest alternatives (with --json)")
    controls.add_argument("--response-format", metavar="JSON|@FILE",
                          help='OpenAI\'s response_format, e.g. \'{"type": "json_object"}\' or @schema-format.json')
    p.set_defaults(func=cmd_run)


def read_prompts(prompts: list[str], prompts_file: Path | None) -> list[PromptItem]:
    """--prompt values, then the items of --prompts-file (text lines, a JSON list, or JSONL; see prompt_files)."""
    from .prompt_files import PromptItem, read_prompt_file

    found = [PromptItem(text, None, "prompt", f"--prompt {i}") for i, text in enumerate(prompts)]
    if prompts_file is not None:
        found += read_prompt_file(prompts_file, flag="--prompts-file")
    return found


def read_chats(chats: list[str], messages_file: Path | None, system: str | None) -> list[PromptItem]:
    """One conversation per --chat (a single user turn), then those of --messages; ``system`` is prepended to each
    conversation that has no system message of its own."""
    from .chat import validate_messages
    from .prompt_files import PromptItem, read_conversations

    found = [PromptItem(None, validate_messages([{"role": "user", "content": text}], f"--chat {i}"), "chat",
                        f"--chat {i}") for i, text in enumerate(chats)]
    if messages_file is not None:
        found += read_conversations(messages_file, flag="--messages")
    if system is None:
        return found
    turn = {"role": "system", "content": system}
    return [item if item.messages[0]["role"] == "system" else
            PromptItem(None, [turn, *item.messages], item.set, item.where) for item in found]


CLI_NAMES = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
             "top_p": "--top-p", "seed": "--seed", "max_draft_len": "--max-draft-len",
             "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
             "repetition_penalty": "--repetition-penalty", "min_tokens": "--min-tokens", "logprobs": "--logprobs"}


def read_controls(args) -> dict:
    """The output-control flags as generate()'s keywords, checked (named as the flags are spelled); the response
    format parsed from its JSON text or @file and checked to compile."""
    from .executor.request_values import validate_controls
    from .speculative.grammar import grammar_from_response_format

    controls = dict(presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                    repetition_penalty=args.repetition_penalty, min_tokens=args.min_tokens, logprobs=args.logprobs)
    validate_controls(**controls, names=CLI_NAMES)
    if args.response_format is not None:
        text = args.response_format
        if text.startswith("@"):
            try:
                text = Path(text[1:]).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise PipelineError(f"--response-format: cannot read {text[1:]} ({exc})") from None
        try:
            controls["response_format"] = json.loads(text)
        except ValueError as exc:
            raise PipelineError(f"--response-format: not valid JSON ({exc}); pass e.g. "
                                f"'{{\"type\": \"json_object\"}}' or @FILE") from None
        grammar_from_response_format(controls["response_format"])  # a RequestError naming the field, before loading
    return controls


def load_executor(config, engines_dir: Path):
    """The executor on this config's engines, after checking they were built from this very config."""
    from .executor import open_executor

    return open_executor(engines_dir / config.name, config)


@dataclass
class RunTiming:
    """When one request's tokens arrived, in seconds from the start of the call that ran it."""

    first_s: float | None = None  # its first token: the time to first token (TTFT)
    last_s: float = 0.0  # its last token
    tokens: int = 0

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.last_s if self.tokens and self.last_s > 0 else None

    def arrived(self, count: int, now: float) -> None:
        if count > 0:
            self.first_s = now if self.first_s is None else self.first_s
            self.last_s, self.tokens = now, self.tokens + count

    def to_dict(self) -> dict:
        """The fields `run --json` adds to each result."""
        rate = self.tokens_per_s
        return {"ttft_ms": None if self.first_s is None else round(self.first_s * 1000, 1),
                "seconds": round(self.last_s, 4), "tokens_per_s": None if rate is None else round(rate, 2)}

    def summary(self) -> str:
        rate, first = self.tokens_per_s, self.first_s
        return (f"{'-' if rate is None else f'{rate:.1f}'} tok/s, TTFT "
                f"{'-' if first is None else f'{first * 1000:.0f} ms'}")


def timed_run(executor, requests: list) -> tuple[list, list[RunTiming], float]:
    """``executor.run(requests)`` (one batch) with a clock on every step: the results, each request's timing, and
    the batch's wall seconds. run() is this same loop over the executor's per-step events, without the clock."""
    import time

    start = time.perf_counter()
    timings = {id(request): RunTiming() for request in requests}
    for request, event in executor._events(requests):
        timings[id(request)].arrived(len(event.token_ids), time.perf_counter() - start)
    wall = time.perf_counter() - start
    return [request.result(executor.decode) for request in requests], [timings[id(r)] for r in requests], wall


def cmd_run(args) -> int:
    from .config import load_config
    from .executor.request_values import validate_request

    # The executor's rules, checked before anything loads, named as the flags are spelled.
    validate_request(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, args.max_draft_len,
                     names=CLI_NAMES)
    controls = read_controls(args)
    config = load_config(args.config)
    chats = read_chats(args.chat, args.messages, args.system)
    if args.system is not None and not chats:
        raise PipelineError("--system: applies to chats; pass --chat TEXT or --messages FILE with it")
    items = read_prompts(args.prompt, args.prompts_file) + chats
    if not items:
        raise PipelineError("run: no prompts; pass --prompt TEXT, --prompts-file FILE, --chat TEXT or --messages FILE")
    executor = load_executor(config, args.engines_dir)
    from .chat import end_of_turn_ids
    from .prompt_files import encode_items

    prompts = encode_items(items, executor.tokenizer, source=config.target.model)
    # A chat ends at its turn's end even where the generation config lists only the document EOS.
    turn_end = end_of_turn_ids(executor.tokenizer) if chats else []
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, max_draft_len=args.max_draft_len, **controls)
    if args.stream:
        return _stream(executor, items[0], prompts[0], turn_end if items[0].is_chat else None, options)
    results, timings, wall = timed_run(executor, [
        executor.new_request(prompt, stop_token_ids=turn_end if item.is_chat else None, with_text=False, **options)
        for item, prompt in zip(items, prompts)])
    if args.json:
        print(json.dumps([{**r.to_dict(), **t.to_dict()} for r, t in zip(results, timings)], indent=2))
        return 0
    _print_results(items, results, timings, wall)
    return 0


def _stream(executor, item, prompt, stop_token_ids, options: dict) -> int:
    """Print the first prompt's tokens as each step accepts them, then its statistics and speed."""
    import time

    if not item.is_chat:
        print(prompt, end="", flush=True)
    event, timing, start = None, RunTiming(), time.perf_counter()
    for event in executor.generate_stream(prompt, stop_token_ids=stop_token_ids, **options):
        timing.arrived(len(event.token_ids), time.perf_counter() - start)
        print(event.text, end="", flush=True)
    print()
    if event is not None:
        print(f"[{event.finish_reason}, {timing.tokens} tokens, {timing.summary()}] {event.stats.summary()}")
    return 0


def _print_results(items: list[PromptItem], results: list, timings: list[RunTiming], wall: float) -> None:
    """Each prompt's text (a chat's reply alone), statistics and speed, then the batch's totals."""
    import statistics

    from .executor import GenerationStats

    total = GenerationStats()
    for i, (item, result, timing) in enumerate(zip(items, results, timings)):
        if item.is_chat:  # the reply alone: the rendered template is the model's business, not the reader's
            print(f"--- chat {i} ({result.prompt_tokens} prompt tokens) ---")
            print(result.text)
        else:
            print(f"--- prompt {i} ({result.prompt_tokens} tokens) ---")
            print(item.text + result.text)
        print(f"[{result.finish_reason}, {len(result.token_ids)} tokens, {timing.summary()}] "
              f"{result.stats.summary()}")
        total = total.merge(result.stats)
    tokens = sum(t.tokens for t in timings)
    firsts = [t.first_s for t in timings if t.first_s is not None]
    speed = f"{tokens} tokens in {wall:.2f} s, {tokens / wall:.1f} tok/s" if wall > 0 else f"{tokens} tokens"
    ttft = f", TTFT median {statistics.median(firsts) * 1000:.0f} ms" if firsts else ""
    batch = f" ({len(items)} prompts in one batch)" if len(items) > 1 else ""
    print(f"=== total: {speed}{batch}{ttft}; {total.summary()}")
