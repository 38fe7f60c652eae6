"""The target-state cache: a dataset's aux states on local disk, memory-mapped, filled
as training first visits each sequence.

A cache is a folder under the cache root (never the dataset folder: a committed dataset
holds token ids only), keyed by the dataset's manifest sha256, the drafter's target
layers and the dtype the target computes in, so that a cached sequence's states are
the tensors the same run would compute online, bit for bit. It holds

    states.bf16   one flat [dataset tokens, feature] bf16 array, each dataset row's
                  states at its offset in row order; sparse, so it takes disk only
                  for the rows written, and memory-mapped, so a read pages in that
                  sequence's rows alone (never the whole file)
    filled.u8     one byte per dataset row, set once its rows are on disk
    layout.json   what the file holds (shape, layers, dtype), written last

Training's feed (`train.baseline.sequence_feed`) reads a sequence's rows where they
are filled, else computes them (`train.target_states.stored_states`) and `put`s them:
the first epoch fills the cache, later epochs read it. A row's flag is set only after
its states are synced to disk, so an interrupted run never reads half a sequence.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

STATES = "states.bf16"
FILLED = "filled.u8"
LAYOUT = "layout.json"
MIN_FREE_GIB = 4.0  # `auto` keeps at least this much disk free beside a filled cache,
FREE_SHARE = 0.1  # and at least this share of the disk's size


class StateCache:
    """The memory-mapped states of one dataset's rows (`open` makes or reopens one)."""

    def __init__(self, folder: Path, lengths: list[int], feature: int) -> None:
        self.folder = folder
        self.lengths = lengths
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        self.feature = feature
        # bf16 as raw 16-bit words: numpy has no bfloat16; torch views them back
        self.states = np.memmap(folder / STATES, dtype=np.int16, mode="r",
                                shape=(self.offsets[-1], feature))
        self.states_fd = os.open(folder / STATES, os.O_WRONLY)
        self.filled_fd = os.open(folder / FILLED, os.O_RDWR)

    @classmethod
    def open(cls, folder: Path, lengths: list[int], feature: int, layer_ids: list[int],
             dtype: torch.dtype) -> StateCache:
        """The cache in `folder`: as it is when its layout matches, else a new, empty one.
        Processes that open it at once (torchrun's ranks, parallel runs) take turns."""
        folder.mkdir(parents=True, exist_ok=True)
        layout = {"rows": len(lengths), "tokens": int(sum(lengths)), "feature": feature,
                  "lengths_sha256": hashlib.sha256(np.asarray(lengths, np.int64).tobytes()
                                                   ).hexdigest(),
                  "layer_ids": list(layer_ids), "dtype": str(dtype)}
        with (folder / ".lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path = folder / LAYOUT
            if not path.is_file() or json.loads(path.read_text()) != layout:
                path.unlink(missing_ok=True)
                for name, size in ((STATES, layout["tokens"] * feature * 2),
                                   (FILLED, len(lengths))):
                    with (folder / name).open("wb") as f:
                        f.truncate(size)  # zeros, allocated only where written
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(layout, indent=1) + "\n")
                os.replace(tmp, path)
        return cls(folder, lengths, feature)

    def get(self, row: int) -> torch.Tensor | None:
        """Row `row`'s states [T, feature] in bf16 (a copy of its rows alone), or None
        while they are not filled."""
        if os.pread(self.filled_fd, 1, row) != b"\x01":
            return None
        start, end = self.offsets[row], self.offsets[row + 1]
        return torch.from_numpy(np.array(self.states[start:end])).view(torch.bfloat16)

    def put(self, row: int, states: torch.Tensor) -> None:
        """Write row `row`'s states [T, feature] (bf16), then mark them filled."""
        want = (self.lengths[row], self.feature)
        if states.dtype != torch.bfloat16 or tuple(states.shape) != want:
            raise ValueError(f"row {row} takes bf16 states of shape {want}, not "
                             f"{states.dtype} {tuple(states.shape)}")
        blob = memoryview(states.detach().cpu().contiguous().view(torch.int16).numpy()
                          ).cast("B")
        at, done = self.offsets[row] * self.feature * 2, 0
        while done < len(blob):
            done += os.pwrite(self.states_fd, blob[done:], at + done)
        os.fdatasync(self.states_fd)  # on disk before its flag says so
        os.pwrite(self.filled_fd, b"\x01", row)

    def filled(self) -> int:
        """How many rows are filled."""
        return int((np.fromfile(self.folder / FILLED, dtype=np.uint8) == 1).sum())

    def complete(self) -> bool:
        return self.filled() == len(self.lengths)


def cache_folder(data: Path, manifest_sha256: str, layer_ids: list[int],
                 dtype: torch.dtype) -> Path:
    """The cache of a dataset's aux states for one set of target layers and one dtype of
    the target's forward."""
    from vllm_carryover.train.paths import cache_root

    key = f"{manifest_sha256}:{list(layer_ids)}:{dtype}"
    return cache_root() / "states" / f"{data.name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def states_gib(data: Path, feature_size: int) -> float:
    """What a dataset's aux states take in bf16 (every prompt and response token)."""
    from vllm_carryover.train.data import load_manifest

    tokens = sum(split["prompt_tokens"] + split["response_tokens"]
                 for cat in load_manifest(data)["per_category"].values()
                 for split in cat.values())
    return tokens * feature_size * 2 / (1 << 30)


def disk_room_gib(folder: Path) -> float:
    """What the disk under `folder` can still take, a margin kept free
    (`MIN_FREE_GIB`, `FREE_SHARE` of its size), plus what the cache there already holds."""
    held = folder / STATES
    usage = shutil.disk_usage(next(p for p in (folder, *folder.parents) if p.exists()))
    margin = max(MIN_FREE_GIB * (1 << 30), FREE_SHARE * usage.total)
    written = held.stat().st_blocks * 512 if held.is_file() else 0
    return (usage.free - margin + written) / (1 << 30)


def dataset_cache(mode: str, data: Path, layer_ids: list[int], feature: int,
                  dtype: torch.dtype) -> StateCache | None:
    """`--target-states`: the dataset's state cache (`cached`; `auto` while the disk has
    room for all of it), or None (`online`: no cache). Says which, and why."""
    from vllm_carryover.train.data import load_manifest, load_samples

    if mode == "online":
        return None
    folder = cache_folder(data, load_manifest(data)["sha256"], layer_ids, dtype)
    if mode == "auto":
        need, room = states_gib(data, feature), disk_room_gib(folder)
        mode = "cached" if need <= room else "online"
        print(f"target states: {mode} (the dataset's take {need:.1f} GiB in bf16; the "
              f"disk under {folder.parent} has room for {max(room, 0):.1f} GiB)", flush=True)
        if mode == "online":
            return None
    lengths = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in load_samples(data)]
    cache = StateCache.open(folder, lengths, feature, layer_ids, dtype)
    print(f"target states: cache {folder}, {cache.filled()} of {len(lengths)} sequences "
          "filled (the others are computed on their first visit)", flush=True)
    return cache
