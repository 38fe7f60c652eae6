"""Shared fixtures: the SmolLM2 target and a random carryover drafter."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as a local HF folder (30 layers, hidden 576)."""
    from vllm_carryover.testbed import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="session")
def random_drafter(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 1-layer carryover drafter for SmolLM2 (block size 8, seed 0).

    Shared by the session: copy it before changing it.
    """
    from vllm_carryover.init_drafter import init_drafter

    out = tmp_path_factory.mktemp("random_drafter")
    return init_drafter(smollm2, out, num_layers=1, block_size=8, seed=0)


@pytest.fixture(scope="session")
def stub_drafter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random drafter (block size 8) for a target stub with SmolLM2's shapes: for
    tests of the checkpoint format that need no real target. Copy it to change it."""
    import json

    from checkpoint_layouts import TARGET_STUB

    from vllm_carryover.init_drafter import init_drafter

    target = tmp_path_factory.mktemp("target_stub")
    (target / "config.json").write_text(json.dumps(TARGET_STUB))
    return init_drafter(target, tmp_path_factory.mktemp("stub_drafter") / "drafter",
                        block_size=8)


@pytest.fixture(scope="session")
def shipped_drafters() -> Path:
    """The folder of the SmolLM2 drafters that `train/` made and the repository ships."""
    return (Path(__file__).resolve().parent.parent / "train" / "checkpoints"
            / "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def trained_drafter(shipped_drafters: Path) -> Path:
    """The shipped SmolLM2 drafter trained by `python -m train baseline`: often right."""
    path = shipped_drafters / "dflash-baseline"
    assert (path / "model.safetensors").is_file(), f"missing shipped drafter {path}"
    return path
