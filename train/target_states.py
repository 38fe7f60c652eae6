"""The target's aux hidden states, the drafter's context features.

vLLM's `target_layer_ids` entry i is the output of decoder layer i, i.e. the
transformers `hidden_states[i + 1]` (index 0 is the embedding output). The
listed layers are concatenated in order along the last dim, which is the `fc`
input. States are computed once (batched, in the machine's fastest dtype), stored
in bfloat16 and cached per dataset + layer set in the cache folder, never in the
dataset folder (a committed dataset holds token ids only). For a target whose
states do not fit on disk, training computes them online instead, sequence by
sequence, through the same `stored_states`: the two paths agree bit for bit in
the same dtype on the same device, except that the cache batches sequences of
similar length, and padding a sequence can move its float32 results in the last
bits (after bf16 rounding, now and then one bf16 step).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from vllm_carryover.train.ray_shards import map_shards


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


def states_and_final(model: Any, tokens: list[int], layer_ids: list[int]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux states as `stored_states` gives them, the final normed state [T, H] in bf16) of
    one sequence, from the whole decoder (`truncated_decoder(target, None)`): the final
    state times the target's LM head is the target's own next-token distribution, the
    teacher of `train baseline --distill`."""
    out = _decoded(model, [tokens], 0)
    aux = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)[0]
    with torch.inference_mode():
        final = model.final_norm(out.hidden_states[-1][0])
    return aux.to(torch.bfloat16).clone(), final.to(torch.bfloat16).clone()


def truncated_decoder(target: str, last_layer: int | None, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> Any:
    """The target's decoder stack on `device`, without the LM head and the layers after
    `last_layer` (their outputs are never drafter features; None: keep them all). Its
    final norm is set aside as `final_norm` (`states_and_final`), so that every returned
    state is a layer's own output, the last one included."""
    from transformers import AutoModelForCausalLM

    decoder = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).model
    if last_layer is not None:
        decoder.layers = decoder.layers[: last_layer + 1]
        decoder.config.num_hidden_layers = last_layer + 1
    decoder.final_norm, decoder.norm = decoder.norm, torch.nn.Identity()
    return decoder.to(device).eval()


def _extract_shard(items: list[tuple[int, list[int]]], target: str, layer_ids: list[int],
                   batch_size: int) -> list[tuple[int, torch.Tensor]]:
    """One Ray task: (index, bf16 aux states) of its sequences, batched by similar length."""
    from vllm_carryover.dtype import fastest_dtype

    model = truncated_decoder(target, max(layer_ids), getattr(torch, fastest_dtype()))
    items = sorted(items, key=lambda x: len(x[1]))
    out: list[tuple[int, torch.Tensor]] = []
    bar = tqdm(total=sum(len(s) for _, s in items), desc="target states", unit="tok",
               mininterval=10)
    for start in range(0, len(items), batch_size):
        batch = items[start:start + batch_size]
        states = stored_states(model, [s for _, s in batch], layer_ids)
        out += [(i, st) for (i, _), st in zip(batch, states, strict=True)]
        bar.update(sum(len(s) for _, s in batch))
    bar.close()
    return out


def extract(target: str, sequences: list[list[int]], layer_ids: list[int], cache: Path,
            batch_size: int = 8, workers: int = 1, cpus_per_worker: int = 2,
            ray_address: str | None = None) -> list[torch.Tensor]:
    """Aux states (bf16) of every sequence, read from or written to `cache`.

    Computed once per dataset and layer set, sharded over Ray workers: training
    visits every sequence several times, and a target forward per visit would
    cost more than the drafter step itself (see `python -m train data --help`).
    """
    if cache.is_file():
        saved = torch.load(cache)
        if saved["layer_ids"] == list(layer_ids) and saved["lengths"] == [
                len(s) for s in sequences]:
            return list(saved["states"])
    # interleaved shards get similar length mixes; each shard sorts by length
    items = list(enumerate(sequences))
    items = [x for w in range(workers) for x in items[w::workers]]
    pairs = map_shards(_extract_shard, items, workers=workers, cpus_per_worker=cpus_per_worker,
                       address=ray_address, desc="target states", target=target,
                       layer_ids=list(layer_ids), batch_size=batch_size)
    by_index = dict(pairs)
    states = [by_index[i] for i in range(len(sequences))]
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"layer_ids": list(layer_ids), "lengths": [len(s) for s in sequences],
                "states": states}, cache)
    return states


def states_file(data: Path, manifest_sha256: str, layer_ids: list[int]) -> Path:
    """The cache file of a dataset's aux states for one set of target layers."""
    from vllm_carryover.train.paths import cache_root

    tag = hashlib.sha256(f"{manifest_sha256}:{list(layer_ids)}".encode()).hexdigest()[:12]
    return cache_root() / "states" / f"{data.name}-{tag}.pt"


def states_gib(data: Path, feature_size: int) -> float:
    """What a dataset's aux states take in bf16 (every prompt and response token)."""
    from vllm_carryover.train.data import load_manifest

    tokens = sum(split["prompt_tokens"] + split["response_tokens"]
                 for cat in load_manifest(data)["per_category"].values()
                 for split in cat.values())
    return tokens * feature_size * 2 / (1 << 30)


def resolve_mode(mode: str, data: Path, feature_size: int) -> str:
    """`--target-states auto`: cached while the dataset's states take under a quarter of
    this machine's memory (the cache is one file, read whole), else online. Says which,
    and why."""
    if mode != "auto":
        return mode
    need = states_gib(data, feature_size)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    mode = "cached" if need < memory / 4 else "online"
    print(f"target states: {mode} (the dataset's take {need:.1f} GiB in bf16; this machine "
          f"has {memory:.1f} GiB of memory)", flush=True)
    return mode


def dataset_states(target: str, data: Path, layer_ids: list[int], **ray: Any
                   ) -> list[torch.Tensor]:
    """Aux states of every row of a dataset folder (prompt + response), cached there."""
    from vllm_carryover.train.data import load_manifest, load_samples

    rows = load_samples(data)
    toks = [r["prompt_ids"] + r["response_ids"] for r in rows]
    return extract(target, toks, layer_ids,
                   states_file(data, load_manifest(data)["sha256"], layer_ids), **ray)
