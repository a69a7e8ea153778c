"""Chat prompts: a list of ``{"role", "content"}`` messages -> token ids through the tokenizer's own chat template.

Security: a message is user input, and a user who can get a control token such as ``<|im_end|>`` or
``<|im_start|>system`` tokenized as that token can close their turn and write another role's (a forged system
prompt). So a message's text is always tokenized as plain text: ``apply_chat_template(...,
sanitize_control_tokens=True)`` (transformers 5.24, the pinned release) marks every control token inside the
messages before rendering and encodes the marked ones as ordinary text, while the control tokens the template writes
itself stay tokens. Because marking happens on the messages, not on the rendered text, templates that trim or
otherwise transform the content stay safe, and content without control-token text (nearly all of it) is encoded
exactly as ``apply_chat_template(..., tokenize=True)`` encodes it. Two checks of our own stand beside that:

- roles come from a fixed list, since some templates build control tokens from the role (``'<|' + role + '|>'``),
  which the library's marking cannot see, and messages carry no other keys a template might render unmarked;
- the special tokens of the result are counted against the same conversation with every content replaced by a
  neutral word: one more means a content slipped through as a control token, and the request is refused.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from .errors import short_repr
from .executor.results import RequestError

Message = dict[str, str]
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
NEUTRAL_CONTENT = "x"  # stands in for every content when the template's own special tokens are counted


def validate_messages(messages: object, where: str = "messages") -> list[Message]:
    """A checked copy of ``messages``: a non-empty list of ``{"role": ROLE, "content": TEXT}`` dicts.

    ``where`` names the source in errors (an input name, a file and line); raises RequestError naming the message
    index, the bad value and the fix.
    """
    example = '[{"role": "user", "content": "Hello"}]'
    if not isinstance(messages, (list, tuple)):
        raise RequestError(f"{where}: expected a JSON list of messages such as {example}, got "
                           f"{type(messages).__name__} {short_repr(messages, 60)}")
    if not messages:
        raise RequestError(f"{where}: the message list is empty; send at least one message such as {example}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"{where}: message {i} is {type(message).__name__} {short_repr(message, 60)}, not "
                               f"an object; write each message as {{\"role\": \"user\", \"content\": \"...\"}}")
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise RequestError(f"{where}: message {i} has key {short_repr(extra[0], 40)}; a message holds only "
                               f"\"role\" and \"content\" (templates would render other keys unchecked)")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise RequestError(f"{where}: message {i} role {short_repr(role, 40)} is not one of "
                               f"{', '.join(ROLES)}; use one of them")
        if not isinstance(content, str):
            got = "missing" if "content" not in message else f"{type(content).__name__} {short_repr(content, 40)}"
            raise RequestError(f"{where}: message {i} content is {got}; it must be a string (the message text)")
        checked.append({"role": role, "content": content})
    return checked


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _source(tokenizer, source: str | None) -> str:
    return source or getattr(tokenizer, "name_or_path", "") or "this model"


def require_chat_template(tokenizer, source: str | None = None) -> None:
    """Raise RequestError naming the fix when the tokenizer has no chat template."""
    if tokenizer is None:
        raise RequestError(f"messages: {_source(tokenizer, source)} has no tokenizer, so a chat cannot be encoded; "
                           f"send token ids instead")
    if not has_chat_template(tokenizer):
        raise RequestError(f"messages: the tokenizer in {_source(tokenizer, source)} has no chat template; use "
                           f"--prompt (or text_input) with raw text, or pick an instruct model whose "
                           f"tokenizer_config.json (or chat_template.jinja) has chat_template")


def _render_ids(tokenizer, messages: list[Message], add_generation_prompt: bool, source: str | None) -> list[int]:
    from jinja2 import TemplateError

    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            return_dict=False, sanitize_control_tokens=True)
    except TemplateError as exc:  # the template's own raise_exception: roles out of order, a role it lacks, ...
        raise RequestError(f"messages: the chat template of {_source(tokenizer, source)} refused this conversation "
                           f"({exc}); change the messages as it says") from None
    except ValueError as exc:  # "Can't sanitize ...": the tokenizer makes a control token from plain text
        raise RequestError(f"messages: {exc}; remove that text from the message") from None
    return [int(t) for t in out]


def _special_ids(tokenizer) -> frozenset[int]:
    found = set(tokenizer.all_special_ids)
    found.update(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    return frozenset(found)


def encode_chat(tokenizer, messages: Sequence[Message], add_generation_prompt: bool = True,
                source: str | None = None) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template, message text always as plain text.

    ``add_generation_prompt`` appends the template's "assistant turn starts here" text, so the model replies
    rather than continuing the last message. ``source`` names the model in errors (default: the tokenizer's
    folder). Raises RequestError for malformed messages, a tokenizer without a chat template, a template that
    refuses the conversation, or a message whose text would become a control token.
    """
    checked = validate_messages(messages)
    require_chat_template(tokenizer, source)
    ids = _render_ids(tokenizer, checked, add_generation_prompt, source)
    # Independent of the library's marking: the template alone decides how many special tokens there are.
    special = _special_ids(tokenizer)
    neutral = [{"role": m["role"], "content": NEUTRAL_CONTENT} for m in checked]
    expected = Counter(t for t in _render_ids(tokenizer, neutral, add_generation_prompt, source) if t in special)
    found = Counter(t for t in ids if t in special)
    extra = found - expected
    if extra:
        token = tokenizer.convert_ids_to_tokens(next(iter(extra)))
        raise RequestError(f"messages: a message's text was encoded as the control token {token!r}, which only "
                           f"the chat template may write; remove {token!r} from the message text")
    return ids


def end_of_turn_ids(tokenizer) -> list[int]:
    """The special token the chat template writes right after an assistant message (``<|im_end|>``,
    ``<|eot_id|>``, ``<end_of_turn>``...), as a stop id; [] when there is none or no template.

    The executor already stops at the generation config's EOS ids (``SpeculativeExecutor``'s ``_eos_ids``:
    ``generation_config.eos_token_id``, int or list, plus the model config's and the tokenizer's EOS), which covers
    most instruct models. A base model with a chat template often lists only ``<|endoftext|>`` there, and would run
    past the end of its turn; passing these ids as ``stop_token_ids`` makes every chat stop at its turn's end.
    """
    if not has_chat_template(tokenizer):
        return []
    import secrets

    from jinja2 import TemplateError

    marker = f"reply{secrets.token_hex(6)}"
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], tokenize=False,
            add_generation_prompt=False)
    except (TemplateError, ValueError):
        return []
    if not isinstance(rendered, str) or marker not in rendered:
        return []
    tail = rendered[rendered.rindex(marker) + len(marker):]
    special = _special_ids(tokenizer)
    ids = tokenizer.encode(tail, add_special_tokens=False) if tail else []
    return [next(t for t in ids if t in special)] if any(t in special for t in ids) else []
