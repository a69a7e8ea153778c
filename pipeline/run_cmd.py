"""`python -m pipeline run CONFIG`: generate from prompts with the built engines; print text and statistics.

Raw prompts (--prompt, --prompts-file) are tokenized as they are and printed with their continuation; chats
(--chat, --messages, with --system) go through the tokenizer's chat template (pipeline.chat), stop at the end of the
assistant's turn, and print the reply alone.
"""

from __future__ import annotations

import json
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
             "top_p": "--top-p", "seed": "--seed", "max_draft_len": "--max-draft-len"}


def proposer_options(config) -> dict:
    """from_engines keywords for the config's drafting method (a method swap rebuilds nothing, so the config's
    current one, not the one recorded at build time)."""
    spec = config.speculative
    return dict(method=spec.method, ngram=spec.ngram.settings())


def load_executor(config, engines_dir: Path):
    """The executor on this config's engines, after checking they were built from this very config."""
    from .executor import SpeculativeExecutor
    from .stages import verify_engines

    verify_engines(config, engines_dir)
    proposer = proposer_options(config)
    if config.backend == "torch":
        device = None if config.runtime.device == "auto" else config.runtime.device
        return SpeculativeExecutor.from_engines(engines_dir / config.name, device=device,
                                                compile=config.runtime.torch_compile, **proposer)
    return SpeculativeExecutor.from_engines(engines_dir / config.name, **proposer)


def cmd_run(args) -> int:
    import sys

    from .config import load_config
    from .executor import GenerationStats

    from .executor.request_values import validate_request

    # The executor's rules, checked before anything loads, named as the flags are spelled.
    validate_request(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, args.max_draft_len,
                     names=CLI_NAMES)
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
                   top_p=args.top_p, seed=args.seed, max_draft_len=args.max_draft_len)
    if args.stream:
        if not items[0].is_chat:
            print(prompts[0], end="", flush=True)
        event = None
        for event in executor.generate_stream(prompts[0], stop_token_ids=turn_end if items[0].is_chat else None,
                                              **options):
            print(event.text, end="", flush=True)
        print()
        if event is not None:
            print(f"[{event.finish_reason}] {event.stats.summary()}")
        return 0
    results = executor.run([executor.new_request(prompt, stop_token_ids=turn_end if item.is_chat else None,
                                                  with_text=False, **options)
                            for item, prompt in zip(items, prompts)])
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
        return 0
    total = GenerationStats()
    for i, (item, result) in enumerate(zip(items, results)):
        if item.is_chat:  # the reply alone: the rendered template is the model's business, not the reader's
            print(f"--- chat {i} ({result.prompt_tokens} prompt tokens) ---")
            print(result.text)
        else:
            print(f"--- prompt {i} ({result.prompt_tokens} tokens) ---")
            print(item.text + result.text)
        print(f"[{result.finish_reason}, {len(result.token_ids)} tokens] {result.stats.summary()}")
        total = total.merge(result.stats)
    print(f"=== total: {total.summary()}", file=sys.stdout)
    return 0
