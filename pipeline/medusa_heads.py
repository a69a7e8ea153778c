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
VOCAB_KEY = "medusa_vocab"  # train-draft --vocab: the target ids the heads were trained to propose


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
        # train-draft --vocab: the target ids the heads propose from (config.json VOCAB_KEY). The file keeps every
        # row (the converter reads [V, d]); restrict() drops the others for serving.
        self.vocab_ids: list[int] | None = None
        self._token_ids: Tensor | None = None  # set by restrict(): projection row -> target id

    @property
    def num_heads(self) -> int:
        return len(self)

    def forward(self, hidden: Tensor) -> Tensor:  # [..., d] -> [heads, ..., V]
        return torch.stack([head(hidden) for head in self])

    def head_logits(self, h: int, hidden: Tensor) -> Tensor:
        """Head h's logits [..., N] over its vocabulary rows (``vocab_ids`` when set, else all V), for training."""
        head = self[h]
        x = head[:-1](hidden)
        weight = head[-1].weight
        if self.vocab_ids is not None and self._token_ids is None:
            weight = weight[torch.tensor(self.vocab_ids, device=weight.device)]
        return nn.functional.linear(x, weight)

    def restrict(self) -> MedusaHeads:
        """Keep only the ``vocab_ids`` rows of each projection (serving: a head then reads N x d weights, not
        V x d); a no-op without vocab_ids. The heads can no longer be saved."""
        if self.vocab_ids is not None and self._token_ids is None:
            ids = torch.tensor(self.vocab_ids, dtype=torch.long, device=self[0][-1].weight.device)
            for head in self:
                old = head[-1]
                head[-1] = nn.Linear(self.hidden_size, len(ids), bias=False, device=ids.device,
                                     dtype=old.weight.dtype)
                head[-1].weight.data.copy_(old.weight.data[ids])
            self._token_ids = ids
        return self

    def top_tokens(self, hidden: Tensor, top_k: list[int]) -> list[Tensor]:
        """hidden [R, d] -> for head h < len(top_k), its top_k[h] target token ids [R, top_k[h]], best first."""
        hidden = hidden.to(self[0][-1].weight.dtype)
        ranked = [self[h](hidden).topk(k, dim=-1).indices for h, k in enumerate(top_k)]
        return ranked if self._token_ids is None else [self._token_ids[r] for r in ranked]

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

        if self._token_ids is not None:
            raise ValueError("medusa heads: restricted to their vocabulary for serving; save the heads as trained")
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(folder / HEADS_FILE))
        (folder / CONFIG_FILE).write_text(json.dumps({
            "medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
            "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
            "base_model_name_or_path": base_model,
            **({VOCAB_KEY: self.vocab_ids} if self.vocab_ids is not None else {})}, indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> MedusaHeads:
        from safetensors.torch import load_file

        config = json.loads((folder / CONFIG_FILE).read_text())
        weights = load_file(str(folder / HEADS_FILE))
        heads = cls(config["medusa_num_heads"], config["medusa_num_layers"], config["hidden_size"],
                    config["vocab_size"])
        heads.load_state_dict(weights)  # strict: a missing or extra key is an error naming it
        ids = config.get(VOCAB_KEY)
        if ids is not None:
            from .draft_vocab import check_ids

            problem = check_ids(ids, heads.vocab_size)
            if problem:
                raise ValueError(f"{folder / CONFIG_FILE}: {VOCAB_KEY} {problem}; retrain the heads with --vocab")
            heads.vocab_ids = list(ids)
        return heads.to(device=device, dtype=dtype).eval()


ENGINE_SUBDIR = "medusa"  # where a torch engine (and its converted checkpoint) keeps the heads beside the target


def read_heads_config(folder: Path) -> dict:
    """The heads folder's config.json; raises ValueError naming the file and the fix."""
    path = Path(folder) / CONFIG_FILE
    if not (Path(folder) / HEADS_FILE).is_file() or not path.is_file():
        raise ValueError(f"{folder}: no Medusa heads ({HEADS_FILE} and {CONFIG_FILE}); train them with "
                         f"`python -m pipeline train-draft CONFIG --kind medusa`")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); retrain the heads") from None
    return config if isinstance(config, dict) else {}


def heads_problems(folder: Path, heads: int, layers: int, hidden_size: int | None, vocab_size: int | None) -> list[str]:
    """What keeps the heads in ``folder`` from serving a target of this hidden size and vocabulary as configured
    (speculative.medusa.heads/layers); empty when they fit."""
    try:
        config = read_heads_config(folder)
    except ValueError as exc:
        return [str(exc)]
    problems = []
    for key, want, field in (("medusa_num_heads", heads, "heads"), ("medusa_num_layers", layers, "layers")):
        if config.get(key) != want:
            problems.append(f"speculative.medusa.{field}: {want}, but {folder} holds {key} {config.get(key)!r}; set "
                            f"{field}: {config.get(key)!r} or retrain with --heads/--head-layers")
    for key, want in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if want is not None and config.get(key) is not None and config[key] != want:
            problems.append(f"speculative.medusa.model: {folder} was trained for {key} {config[key]}, the target has "
                            f"{want}; train heads for this target")
    return problems

