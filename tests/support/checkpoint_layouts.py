"""A target stub, and other layouts of a drafter checkpoint (sharded, in an HF cache, as
public DFlash drafters are published, with a suffix seed of its own)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from vllm_carryover.drafter.format import (
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    DrafterConfig,
    random_state_dict,
    rope_theta_of,
)
from vllm_carryover.lookups.suffix import SEED_FILE, save_seed

COMMIT = "0123456789abcdef0123456789abcdef01234567"

# SmolLM2-135M's shapes: all the validator reads of a target's HF config.
TARGET_STUB = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
               "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
               "max_position_embeddings": 8192, "rope_theta": 100000.0}


def seeded_drafter(drafter: Path, out: Path, answers: list) -> Path:
    """`out`: the drafter's files linked, beside a suffix seed of `answers` written there
    (never through a link: that would replace a shipped drafter's own seed)."""
    out.mkdir()
    for f in drafter.iterdir():
        if f.name != SEED_FILE:
            (out / f.name).symlink_to(f)
    save_seed(out / SEED_FILE, answers)
    return out


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


def public_dflash_drafter(target: Path, out: Path, *, num_layers: int, block_size: int,
                          target_layer_ids: list[int], mask_token_id: int) -> Path:
    """A random DFlash drafter for `target` in the layout public ones are published in
    (z-lab's: `block_size` and `num_target_layers` at the top level, `mask_token_id` and
    `target_layer_ids` in `dflash_config`, an `auto_map` to their own code; bf16 weights
    without embeddings, LM head or rejected embedding)."""
    from safetensors.torch import save_file

    t = json.loads((target / "config.json").read_text())
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
           "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
           "block_size": block_size, "num_target_layers": t["num_hidden_layers"],
           "dflash_config": {"mask_token_id": mask_token_id,
                             "target_layer_ids": target_layer_ids},
           "hidden_size": t["hidden_size"], "intermediate_size": 3 * t["hidden_size"] // 2,
           "num_hidden_layers": num_layers, "num_attention_heads": t["num_attention_heads"],
           "num_key_value_heads": t["num_key_value_heads"], "head_dim": t["head_dim"],
           "vocab_size": t["vocab_size"], "rms_norm_eps": 1e-6, "rope_theta": rope_theta_of(t),
           "max_position_embeddings": t["max_position_embeddings"],
           "layer_types": ["full_attention"] * num_layers, "hidden_act": "silu",
           "attention_bias": False, "tie_word_embeddings": False, "dtype": "bfloat16"}
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    state = random_state_dict(DrafterConfig.from_dict(cfg), seed=7)
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(out / WEIGHTS_FILE))
    return out
