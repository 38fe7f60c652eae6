"""The compact, sharded, resumable form of a training dataset.

A dataset folder holds everything needed to train and to continue generating,
in files small enough to commit:

    manifest.json            what made it, counts per category and split, sha256 per file
    prompts.npz              every prompt: row metadata + chat-templated token ids
    responses/shard-NNNNN.npz  the target's responses to prompts [N*S, (N+1)*S)

Token ids are stored flat (uint16 when the vocabulary fits, else uint32) with
lengths, compressed. A response shard is written whole (temporary file, then
rename, as is every rewrite of the manifest) once all its prompts are answered,
so an interrupted run loses only the shards in flight and a resumed run, here or
on a machine that has only the committed files, generates exactly the missing
ones.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST = "manifest.json"
PROMPTS = "prompts.npz"
RESPONSES = "responses"
ROW_FIELDS = ("id", "group", "category", "split")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.npz"


def _pack(seqs: list[list[int]]) -> dict[str, np.ndarray]:
    dtype = np.uint16 if all(max(s, default=0) < 1 << 16 for s in seqs) else np.uint32
    flat = np.fromiter((t for s in seqs for t in s), dtype=dtype,
                       count=sum(len(s) for s in seqs))
    return {"tokens": flat, "lengths": np.array([len(s) for s in seqs], dtype=np.int32)}


def _unpack(tokens: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    ends = np.cumsum(lengths)
    return [tokens[e - n:e].astype(np.int64).tolist() for n, e in zip(lengths, ends, strict=True)]


def _write_atomically(path: Path, blob: bytes) -> None:
    """A run killed at any moment leaves the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, path)


def _save_npz(path: Path, **arrays: np.ndarray) -> str:
    """Write atomically; return the file's sha256."""
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    blob = buf.getvalue()
    _write_atomically(path, blob)
    return hashlib.sha256(blob).hexdigest()


def _json_array(rows: list[Any]) -> np.ndarray:
    return np.frombuffer(json.dumps(rows).encode(), dtype=np.uint8)


@dataclass
class PromptTable:
    """All prompts of a dataset, in generation order: metadata rows + token ids."""

    rows: list[dict[str, str]]
    ids: list[list[int]]

    def save(self, folder: Path) -> str:
        return _save_npz(folder / PROMPTS, meta=_json_array(self.rows), **_pack(self.ids))

    @classmethod
    def load(cls, folder: Path) -> PromptTable:
        with np.load(folder / PROMPTS) as z:
            rows = json.loads(z["meta"].tobytes())
            return cls(rows, _unpack(z["tokens"], z["lengths"]))


def save_shard(folder: Path, index: int, responses: list[list[int]]) -> str:
    return _save_npz(folder / RESPONSES / shard_name(index), **_pack(responses))


def load_shard(folder: Path, index: int) -> list[list[int]]:
    with np.load(folder / RESPONSES / shard_name(index)) as z:
        return _unpack(z["tokens"], z["lengths"])


def done_shards(folder: Path) -> list[int]:
    """Indices of the response shards already written."""
    d = folder / RESPONSES
    return sorted(int(p.stem.split("-")[1]) for p in d.glob("shard-*.npz")) if d.is_dir() else []


def shard_ranges(num_prompts: int, shard_size: int) -> list[tuple[int, int]]:
    return [(s, min(s + shard_size, num_prompts)) for s in range(0, num_prompts, shard_size)]


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_manifest(folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Count what is there (answered prompts only) and write `manifest.json`.

    `sha256` covers the prompt table and every response shard, in order: it names
    the dataset's content (the state caches and the run metadata key on it).
    """
    table = PromptTable.load(folder)
    shard_size = meta["shard_size"]
    shards = done_shards(folder)
    files = {PROMPTS: file_sha256(folder / PROMPTS)}
    counts: dict[str, dict[str, dict[str, int]]] = {}
    for i in shards:
        files[f"{RESPONSES}/{shard_name(i)}"] = file_sha256(folder / RESPONSES / shard_name(i))
        for j, resp in enumerate(load_shard(folder, i)):
            r = table.rows[i * shard_size + j]
            c = counts.setdefault(r["category"], {}).setdefault(
                r["split"], {"prompts": 0, "prompt_tokens": 0, "response_tokens": 0})
            c["prompts"] += 1
            c["prompt_tokens"] += len(table.ids[i * shard_size + j])
            c["response_tokens"] += len(resp)
    combined = hashlib.sha256("".join(f"{k}:{v}\n" for k, v in files.items()).encode())

    def total(split: str, key: str) -> int:
        return sum(c.get(split, {}).get(key, 0) for c in counts.values())

    manifest = dict(meta, prompts_total=len(table.rows),
                    shards_done=len(shards), shards_total=len(shard_ranges(len(table.rows),
                                                                            shard_size)),
                    samples=total("train", "prompts") + total("heldout", "prompts"),
                    train=total("train", "prompts"), heldout=total("heldout", "prompts"),
                    response_tokens=total("train", "response_tokens")
                    + total("heldout", "response_tokens"),
                    per_category=counts, files=files, sha256=combined.hexdigest())
    _write_atomically(folder / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest


def require(folder: Path) -> None:
    """Stop with the command that builds the dataset when `folder` holds none."""
    if not (folder / MANIFEST).is_file() or not (folder / PROMPTS).is_file():
        raise SystemExit(f"no dataset at {folder}: build it with `python -m train data "
                         f"--name {folder.name}` (or pass --data NAME of one that exists)")


def load_manifest(folder: Path) -> dict[str, Any]:
    require(folder)
    return json.loads((folder / MANIFEST).read_text())


def iter_samples(folder: Path) -> Iterable[dict[str, Any]]:
    """Every answered prompt: its metadata row + `prompt_ids` + `response_ids`."""
    require(folder)
    table = PromptTable.load(folder)
    size = load_manifest(folder)["shard_size"]
    for i in done_shards(folder):
        for j, resp in enumerate(load_shard(folder, i)):
            k = i * size + j
            yield dict(table.rows[k], prompt_ids=table.ids[k], response_ids=resp)


def write_dataset(folder: Path, rows: list[dict[str, Any]], meta: dict[str, Any]
                  ) -> dict[str, Any]:
    """Write finished rows (metadata + `prompt_ids` + `response_ids`) as one dataset."""
    table = PromptTable([{k: str(r.get(k, "")) for k in ROW_FIELDS} for r in rows],
                        [list(r["prompt_ids"]) for r in rows])
    table.save(folder)
    size = max(1, len(rows))
    save_shard(folder, 0, [list(r["response_ids"]) for r in rows])
    return write_manifest(folder, dict(meta, shard_size=size))
