"""`python -m train data`: four categories, disjoint splits, Ray-sharded generation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from train.prompts import CATEGORIES, EVAL_BOOKS, build_prompts
from train.ray_shards import split_even
from train.sword_bible import verse_pairs


def test_bible_verses_are_aligned_and_tagged_by_book() -> None:
    pairs = verse_pairs()
    assert len(pairs) > 30_000
    assert len({p.book for p in pairs}) == 66
    first = pairs[0]
    assert (first.book, first.english) == ("Gen", "In the beginning God created the heaven "
                                           "and the earth.")
    assert first.spanish.startswith("EN el principio")
    assert all("<" not in p.english and "<" not in p.spanish for p in pairs[:2000])


def test_train_and_eval_prompts_share_no_split_unit() -> None:
    prompts = build_prompts(num_train=12, num_eval=4, seed=3)
    for cat in CATEGORIES:
        for split, n in (("train", 12), ("heldout", 4)):
            assert sum(p.category == cat and p.split == split for p in prompts) == n, (cat, split)
    train = {p.group for p in prompts if p.split == "train"}
    heldout = {p.group for p in prompts if p.split == "heldout"}
    assert not train & heldout
    books = {p.group.removeprefix("translation-") for p in prompts
             if p.category == "translation"}
    assert {b for b in books if b in EVAL_BOOKS} == {
        p.group.removeprefix("translation-") for p in prompts
        if p.category == "translation" and p.split == "heldout"}
    assert build_prompts(12, 4, 3) == prompts  # seeded: the same data every time


def test_split_even_keeps_order_and_sizes() -> None:
    assert split_even(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_even([1], 4) == [[1]]


def test_data_command_shards_generation_and_states_over_two_ray_workers(
        smollm2: Path, tmp_path: Path) -> None:
    env = {**os.environ, "VLLM_CARRYOVER_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "train", "data", "--target", str(smollm2), "--name", "tiny",
           "--num-train", "2", "--num-eval", "1", "--max-tokens", "8", "--layers", "1", "3",
           "--workers", "2", "--cpus-per-worker", "1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    folder = tmp_path / "train" / "data" / "tiny"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["samples"] == 12 and manifest["heldout"] == 4
    assert set(manifest["per_category"]) == set(CATEGORIES)
    rows = [json.loads(x) for x in (folder / "samples.jsonl").read_text().splitlines()]
    assert all(1 <= len(r["response_ids"]) <= 8 for r in rows)
    # both shards ran (one vLLM engine each) and the states came back in row order
    assert proc.stderr.count("_generate_shard pid=") > 0
    assert len({line.split("pid=")[1].split(")")[0] for line in proc.stderr.splitlines()
                if "_generate_shard pid=" in line}) == 2
    (states_file,) = folder.glob("states-*.pt")
    saved = torch.load(states_file)
    assert saved["layer_ids"] == [1, 3]
    assert saved["lengths"] == [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]
    assert all(s.shape == (n, 2 * 576) and s.dtype == torch.bfloat16
               for s, n in zip(saved["states"], saved["lengths"], strict=True))
