"""The target's aux hidden states, the drafter's context features.

vLLM's `target_layer_ids` entry i is the output of decoder layer i, i.e. the
transformers `hidden_states[i + 1]` (index 0 is the embedding output). The
listed layers are concatenated in order along the last dim, which is the `fc`
input. Training reads them through `stored_states`, sequence by sequence, in the
training dtype on the training device, rounded to bfloat16: from the state cache
(`train.state_cache`) where an earlier visit stored them, else computed now, so
cached and online states are the same tensors.
"""

from __future__ import annotations

from typing import Any

import torch


def aux_states(model: Any, batch: list[list[int]], layer_ids: list[int],
               pad_id: int = 0) -> list[torch.Tensor]:
    """Aux target states [T_i, len(layer_ids) * hidden] of each sequence of a batch.

    `model` is the decoder stack (no LM head), possibly truncated after the last
    layer in `layer_ids`. Sequences are right-padded, which causal attention never
    lets earlier (real) positions see.
    """
    out = _decoded(model, batch, pad_id)
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return [feats[b, : len(s)] for b, s in enumerate(batch)]


def _decoded(model: Any, batch: list[list[int]], pad_id: int) -> Any:
    """The decoder's output for a right-padded batch, every layer's state included."""
    device = next(model.parameters()).device
    longest = max(len(s) for s in batch)
    ids = torch.tensor([s + [pad_id] * (longest - len(s)) for s in batch], device=device)
    # in the model's own dtype, also inside a training step's autocast
    with torch.inference_mode(), torch.autocast(device.type, enabled=False):
        return model(ids, output_hidden_states=True, use_cache=False)


def stored_states(model: Any, batch: list[list[int]], layer_ids: list[int]
                  ) -> list[torch.Tensor]:
    """Aux states of a batch as training reads them: bf16 ordinary tensors (not inference
    tensors, so autograd may save them), cached and online alike."""
    return [st.to(torch.bfloat16).clone() for st in aux_states(model, batch, layer_ids)]


def truncated_decoder(target: str, last_layer: int | None, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> Any:
    """The target's decoder stack on `device`, without the LM head and the layers after
    `last_layer` (their outputs are never drafter features; None: keep them all). Its
    final norm is replaced by the identity, so that every returned state is a layer's own
    output, the last one included."""
    from transformers import AutoModelForCausalLM

    decoder = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).model
    if last_layer is not None:
        decoder.layers = decoder.layers[: last_layer + 1]
        decoder.config.num_hidden_layers = last_layer + 1
    decoder.norm = torch.nn.Identity()
    return decoder.to(device).eval()
