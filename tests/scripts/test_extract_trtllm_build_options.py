"""scripts/extract_trtllm_build_options.py: the recorded trtllm-build option list (tests/data/trtllm_<release>_api.json)
is what this script reads from the release's sources."""

from __future__ import annotations

import json
import subprocess
import sys

from pipeline.backends.trtllm_api import PINNED_VERSION
from tests.conftest import REPO


API_FILE = REPO / "tests" / "data" / f"trtllm_{PINNED_VERSION}_api.json"


API = json.loads(API_FILE.read_text())


OPTIONS = API["trtllm_build"]["options"]


def test_extraction_script_reads_options_choices_and_plugin_fields(tmp_path):
    build_py = tmp_path / "build.py"
    build_py.write_text(
        "def parse_arguments():\n"
        "    parser = argparse.ArgumentParser()\n"
        "    parser.add_argument('--max_seq_len', '--max_decoder_seq_len', dest='max_seq_len', type=int,\n"
        "                        default=BuildConfig.max_seq_len, help='x')\n"
        "    g = parser.add_argument_group('spec')\n"
        "    g.add_argument('--speculative_decoding_mode', default=None, choices=['draft_tokens_external', 'medusa'])\n"
        "    g.add_argument('--gather_generation_logits', action='store_true', default=False)\n"
        "    parser.add_argument('--log_level', type=str, default='info', choices=severity_map.keys())\n"
        "    add_plugin_argument(parser)\n"
        "    return parser\n")
    plugin_py = tmp_path / "plugin.py"
    plugin_py.write_text(
        "DefaultPluginDtype = Literal['auto', 'float16', None]\n"
        "class PluginConfig(BaseModel):\n"
        "    gemm_plugin: Optional[Literal['auto', 'fp8', None]] = Field(default=None, description='g')\n"
        "    nccl_plugin: Optional[DefaultPluginDtype] = Field(default='auto', description='n')\n"
        "    lora_plugin: Optional[DefaultPluginDtype] = Field(default=None, description='l')\n"
        "    use_paged_context_fmha: bool = Field(default=True, description='p')\n"
        "    tokens_per_block: int = Field(default=32, description='t')\n"
        "    manage_weights: bool = Field(default=False, description='not on the CLI')\n"
        "cli_plugin_args = ['gemm_plugin', 'nccl_plugin', 'lora_plugin', 'use_paged_context_fmha',\n"
        "                   'tokens_per_block']\n")
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "extract_trtllm_build_options.py"), str(build_py),
                          str(plugin_py), "--provenance", "commit=abc"], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    options = result["options"]
    assert result["provenance"] == {"commit": "abc"}
    assert options["--max_seq_len"] == {"dest": "max_seq_len", "type": "int", "default_expr": "BuildConfig.max_seq_len",
                                        "aliases": ["--max_decoder_seq_len"]}
    assert options["--speculative_decoding_mode"]["choices"] == ["draft_tokens_external", "medusa"]
    assert options["--gather_generation_logits"] == {"action": "store_true", "default": False}
    assert options["--log_level"]["choices_expr"] == "severity_map.keys()"
    assert options["--gemm_plugin"] == {"type": "str", "choices": ["auto", "fp8", "disable"], "default": None}
    assert options["--nccl_plugin"] == {"type": "str", "choices": ["auto", "float16", "disable"], "default": "auto"}
    assert options["--lora_plugin"]["default"] == "disable"  # falsy defaults print as disable, except gemm_plugin
    assert options["--use_paged_context_fmha"] == {"type": "str", "choices": ["enable", "disable"],
                                                   "default": "enable"}
    assert options["--tokens_per_block"] == {"type": "int", "default": 32}
    assert "--manage_weights" not in options


def test_recorded_options_come_from_the_script():
    assert "extract_trtllm_build_options.py" in API["trtllm_build"]["extracted_by"]
    assert (REPO / "scripts" / "extract_trtllm_build_options.py").is_file()
    # the plugin-derived options carry the script's shape: every enable/disable option has both choices
    for flag in ("--context_fmha", "--use_paged_context_fmha", "--remove_input_padding"):
        assert OPTIONS[flag]["choices"] == ["enable", "disable"]
