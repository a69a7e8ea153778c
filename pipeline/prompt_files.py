"""Prompt files: one reader behind `run --prompts-file`, `run --messages`, `bench --prompts` and `profile --prompts`.

Formats (UTF-8; the first that applies wins):

  JSON list   the file starts with ``[``: a list whose items are strings (raw prompts), objects (below), or lists of
              messages (one chat each)
  JSONL       the file name ends in ``.jsonl``, or its first line is a JSON object with "text" or "messages": one
              object (or string, or list of messages) per line; blank lines are skipped
  text        anything else: one prompt per non-empty line, ``\\n`` standing for a newline inside a prompt

An object holds ``"text": "..."`` (a raw prompt) or ``"messages": [{"role": ..., "content": ...}, ...]`` (a chat,
encoded with the tokenizer's chat template by pipeline.chat), an optional ``"set": "label"`` (bench and profile
group results by it; default: the file's stem) and an optional ``"id"`` (ignored). Every error names the file, the
line or item, and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .chat import Message, encode_chat, validate_messages
from .errors import PipelineError, short_repr
from .executor.results import RequestError

OBJECT_KEYS = ("text", "messages", "set", "id")
# The prompt sets shipped with the project, readable by name: categories (SPEED-Bench-style categories of chats),
# tasks (code, JSON, summaries and prose edits), agentic (tool-use transcripts).
SHIPPED_PROMPTS = Path(__file__).resolve().parents[1] / "prompts"
MAX_SET_LABEL = 64


@dataclass(frozen=True)
class PromptItem:
    text: str | None  # a raw prompt, tokenized as is
    messages: list[Message] | None  # a chat, encoded through the chat template; exactly one of text / messages
    set: str  # the label bench and profile group by
    where: str  # "FLAG: FILE line N" (or "item N"): names the item in errors raised after reading

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def _read_text(path: Path, flag: str) -> str:
    where = f"{flag}: {path}"
    if path.is_dir():
        raise PipelineError(f"{where} is a folder; pass a text file with one prompt per line")
    if not path.is_file():
        raise PipelineError(f"{where} not found (or not a regular file); pass a text file with one prompt per line, "
                            f"or the name of a shipped set ({', '.join(shipped_names())})")
    try:
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise PipelineError(f"{where} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except OSError as exc:
        raise PipelineError(f"{where} cannot be read ({exc.strerror})") from None


def _set_label(value: object, where: str) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_SET_LABEL or "\n" in value:
        raise PipelineError(f"{where}: set {short_repr(value, 60)} must be a non-empty one-line string of at most "
                            f"{MAX_SET_LABEL} characters (a label such as \"code\")")
    return value


def _item(value: object, where: str, default_set: str) -> PromptItem:
    """One prompt from a parsed JSON value: a string, a list of messages, or an object with text or messages."""
    if isinstance(value, str):
        if not value.strip():
            raise PipelineError(f"{where}: the prompt is empty; write some text or remove it")
        return PromptItem(value, None, default_set, where)
    if isinstance(value, list):
        return PromptItem(None, validate_messages(value, where), default_set, where)
    if not isinstance(value, dict):
        raise PipelineError(f"{where} is {type(value).__name__}, not a string or an object with \"text\" or "
                            f"\"messages\"; write a prompt as \"text\" or {{\"text\": \"...\"}}")
    unknown = [key for key in value if key not in OBJECT_KEYS]
    if unknown:
        raise PipelineError(f"{where}: unknown key {short_repr(unknown[0], 40)}; a prompt object holds "
                            f"{', '.join(OBJECT_KEYS)} (text or messages required)")
    if ("text" in value) == ("messages" in value):
        raise PipelineError(f"{where}: give exactly one of \"text\" (a raw prompt) or \"messages\" (a chat), "
                            f"not {'both' if 'text' in value else 'neither'}")
    label = _set_label(value["set"], where) if "set" in value else default_set
    if "messages" in value:
        return PromptItem(None, validate_messages(value["messages"], where), label, where)
    text = value["text"]
    if not isinstance(text, str) or not text.strip():
        raise PipelineError(f"{where}: text {short_repr(text, 40)} must be a non-empty string")
    return PromptItem(text, None, label, where)


def _looks_like_jsonl(path: Path, text: str) -> bool:
    if path.suffix.lower() == ".jsonl":
        return True
    first = next((line for line in text.splitlines() if line.strip()), "")
    if not first.lstrip().startswith("{"):
        return False
    try:
        value = json.loads(first)
    except ValueError:
        return False  # a text prompt that happens to start with "{"
    return isinstance(value, dict) and ("text" in value or "messages" in value)


def _json_lines(path: Path, text: str, where: str) -> list[tuple[object, str]]:
    values = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            values.append((json.loads(line), f"{where} line {number}"))
        except ValueError as exc:
            raise PipelineError(f"{where} line {number}: not valid JSON ({exc}); a JSONL prompts file holds one "
                                f"object per line, such as {{\"text\": \"...\", \"set\": \"code\"}}") from None
    return values


def _json_list(text: str, where: str) -> list:
    try:
        values = json.loads(text)
    except ValueError as exc:
        raise PipelineError(f"{where} starts with '[' but is not a valid JSON list ({exc}); write a JSON "
                            f"list of strings, or one prompt per line") from None
    if not isinstance(values, list):
        raise PipelineError(f"{where} starts with '[' but holds a JSON {type(values).__name__}; write a JSON list")
    return values


def shipped_prompts(path: Path) -> Path:
    """``path`` itself, or for a bare name of a set shipped in the project's prompts/ folder (``categories``,
    ``tasks``, ``agentic``) that no file here shadows, the shipped file."""
    path = Path(path)
    shipped = SHIPPED_PROMPTS / f"{path.name}.jsonl"
    if not path.exists() and path.parent == Path(".") and not path.suffix and shipped.is_file():
        return shipped
    return path


def shipped_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED_PROMPTS.glob("*.jsonl"))


def read_prompt_file(path: Path, flag: str = "--prompts", default_set: str | None = None) -> list[PromptItem]:
    """Every prompt in ``path`` (any of the module's formats, or the name of a shipped set: shipped_prompts), in
    file order; ``flag`` names the option in errors, ``default_set`` labels items without "set" (default: the
    file's stem)."""
    path = shipped_prompts(path)
    where = f"{flag}: {path}"
    text = _read_text(path, flag)
    label = default_set or path.stem or "prompts"
    if text.lstrip().startswith("["):
        items = [_item(value, f"{where} item {i}", label) for i, value in enumerate(_json_list(text, where))]
    elif _looks_like_jsonl(path, text):
        items = [_item(value, line_where, label) for value, line_where in _json_lines(path, text, where)]
    else:
        items = [PromptItem(line.replace("\\n", "\n"), None, label, f"{where} line {number}")
                 for number, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not items:
        raise PipelineError(f"{where} holds no prompts; write one prompt per line")
    return items


def read_conversations(path: Path, flag: str = "--messages") -> list[PromptItem]:
    """The chats in ``path``: a JSON list of messages (one conversation), a JSON list of conversations (lists of
    messages or {"messages": [...]} objects), or JSONL with one conversation per line."""
    path = Path(path)
    where = f"{flag}: {path}"
    text = _read_text(path, flag)
    if text.lstrip().startswith("["):
        values = _json_list(text, where)
        if values and all(isinstance(v, dict) and "role" in v for v in values):  # one conversation
            items = [_item(values, where, path.stem)]
        else:
            items = [_item(v, f"{where} item {i}", path.stem) for i, v in enumerate(values)]
    elif text.lstrip().startswith("{") or path.suffix.lower() == ".jsonl":
        try:
            whole = json.loads(text)  # one {"messages": [...]} object, perhaps over several lines
        except ValueError:
            whole = None
        pretty = isinstance(whole, dict) and "\n" in text.strip()
        pairs = [(whole, where)] if pretty else _json_lines(path, text, where)
        items = [_item(value, value_where, path.stem) for value, value_where in pairs]
    else:
        raise PipelineError(f"{where} is not JSON; write a JSON list of messages such as "
                            f"[{{\"role\": \"user\", \"content\": \"Hello\"}}], or JSONL with one "
                            f"{{\"messages\": [...]}} per line")
    if not items:
        raise PipelineError(f"{where} holds no conversations; write a JSON list of messages")
    not_chat = next((item for item in items if not item.is_chat), None)
    if not_chat is not None:
        raise PipelineError(f"{not_chat.where} is raw text, not a chat; {flag} takes messages (pass raw text with "
                            f"--prompt or --prompts-file)")
    return items


def encode_items(items: list[PromptItem], tokenizer, source: str | None = None) -> list[str | list[int]]:
    """What the executor takes: raw text stays a string, a chat becomes token ids through encode_chat. ``source``
    names the model in errors (a chat on a tokenizer without a chat template)."""
    prompts: list[str | list[int]] = []
    for item in items:
        if not item.is_chat:
            prompts.append(item.text)
            continue
        try:
            prompts.append(encode_chat(tokenizer, item.messages, source=source))
        except RequestError as exc:
            raise RequestError(f"{item.where}: {exc}") from None
    return prompts


def group_by_set(items: list[PromptItem]) -> dict[str, list[PromptItem]]:
    """Items by set label, sets in order of first appearance."""
    groups: dict[str, list[PromptItem]] = {}
    for item in items:
        groups.setdefault(item.set, []).append(item)
    return groups
