"""Reading and writing drafter folders (the format is `drafter.format`).

Weights are one `model.safetensors` or the shards a `model.safetensors.index.json`
names, as vLLM and transformers read them; headers are read without loading
the tensors, so validation at startup stays cheap.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from vllm_carryover.drafter.format import REJECTED_EMBEDDING, WEIGHTS_FILE, WEIGHTS_INDEX
from vllm_carryover.errors import CarryoverConfigError


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """Tensor names, dtypes and shapes of a safetensors file, without loading it.

    Raises CarryoverConfigError naming the file when it is truncated or corrupt.
    """
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError(f"header length {header_len} exceeds file size {size}")
            header = json.loads(f.read(header_len))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
                  default=0)
        if 8 + header_len + end > size:
            raise ValueError(f"tensor data ends at byte {8 + header_len + end}, file has {size}")
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise CarryoverConfigError(
            f"drafter weights file {path} is truncated or corrupt ({e}); "
            "re-export or re-download the checkpoint"
        ) from e
    header.pop("__metadata__", None)
    return header


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a drafter folder: `model.safetensors`, or the shards
    that `model.safetensors.index.json` names (as vLLM and transformers read them)."""
    if (path / WEIGHTS_FILE).is_file():
        return [path / WEIGHTS_FILE]
    index = path / WEIGHTS_INDEX
    if not index.is_file():
        raise CarryoverConfigError(
            f"drafter folder {path} has no {WEIGHTS_FILE} (nor a sharded checkpoint's "
            f"{WEIGHTS_INDEX})")
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CarryoverConfigError(
            f"{index} is not a safetensors index ({type(e).__name__}: {e}); it needs a "
            "\"weight_map\" from tensor names to shard files") from e
    missing = [name for name in shards if not (path / name).is_file()]
    if missing:
        raise CarryoverConfigError(
            f"drafter folder {path} lacks {len(missing)} of the {len(shards)} shards its "
            f"{WEIGHTS_INDEX} names (first: {missing[0]}); download the whole checkpoint")
    return [path / name for name in shards]


def read_weights_header(path: Path) -> dict[str, Any]:
    """Tensor names, dtypes and shapes over every weights file of a drafter folder."""
    header: dict[str, Any] = {}
    for file in weight_files(path):
        header |= read_safetensors_header(file)
    return header


def read_tensor(path: Path, name: str) -> torch.Tensor:
    """One tensor of a drafter folder, read alone (from whichever shard holds it)."""
    from safetensors import safe_open

    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                return f.get_tensor(name)
    raise KeyError(f"{path} has no tensor {name}")


def has_rejected_embedding(path: str | Path) -> bool:
    return REJECTED_EMBEDDING in read_weights_header(Path(path))


def save_drafter(out_dir: str | Path, config: dict[str, Any],
                 state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> Path:
    """Write `config.json` and `model.safetensors` into `out_dir`."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(config, torch_dtype=str(dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # weights in `dtype`; integer tensors (a draft vocabulary's d2t map) as they are
    save_file({k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous()
               for k, v in state.items()}, str(out / WEIGHTS_FILE))
    return out


def load_drafter_state(path: str | Path, fill_rejected: bool = True
                       ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, state dict) of a drafter folder; a missing rejected
    embedding is returned as zeros, as the vLLM loader does (`fill_rejected=False`:
    left out, so that a plain DFlash drafter copied or trained on stays one)."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        state |= load_file(str(file))
    if fill_rejected and REJECTED_EMBEDDING not in state:
        state[REJECTED_EMBEDDING] = torch.zeros(cfg["hidden_size"])
    return cfg, state
