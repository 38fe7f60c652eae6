"""The target's aux hidden states, the drafter's context features.

vLLM's `target_layer_ids` entry i is the output of decoder layer i, i.e. the
transformers `hidden_states[i + 1]` (index 0 is the embedding output). The
listed layers are concatenated in order along the last dim, which is the `fc`
input. States are extracted once in bfloat16 and cached per dataset + layer set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm


def aux_states(model: Any, input_ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """Aux target states [T, len(layer_ids) * hidden] of one token sequence.

    `model` is the decoder stack (no LM head), possibly truncated after the last
    layer in `layer_ids`.
    """
    with torch.inference_mode():
        out = model(torch.tensor([input_ids]), output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)


def truncated_decoder(target: str, last_layer: int) -> Any:
    """The target's decoder stack in bf16, without the LM head and the layers after
    `last_layer` (their outputs are never drafter features)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16)
    decoder = model.model
    decoder.layers = decoder.layers[: last_layer + 1]
    decoder.config.num_hidden_layers = last_layer + 1
    decoder.norm = torch.nn.Identity()  # the last returned state is the normed output
    return decoder.eval()


def extract(target: str, sequences: list[list[int]], layer_ids: list[int],
            cache: Path) -> list[torch.Tensor]:
    """Aux states (bf16) of every sequence, read from or written to `cache`."""
    if cache.is_file():
        saved = torch.load(cache)
        if saved["layer_ids"] == list(layer_ids) and saved["lengths"] == [
                len(s) for s in sequences]:
            return list(saved["states"])
    model = truncated_decoder(target, max(layer_ids))
    states = []
    for seq in tqdm(sequences, desc="target states", unit="seq"):
        states.append(aux_states(model, seq, layer_ids).to(torch.bfloat16).clone())
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"layer_ids": list(layer_ids), "lengths": [len(s) for s in sequences],
                "states": states}, cache)
    return states
