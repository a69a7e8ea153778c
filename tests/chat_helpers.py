"""A copy of the tiny pair whose tokenizers carry a chat template (the tiny pair itself has none)."""

from __future__ import annotations

import shutil
from pathlib import Path

# ChatML's shape with the tiny vocabulary's one special token as the end of each turn; tools in a system turn and
# calls as Hermes <tool_call> blocks (so the served chat pair has a tool format), rendered only when a request has them.
TINY_CHAT_TEMPLATE = (
    "{% if tools %}{{ 'system\\n# Tools\\n' }}{% for tool in tools %}{{ tool | tojson + '\\n' }}{% endfor %}"
    "{{ 'Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>' + eos_token + '\\n' }}{% endif %}"
    "{% for message in messages %}{% if message.tool_calls %}{{ message['role'] + '\\n' }}"
    "{% for call in message.tool_calls %}{{ '<tool_call>{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{% if call.function.arguments is string %}{{ call.function.arguments }}{% else %}"
    "{{ call.function.arguments | tojson }}{% endif %}{{ '}</tool_call>' }}{% endfor %}{{ eos_token + '\\n' }}"
    "{% else %}{{ message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant\\n' }}{% endif %}")


def make_chat_pair(tiny_pair: Path, out: Path) -> Path:
    """``out`` with target/ and draft/ copied from ``tiny_pair``, their tokenizers given TINY_CHAT_TEMPLATE."""
    from transformers import AutoTokenizer

    for role in ("target", "draft"):
        shutil.copytree(tiny_pair / role, out / role)
        tokenizer = AutoTokenizer.from_pretrained(out / role)
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
        tokenizer.save_pretrained(out / role)
    if (tiny_pair / "pair.json").is_file():  # the seed the built-in code prompts are drawn with
        shutil.copyfile(tiny_pair / "pair.json", out / "pair.json")
    return out


def build_chat_engines(tiny_pair: Path, folder: Path, name: str = "tiny-chat") -> tuple[Path, Path]:
    """(config path, engines dir) of the chat pair, converted and built."""
    from tests.conftest import tiny_config_dict, write_config

    from pipeline.config import load_config
    from pipeline.stages import run_stages

    pair = make_chat_pair(tiny_pair, folder / "pair")
    config = write_config(folder, tiny_config_dict(pair, name=name))
    run_stages(load_config(config), folder / "engines", ("convert", "build"))
    return config, folder / "engines"
