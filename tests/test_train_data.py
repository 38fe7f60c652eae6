"""`python -m train data`: five categories, disjoint splits, compact resumable shards."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from vllm_carryover.train import dataset_store as store
from vllm_carryover.train.answerer import Answerer
from vllm_carryover.train.data import ShardFeed, load_samples
from vllm_carryover.train.prompts import (
    CATEGORIES,
    EVAL_BOOKS,
    Prompt,
    build_prompts,
    dedupe,
    split_of,
)
from vllm_carryover.train.self_prompts import usable
from vllm_carryover.train.sword_bible import verse_pairs


def test_bible_verses_are_aligned_and_tagged_by_book() -> None:
    pairs = verse_pairs()
    assert len(pairs) > 30_000
    assert len({p.book for p in pairs}) == 66
    first = pairs[0]
    assert (first.book, first.english) == ("Gen", "In the beginning God created the heaven "
                                           "and the earth.")
    assert first.spanish.startswith("EN el principio")
    assert all("<" not in p.english and "<" not in p.spanish for p in pairs[:2000])


@pytest.fixture(scope="module")
def prompts() -> list[Prompt]:
    return build_prompts(num_train=12, num_eval=4, seed=3)


def test_train_and_eval_prompts_share_no_split_unit(prompts: list[Prompt]) -> None:
    for cat in CATEGORIES:
        for split, n in (("train", 12), ("heldout", 4)):
            assert sum(p.category == cat and p.split == split for p in prompts) == n, (cat, split)
    train = {p.group for p in prompts if p.split == "train"}
    heldout = {p.group for p in prompts if p.split == "heldout"}
    assert not train & heldout
    bible = [p for p in prompts if p.group.removeprefix("translation-") in verse_books()]
    assert bible, "no Bible prompts drawn"
    assert all((p.split == "heldout") == (p.group.removeprefix("translation-") in EVAL_BOOKS)
               for p in bible)
    for p in prompts:  # every other unit's split is the hash rule's
        if p not in bible:
            assert p.split == split_of(p.group) or p.group.startswith(("math-", "general-")), p
    assert build_prompts(12, 4, 3) == prompts  # seeded: the same data every time


def verse_books() -> set[str]:
    return {v.book for v in verse_pairs()}


def test_split_is_a_function_of_the_unit_alone() -> None:
    units = [f"unit-{i}" for i in range(20_000)]
    splits = [split_of(u) for u in units]
    assert splits == [split_of(u) for u in units]
    assert 0.10 < splits.count("heldout") / len(units) < 0.14


def test_prompts_are_deduplicated_by_text(prompts: list[Prompt]) -> None:
    keys = [" ".join(p.messages[-1]["content"].lower().split()) for p in prompts]
    assert len(set(keys)) == len(keys)
    a = Prompt("a", "u1", "chat", "train", [{"role": "user", "content": "Hello  there"}])
    b = Prompt("b", "u2", "chat", "train", [{"role": "user", "content": "hello there"}])
    c = Prompt("c", "u3", "chat", "train", [{"role": "user", "content": "hello you"}])
    assert dedupe([a, b, c]) == [a, c]


def test_self_written_prompts_are_filtered() -> None:
    assert usable("Can you provide me with a checklist for a wedding ceremony?")
    assert not usable("Hi")  # too short
    assert not usable("the cat the cat the cat the cat the cat the cat the cat")  # a loop
    assert not usable("¿Puedes ayudarme con la traducción de este párrafo, señor?")  # not English
    assert not usable("1234 5678 9012 3456 7890 1234 5678")  # not words


def rows_with(vocab: int, n: int = 7) -> list[dict]:
    rng = np.random.default_rng(vocab)
    return [{"id": f"r{i}", "group": f"g{i % 3}", "category": ("chat", "math")[i % 2],
             "split": ("train", "heldout")[i % 3 == 0],
             "prompt_ids": rng.integers(0, vocab, rng.integers(1, 30)).tolist(),
             "response_ids": rng.integers(0, vocab, rng.integers(0, 20)).tolist()}
            for i in range(n)]


@pytest.mark.parametrize("vocab,dtype", [(49_152, np.uint16), (151_936, np.uint32)])
def test_compact_format_round_trips(tmp_path: Path, vocab: int, dtype: type) -> None:
    rows = rows_with(vocab)
    manifest = store.write_dataset(tmp_path, rows, {"target": "t"})
    assert load_samples(tmp_path) == rows
    assert load_samples(tmp_path, "heldout") == [r for r in rows if r["split"] == "heldout"]
    with np.load(tmp_path / store.PROMPTS) as z:
        assert z["tokens"].dtype == dtype
    assert manifest["samples"] == len(rows)
    assert manifest["response_tokens"] == sum(len(r["response_ids"]) for r in rows)
    assert manifest["per_category"]["chat"]["train"]["prompts"] == sum(
        r["category"] == "chat" and r["split"] == "train" for r in rows)
    for name, sha in manifest["files"].items():
        assert store.file_sha256(tmp_path / name) == sha


def test_a_half_written_shard_counts_as_missing(tmp_path: Path) -> None:
    store.write_dataset(tmp_path, rows_with(100), {"target": "t"})
    (tmp_path / store.RESPONSES / "shard-00001.tmp").write_bytes(b"cut off by a kill")
    assert store.done_shards(tmp_path) == [0]


def test_an_engine_is_waited_on_only_while_it_holds_a_shard() -> None:
    """The interleaving that once hung data generation: the queue empties at B's
    refill, then A answers both its shards while B still holds two. A must not be
    waited on again (its engine would step an empty batch forever); B must."""
    feed = ShardFeed(list(range(5)))
    assert [feed.next_for("A"), feed.next_for("A"), feed.next_for("B"), feed.next_for("B")] \
        == [0, 1, 2, 3]
    feed.answered("B")
    assert feed.next_for("B") == 4 and feed.next_for("B") is None
    feed.answered("A")
    assert feed.in_flight("A") == 1
    feed.answered("A")
    assert feed.in_flight("A") == 0 and feed.in_flight("B") == 2


def test_an_answerer_with_nothing_queued_says_so_instead_of_waiting() -> None:
    answerer = Answerer.__new__(Answerer)  # no engine needed: it must not be reached
    answerer.pending = {}
    with pytest.raises(RuntimeError, match="no shard queued"):
        answerer.next_done()


def data_cmd(smollm2: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "train", "data", "--target", str(smollm2), "--out", str(out),
            "--num-train", "2", "--num-eval", "1", "--categories", "chat", "math",
            "translation", "--max-tokens", "48", "--shard-size", "1", "--dtype", "float32",
            "--max-num-seqs", "8", "--kv-cache-gib", "0.25", *extra]


def test_killed_generation_resumes_to_the_uninterrupted_result(
        smollm2: Path, tmp_path: Path) -> None:
    """Run A answers everything on two Ray workers (one engine each). Run B starts from
    A's committed prompt table alone (as a fresh clone would), is SIGKILLed once its
    first shard is on disk, and is run again: it answers only the missing shards and
    ends with exactly A's responses."""
    env = {**os.environ, "VLLM_CARRYOVER_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # not this pytest worker's one core for both
    a, b = tmp_path / "a", tmp_path / "b"
    proc = subprocess.run(data_cmd(smollm2, a, "--workers", "2", "--cpus-per-worker", "1"),
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert len({line.split("Answerer pid=")[1].split(")")[0] for line in log.splitlines()
                if "Answerer pid=" in line}) == 2  # both workers ran an engine
    full = load_samples(a)
    manifest = store.load_manifest(a)
    assert manifest["shards_done"] == manifest["shards_total"] == len(full) == 9
    assert all(1 <= len(r["response_ids"]) <= 48 for r in full)

    b.mkdir()
    for name in (store.PROMPTS, store.MANIFEST):
        shutil.copy(a / name, b / name)
    shutil.rmtree(b / store.RESPONSES, ignore_errors=True)
    killed = subprocess.Popen(data_cmd(smollm2, b), env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while not store.done_shards(b) and time.monotonic() < deadline and killed.poll() is None:
        time.sleep(0.05)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    first = store.done_shards(b)
    assert 1 <= len(first) < 9, first
    resumed = subprocess.run(data_cmd(smollm2, b), env=env, capture_output=True, text=True,
                             timeout=900, check=False)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"{len(first)}/9 shards already answered" in resumed.stdout
    assert load_samples(b) == full
    assert store.load_manifest(b)["sha256"] == manifest["sha256"]


def test_continuing_with_other_shard_settings_is_refused(smollm2: Path, tmp_path: Path) -> None:
    store.write_dataset(tmp_path, rows_with(100),
                        {"target": "t", "max_tokens": 48, "sampling": "greedy"})
    for flag, value in (("--shard-size", "3"), ("--max-tokens", "9"), ("--temperature", "1")):
        proc = subprocess.run([sys.executable, "-m", "train", "data", "--target", str(smollm2),
                               "--out", str(tmp_path), flag, value],
                              capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 1
        assert f"was made with {flag}" in proc.stderr and "Traceback" not in proc.stderr


def test_the_same_prompts_are_answered_sampled_in_a_shard_range(
        smollm2: Path, tmp_path: Path) -> None:
    """--prompts-from starts a dataset with another's prompt table (and its shard size),
    --temperature samples the answers and the manifest says so, --shards answers only
    that index range, and continuing at another temperature is refused."""
    source, sampled = tmp_path / "greedy", tmp_path / "sampled"
    rows = rows_with(1000, n=8)
    table = store.PromptTable([{k: r[k] for k in store.ROW_FIELDS} for r in rows],
                              [r["prompt_ids"] for r in rows])
    source.mkdir()
    table.save(source)
    store.write_manifest(source, {"target": "t", "seed": 0, "shard_size": 2, "max_tokens": 8,
                                  "sampling": "greedy"})
    env = {**os.environ, "VLLM_CARRYOVER_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "train", "data", "--target", str(smollm2), "--out", str(sampled)]
    proc = subprocess.run([*cmd, "--prompts-from", str(source), "--temperature", "1",
                           "--shards", "1:3", "--dtype", "float32", "--max-num-seqs", "8",
                           "--kv-cache-gib", "0.25"],
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert store.done_shards(sampled) == [1, 2]
    assert store.PromptTable.load(sampled).ids == table.ids
    manifest = store.load_manifest(sampled)
    assert manifest["sampling"] == "temperature 1" and manifest["prompts_from"] == "greedy"
    assert (manifest["shard_size"], manifest["max_tokens"]) == (2, 8)
    assert all(1 <= len(r["response_ids"]) <= 8 for r in load_samples(sampled))
    refused = subprocess.run([*cmd, "--temperature", "0"], env=env, capture_output=True,
                             text=True, timeout=300, check=False)
    assert refused.returncode == 1
    assert "was made with --temperature 1" in refused.stderr, refused.stderr[-2000:]
