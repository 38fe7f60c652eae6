"""The target's aux hidden states, the drafter's context features.

vLLM's `target_layer_ids` entry i is the output of decoder layer i, i.e. the
transformers `hidden_states[i + 1]` (index 0 is the embedding output). The
listed layers are concatenated in order along the last dim, which is the `fc`
input. States are computed once (float32, batched), stored in bfloat16 and cached
per dataset + layer set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm


def aux_states(model: Any, batch: list[list[int]], layer_ids: list[int],
               pad_id: int = 0) -> list[torch.Tensor]:
    """Aux target states [T_i, len(layer_ids) * hidden] of each sequence of a batch.

    `model` is the decoder stack (no LM head), possibly truncated after the last
    layer in `layer_ids`. Sequences are right-padded, which causal attention never
    lets earlier (real) positions see.
    """
    longest = max(len(s) for s in batch)
    ids = torch.tensor([s + [pad_id] * (longest - len(s)) for s in batch])
    with torch.inference_mode():
        out = model(ids, output_hidden_states=True, use_cache=False)
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return [feats[b, : len(s)] for b, s in enumerate(batch)]


def truncated_decoder(target: str, last_layer: int) -> Any:
    """The target's decoder stack in float32 (bf16 GEMMs are slower on CPUs without
    native bf16), without the LM head and the layers after
    `last_layer` (their outputs are never drafter features)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    decoder = model.model
    decoder.layers = decoder.layers[: last_layer + 1]
    decoder.config.num_hidden_layers = last_layer + 1
    decoder.norm = torch.nn.Identity()  # the last returned state is the normed output
    return decoder.eval()


def extract(target: str, sequences: list[list[int]], layer_ids: list[int],
            cache: Path, batch_size: int = 8) -> list[torch.Tensor]:
    """Aux states (bf16) of every sequence, read from or written to `cache`."""
    if cache.is_file():
        saved = torch.load(cache)
        if saved["layer_ids"] == list(layer_ids) and saved["lengths"] == [
                len(s) for s in sequences]:
            return list(saved["states"])
    model = truncated_decoder(target, max(layer_ids))
    states: list[torch.Tensor] = []
    # similar lengths per batch: sort, extract, restore the order
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    by_index: dict[int, torch.Tensor] = {}
    with tqdm(total=sum(len(s) for s in sequences), desc="target states", unit="tok") as bar:
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            batch = [sequences[i] for i in idx]
            for i, st in zip(idx, aux_states(model, batch, layer_ids), strict=True):
                by_index[i] = st.to(torch.bfloat16).clone()
            bar.update(sum(len(s) for s in batch))
    states = [by_index[i] for i in range(len(sequences))]
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"layer_ids": list(layer_ids), "lengths": [len(s) for s in sequences],
                "states": states}, cache)
    return states
