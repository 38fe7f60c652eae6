"""A drafter given as a Hugging Face hub id or as a sharded checkpoint is read like a folder.

The hub cases run offline (`HF_HUB_OFFLINE`, conftest's `offline_cache`) against a
cache laid out as huggingface_hub lays it out, so they need no network.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.checkpoint_layouts import TARGET_STUB, hub_cache_layout, shard_drafter

from vllm_carryover.config import translate
from vllm_carryover.drafter.checkpoint import has_rejected_embedding, load_drafter_state
from vllm_carryover.drafter.source import is_hub_id, resolve_drafter
from vllm_carryover.errors import CarryoverConfigError
from vllm_carryover.tools.acceptance_eval import weights_sha256

REPO = "carryover-tests/stub-drafter"


def spec_for(model: str, **extra: object) -> dict[str, object]:
    return {"method": "carryover", "model": model, "num_speculative_tokens": 4, "carryover": True,
            **extra}


def test_hub_id_is_told_apart_from_a_path(tmp_path):
    assert is_hub_id("z-lab/Qwen3-8B-DFlash-b16")
    assert not is_hub_id(str(tmp_path))
    assert not is_hub_id("/no/such/folder")
    assert not is_hub_id("./drafter")
    assert resolve_drafter("/no/such/folder") == Path("/no/such/folder")


def test_hub_id_in_the_offline_cache_is_served_from_its_snapshot(stub_drafter, offline_cache):
    snapshot = hub_cache_layout(offline_cache, REPO, stub_drafter)
    spec, _ = translate(spec_for(REPO), SimpleNamespace(**TARGET_STUB))
    assert Path(spec["model"]) == snapshot
    assert spec["method"] == "dflash"


def test_hub_revision_selects_its_own_snapshot(stub_drafter, offline_cache):
    snapshot = hub_cache_layout(offline_cache, REPO, stub_drafter, revision="v1")
    spec, _ = translate(spec_for(REPO, revision="v1"), SimpleNamespace(**TARGET_STUB))
    assert Path(spec["model"]) == snapshot
    with pytest.raises(CarryoverConfigError, match=rf"drafter {REPO}@v2 is not a local folder"):
        translate(spec_for(REPO, revision="v2"), SimpleNamespace(**TARGET_STUB))


def test_hub_id_missing_from_the_offline_cache_is_refused_naming_the_download(offline_cache):
    with pytest.raises(CarryoverConfigError) as info:
        translate(spec_for(REPO), SimpleNamespace(**TARGET_STUB))
    message = str(info.value)
    assert f"drafter {REPO} is not a local folder" in message
    assert f"`hf download {REPO}`" in message
    assert "\n" not in message


def test_sharded_checkpoint_loads_and_validates_like_one_file(stub_drafter, tmp_path):
    sharded = Path(shutil.copytree(stub_drafter, tmp_path / "sharded"))
    shards = shard_drafter(sharded, parts=3)
    assert len(shards) == 3 and not (sharded / "model.safetensors").exists()
    spec, _ = translate(spec_for(str(sharded)), SimpleNamespace(**TARGET_STUB))
    assert spec["model"] == str(sharded)
    assert has_rejected_embedding(sharded) == has_rejected_embedding(stub_drafter)
    _, whole = load_drafter_state(stub_drafter)
    _, parts = load_drafter_state(sharded)
    assert whole.keys() == parts.keys()
    assert all(torch.equal(whole[name], parts[name]) for name in whole)


def test_sharded_checkpoint_gets_a_weights_hash_that_changes_with_any_shard(stub_drafter,
                                                                            tmp_path):
    sharded = Path(shutil.copytree(stub_drafter, tmp_path / "sharded"))
    shards = shard_drafter(sharded, parts=2)
    before = weights_sha256(sharded)
    assert before is not None and before != weights_sha256(stub_drafter)
    last = sharded / shards[-1]
    last.write_bytes(last.read_bytes() + b" ")
    assert weights_sha256(sharded) not in (None, before)
    assert weights_sha256(tmp_path / "no-drafter") is None
