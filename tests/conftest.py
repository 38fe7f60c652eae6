"""Shared fixtures: the SmolLM2 target and a random carryover drafter."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_carryover.tools.run_settings import CPU_BINDING_VARS, MAIN_DRAFTER


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker gets its own share of the CPU cores.

    By default vLLM's CPU worker binds its threads to every core but the last, so
    on a 2-core machine the engines of both pytest workers ran on core 0 while
    core 1 idled. Two engines generating at once, each pinned to its own core,
    finished in 12 s instead of 22 s and started in 25 s instead of 40 (2 cores,
    SmolLM2, float32). Binding chosen by the user, or a GPU, is left alone.
    """
    cores = worker_cores()
    if cores is None:
        return
    import torch

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    os.environ["OMP_NUM_THREADS"] = str(len(cores))  # subprocesses the tests start
    torch.set_num_threads(len(cores))


def worker_cores() -> list[int] | None:
    """This xdist worker's contiguous share of the allowed cores (one core, shared in
    turn, when there are more workers than cores), or None to leave placement to vLLM
    and the OS (no xdist, a binding already chosen, a GPU)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker or any(v in os.environ for v in CPU_BINDING_VARS):
        return None
    import torch

    if torch.cuda.is_available():
        return None
    count = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    index = int(worker.removeprefix("gw"))
    cores = sorted(os.sched_getaffinity(0))
    if count > len(cores):
        return [cores[index % len(cores)]]
    return cores[len(cores) * index // count:len(cores) * (index + 1) // count]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as a local HF folder (30 layers, hidden 576)."""
    from vllm_carryover.tools.testbed import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="session")
def random_drafter(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 1-layer carryover drafter for SmolLM2 (block size 8, seed 0).

    Shared by the session: copy it before changing it.
    """
    from vllm_carryover.drafter.init_drafter import init_drafter

    out = tmp_path_factory.mktemp("random_drafter")
    return init_drafter(smollm2, out, num_layers=1, block_size=8, seed=0)


@pytest.fixture(scope="session")
def stub_drafter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random drafter (block size 8) for a target stub with SmolLM2's shapes: for
    tests of the checkpoint format that need no real target. Copy it to change it."""
    import json

    from support.checkpoint_layouts import TARGET_STUB

    from vllm_carryover.drafter.init_drafter import init_drafter

    target = tmp_path_factory.mktemp("target_stub")
    (target / "config.json").write_text(json.dumps(TARGET_STUB))
    return init_drafter(target, tmp_path_factory.mktemp("stub_drafter") / "drafter",
                        block_size=8)


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty huggingface_hub cache, offline (what HF_HUB_CACHE and HF_HUB_OFFLINE=1 set;
    huggingface_hub reads those variables once, at import)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture(scope="session")
def shipped_drafters() -> Path:
    """The folder of the SmolLM2 drafters that `train/` made and the repository ships."""
    return (Path(__file__).resolve().parent.parent / "train" / "checkpoints"
            / "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def trained_drafter(shipped_drafters: Path) -> Path:
    """The shipped one-layer SmolLM2 drafter of the README's main job (beside the suffix
    lookup, mask slots): often right, and cheap to run in float32."""
    path = shipped_drafters / MAIN_DRAFTER
    assert (path / "model.safetensors").is_file(), f"missing shipped drafter {path}"
    return path
