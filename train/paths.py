"""Where the training caches live (outside the repository)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vllm_carryover.tools.run_settings import REPO

CHECKPOINTS = REPO / "train" / "checkpoints"


def cache_root() -> Path:
    """`$VLLM_CARRYOVER_CACHE/train`, default `~/.cache/vllm-carryover/train`."""
    base = os.environ.get("VLLM_CARRYOVER_CACHE") or Path.home() / ".cache" / "vllm-carryover"
    return Path(base) / "train"


DATASETS = REPO / "train" / "datasets"  # committed datasets (token ids, compressed)


def data_dir(name: str) -> Path:
    """A dataset folder: committed under train/datasets/NAME, else in the cache."""
    committed = DATASETS / name
    return committed if committed.is_dir() else cache_root() / "data" / name


def run_dir(name: str) -> Path:
    return cache_root() / "runs" / name


DEFAULT_DATA = "smollm2-mix-v2"  # the committed dataset (train/datasets/), the recipes' default


def default_target() -> str:
    """The testbed target folder (SmolLM2-135M-Instruct), built if needed."""
    out = subprocess.run([sys.executable, "-m", "vllm_carryover.tools.testbed"], check=True,
                         capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]
