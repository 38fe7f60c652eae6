"""A target stub, and other layouts of a drafter checkpoint (sharded, in an HF cache)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from vllm_carryover.drafter.format import WEIGHTS_FILE, WEIGHTS_INDEX

COMMIT = "0123456789abcdef0123456789abcdef01234567"

# SmolLM2-135M's shapes: all the validator reads of a target's HF config.
TARGET_STUB = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
               "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
               "max_position_embeddings": 8192, "rope_theta": 100000.0}


def shard_drafter(folder: Path, parts: int = 2) -> list[str]:
    """Split `folder`'s model.safetensors into `parts` shards plus an index, in place."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / WEIGHTS_FILE))
    names = sorted(state)
    shards = [f"model-{i + 1:05d}-of-{parts:05d}.safetensors" for i in range(parts)]
    weight_map = {}
    for i, shard in enumerate(shards):
        part = names[i::parts]
        save_file({n: state[n] for n in part}, str(folder / shard))
        weight_map |= dict.fromkeys(part, shard)
    (folder / WEIGHTS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / WEIGHTS_FILE).unlink()
    return shards


def hub_cache_layout(cache: Path, repo_id: str, folder: Path, revision: str = "main") -> Path:
    """Put `folder`'s files where huggingface_hub caches `repo_id` at `revision`
    (`HF_HUB_CACHE`/models--owner--name); return the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(folder, snapshot, dirs_exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(COMMIT)
    return snapshot
