"""Medusa heads: extra LM heads on the target's last hidden state; head h predicts the token h + 2 places ahead
(the target's own head predicts the next one), so one target forward proposes a token per head.

Each head is ``num_layers`` residual blocks, x + SiLU(Linear(x)) (hidden x hidden, with bias), then a vocabulary
projection without bias. Saved in FasterDecoding/Medusa's layout, which TensorRT-LLM's Medusa converter reads
(``--medusa_model_dir``; recorded sources in tests/data/trtllm_1.1.0_medusa): a folder with
``medusa_lm_head.safetensors``, keys ``{h}.{l}.linear.weight`` [d, d], ``{h}.{l}.linear.bias`` [d] and
``{h}.{num_layers}.weight`` [V, d], and a ``config.json`` naming ``medusa_num_heads`` and ``medusa_num_layers``. So
one set of heads serves both backends.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

HEADS_FILE = "medusa_lm_head.safetensors"
CONFIG_FILE = "config.json"


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # starts as the identity: a new head first predicts what the base does
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.ModuleList):
    """``num_heads`` heads over hidden states of ``hidden_size``; indexing and state_dict keys follow the layout in
    the module docstring."""

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int):
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"medusa heads: {num_heads} heads of {num_layers} layers; need at least 1 head and "
                             f"0 or more layers")
        super().__init__([nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)],
                                        nn.Linear(hidden_size, vocab_size, bias=False)) for _ in range(num_heads)])
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size

    @property
    def num_heads(self) -> int:
        return len(self)

    def forward(self, hidden: Tensor) -> Tensor:  # [..., d] -> [heads, ..., V]
        return torch.stack([head(hidden) for head in self])

    @classmethod
    def from_target(cls, target, num_heads: int, num_layers: int) -> MedusaHeads:
        """Heads whose projections start as the target's own LM head (float32, on the target's device)."""
        out = target.get_output_embeddings()
        heads = cls(num_heads, num_layers, out.weight.shape[1], out.weight.shape[0]).to(out.weight.device)
        with torch.no_grad():
            for head in heads:
                head[-1].weight.copy_(out.weight.float())
        return heads

    def save(self, folder: Path, base_model: str = "") -> None:
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(folder / HEADS_FILE))
        (folder / CONFIG_FILE).write_text(json.dumps({
            "medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
            "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
            "base_model_name_or_path": base_model}, indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> MedusaHeads:
        from safetensors.torch import load_file

        config = json.loads((folder / CONFIG_FILE).read_text())
        weights = load_file(str(folder / HEADS_FILE))
        heads = cls(config["medusa_num_heads"], config["medusa_num_layers"], config["hidden_size"],
                    config["vocab_size"])
        heads.load_state_dict(weights)  # strict: a missing or extra key is an error naming it
        return heads.to(device=device, dtype=dtype).eval()
