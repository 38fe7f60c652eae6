"""The target's token embedding and LM head, read straight from its safetensors.

A drafter shares both with its target: the embedding turns its input tokens
into states, and its LM head is the target's, frozen (`draft_vocab` keeps a
subset of its rows). Reading the two tensors alone keeps training and
conversion from loading the whole target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _read(folder: Path, matches: str) -> torch.Tensor:
    """The first tensor whose name ends with `matches` in the folder's safetensors, fp32."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            name = next((k for k in f.keys() if k.endswith(matches)), None)  # noqa: SIM118
            if name is not None:
                return f.get_tensor(name).float()
    raise FileNotFoundError(f"{folder} has no tensor named *{matches} in "
                            f"{[f.name for f in files]}")


def target_embedding(target: str | Path) -> torch.Tensor:
    """The target's token embedding [V, H], float32."""
    return _read(Path(target), "embed_tokens.weight")


def target_lm_head(target: str | Path) -> torch.Tensor:
    """The target's LM head [V, H], float32 (its token embedding when the two are tied)."""
    folder = Path(target)
    cfg = json.loads((folder / "config.json").read_text())
    return target_embedding(folder) if cfg.get("tie_word_embeddings") else _read(
        folder, "lm_head.weight")


def target_final_norm(target: str | Path) -> torch.Tensor:
    """The target's final RMSNorm weight [H], float32: a fresh drafter's own final norm
    starts from it, so its logits over the shared LM head start at the target's scale."""
    return _read(Path(target), "model.norm.weight")
