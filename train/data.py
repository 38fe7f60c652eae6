"""Training data: prompts in five categories and the target's own responses (greedy,
or sampled at `--temperature`).

`python -m train data` builds (once) the prompt table of a dataset folder
(`train.dataset_store`), then answers it shard by shard through vLLM. Each Ray
worker holds one engine (`Answerer`) and keeps it full across shard boundaries
(continuous batching, two shards in flight), so the batch never drains at the
end of a shard; the driver writes each shard the moment it is complete. Running
the command again on the same folder, here or on a machine that has only the
committed files, answers exactly the shards that are missing.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm_carryover.train import dataset_store as store
from vllm_carryover.train.answerer import Answerer, engine_kwargs
from vllm_carryover.train.prompts import MAX_PROMPT_TOKENS, Prompt, prompt_token_ids

from vllm_carryover.dtype import resolve_dtype
from vllm_carryover.lookups.suffix import SEED_ANSWERS

if TYPE_CHECKING:
    from collections.abc import Iterator

# Re-exported: the dataset's reader API.
load_manifest = store.load_manifest
write_dataset = store.write_dataset
MANIFEST_FILE = store.MANIFEST
KEPT_META = ("target", "seed", "sources", "self_prompts", "prompts_from")  # across runs


def load_samples(data: Path, split: str | None = None) -> list[dict[str, Any]]:
    """Every answered prompt of a dataset (optionally one split), in table order."""
    return [r for r in store.iter_samples(data) if split is None or r["split"] == split]


def train_samples(folder: Path) -> Iterator[dict[str, Any]]:
    """The train split's answered prompts, in table order: what a draft vocabulary
    and the suffix seed learn from (held-out responses stay unseen)."""
    return (r for r in store.iter_samples(folder) if r["split"] == "train")


def response_token_counts(folder: Path, vocab_size: int) -> Any:
    """How often the target wrote each token in the train split's responses (a draft
    vocabulary's ranking)."""
    from vllm_carryover.drafter.vocab import token_counts

    return token_counts((r["response_ids"] for r in train_samples(folder)), vocab_size)


def suffix_seed(folder: Path, max_answers: int = SEED_ANSWERS) -> list[list[int]]:
    """Up to `max_answers` of the train split's responses for the suffix lookup's answer
    tree, in a fixed random order: the tree keeps the last ones it is fed, so any tail
    of this order is a uniform sample of the categories."""
    answers = [r["response_ids"] for r in train_samples(folder)]
    order = np.random.default_rng(0).permutation(len(answers))[:max_answers]
    return [answers[i] for i in order]


def answer(folder: Path, target: str, *, max_tokens: int, shard_size: int,
           workers: int = 1, cpus_per_worker: int = 2, ray_address: str | None = None,
           max_model_len: int = 2560, kv_cache_gib: float = 4.0, max_num_seqs: int = 256,
           dtype: str = "auto", meta: dict[str, Any] | None = None,
           stop_after: int = 0, temperature: float = 0.0,
           shards: tuple[int, int] | None = None) -> dict[str, Any]:
    """Answer the missing shards of `folder`'s prompt table (only those in the index
    range `shards` if given, at most `stop_after` of them if set), writing each as it
    completes; return the manifest. `temperature` 0 is greedy."""
    import ray
    from vllm_carryover.train.ray_shards import ray_session

    table = store.PromptTable.load(folder)
    ranges = store.shard_ranges(len(table.ids), shard_size)
    lo, hi = shards or (0, len(ranges))
    wanted = range(lo, min(hi, len(ranges)))
    done_before = set(store.done_shards(folder))
    todo = [i for i in wanted if i not in done_before]
    print(f"{len(wanted) - len(todo)}/{len(wanted)} shards already answered; "
          f"{len(todo)} to go" + (f", {min(stop_after, len(todo))} in this run"
                                  if stop_after else ""), flush=True)
    todo = todo[:stop_after] if stop_after else todo
    meta = dict(meta or {}, shard_size=shard_size, max_tokens=max_tokens,
                sampling=sampling_name(temperature))
    store.write_manifest(folder, meta)  # a copy taken before the first shard can resume
    if todo:
        engine = engine_kwargs(target, max_model_len, kv_cache_gib, max_num_seqs,
                               resolve_dtype(dtype))
        with ray_session(workers, cpus_per_worker, ray_address):
            actor = ray.remote(num_cpus=cpus_per_worker)(Answerer)
            pool = [actor.remote(engine, max_tokens, temperature=temperature)
                    for _ in range(min(workers, len(todo)))]
            shards = ShardFeed(todo)

            def feed(a: Any) -> None:
                i = shards.next_for(a)
                if i is not None:
                    a.add.remote(i, table.ids[slice(*ranges[i])])

            for a in pool:  # two shards in flight per engine: the batch never drains
                feed(a)
                feed(a)
            waiting = {a.next_done.remote(): a for a in pool}
            start, tokens, busy, done = time.perf_counter(), 0, 0.0, 0
            while waiting:
                ref, _ = ray.wait(list(waiting), num_returns=1)
                a = waiting.pop(ref[0])
                index, responses, stats = ray.get(ref[0])
                shards.answered(a)
                store.save_shard(folder, index, responses)
                done += 1
                tokens += stats["output_tokens"]
                busy += stats["seconds"]
                print(f"shard {index}: {len(responses)} responses, "
                      f"{sum(map(len, responses))} tokens; {done}/{len(todo)} shards; "
                      f"{tokens * len(pool) / busy:.0f} output tok/s while generating, "
                      f"{tokens / (time.perf_counter() - start):.0f} since start "
                      "(engine start included)", flush=True)
                store.write_manifest(folder, meta)
                feed(a)
                if shards.in_flight(a):
                    waiting[a.next_done.remote()] = a
    return store.write_manifest(folder, meta)


class ShardFeed:
    """Which shard each engine answers next, and how many it holds unanswered.

    The driver may wait on an engine only while it holds a shard: an engine
    asked for its next answer with nothing queued would step an empty batch
    forever. Counting per engine (not shards left overall) matters at the end,
    when one engine has drained while another still holds two shards.
    """

    def __init__(self, todo: list[int]) -> None:
        self.queue = list(todo)
        self.held: dict[Any, int] = {}

    def next_for(self, engine: Any) -> int | None:
        """The next unassigned shard, now held by `engine`; None when all are assigned."""
        if not self.queue:
            return None
        self.held[engine] = self.held.get(engine, 0) + 1
        return self.queue.pop(0)

    def answered(self, engine: Any) -> None:
        self.held[engine] -= 1

    def in_flight(self, engine: Any) -> int:
        return self.held.get(engine, 0)


def sampling_name(temperature: float) -> str:
    """How a dataset's responses were drawn, as its manifest records it."""
    return f"temperature {temperature:g}" if temperature else "greedy"


def temperature_of(sampling: str) -> float:
    """The temperature a manifest's `sampling` entry names (`sampling_name`'s inverse)."""
    return 0.0 if sampling == "greedy" else float(sampling.split()[1])


def shard_range(text: str) -> tuple[int, int]:
    """`START:END` (shard indices, END excluded) for --shards."""
    start, sep, end = text.partition(":")
    if not sep or not start.isdigit() or not end.isdigit() or int(start) >= int(end):
        raise ValueError(f"--shards takes START:END with START < END (got {text!r})")
    return int(start), int(end)


def build_table(folder: Path, target: str, prompts: list[Prompt], max_prompt_tokens: int
                ) -> store.PromptTable:
    """Tokenize and save the prompt table (prompts longer than the limit dropped)."""
    ids = prompt_token_ids(target, prompts)
    keep = [(p, i) for p, i in zip(prompts, ids, strict=True) if len(i) <= max_prompt_tokens]
    table = store.PromptTable([{k: v for k, v in asdict(p).items() if k in store.ROW_FIELDS}
                               for p, _ in keep], [i for _, i in keep])
    folder.mkdir(parents=True, exist_ok=True)
    table.save(folder)
    return table


DATA_HELP = """\
Build or continue a training dataset: prompts in five categories (chat, code,
math, translation, general; train and held-out prompts from disjoint units, see
train/prompts.py), plus prompts the target writes itself, then the target's
answers through vLLM (greedy, or sampled with --temperature), in resumable shards.

--prompts-from DATASET starts a new folder with another dataset's prompt table:
the same prompts answered another way (e.g. sampled), shard for shard.

The first run writes the prompt table (prompts.npz); every run answers the
shards that are still missing (responses/shard-NNNNN.npz) and rewrites
manifest.json, so an interrupted run continues where it stopped, also on
another machine from the committed files. Generation is spread over Ray
workers (a local Ray instance, or a cluster with --ray-address), one engine per
worker. Target states are not part of the dataset: training computes them
(`python -m train baseline --help`).
"""


def add_cli(sub: Any) -> None:
    """The `data` subcommand of `python -m train`."""
    import argparse

    from vllm_carryover.train.paths import DEFAULT_DATA
    from vllm_carryover.train.prompts import CATEGORIES

    d = sub.add_parser("data", help="prompts + the target's responses, in shards",
                       description=DATA_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("--target", help="target folder (default: the testbed SmolLM2 folder)")
    d.add_argument("--name", default=DEFAULT_DATA,
                   help="dataset name: train/datasets/NAME if it exists there, else the "
                   "cache (default: %(default)s)")
    d.add_argument("--out", help="dataset folder (overrides --name)")
    d.add_argument("--num-train", type=int, default=4500, help="train prompts per category")
    d.add_argument("--num-eval", type=int, default=100, help="held-out prompts per category")
    d.add_argument("--self-prompts", type=int, default=0,
                   help="extra general prompts written by the target (Magpie-style), "
                   "deduplicated; 12%% of them held out")
    d.add_argument("--categories", nargs="+", default=list(CATEGORIES), choices=CATEGORIES)
    d.add_argument("--max-tokens", type=int,
                   help="response length limit (default: the dataset's own when continuing, "
                   "else 256)")
    d.add_argument("--max-prompt-tokens", type=int, default=MAX_PROMPT_TOKENS,
                   help="longer prompts are dropped (default: %(default)s)")
    d.add_argument("--shard-size", type=int,
                   help="prompts per response shard (default: the dataset's own when "
                   "continuing, else 512)")
    d.add_argument("--stop-after", type=int, default=0,
                   help="answer at most this many shards in this invocation (0: all)")
    d.add_argument("--shards", type=shard_range, metavar="START:END",
                   help="answer only the missing shards with index START..END-1 (default: all)")
    d.add_argument("--temperature", type=float, metavar="T",
                   help="sampling temperature of the responses; 0 is greedy (default: the "
                   "dataset's own when continuing, else 0)")
    d.add_argument("--prompts-from", metavar="DATASET",
                   help="a new folder starts with this dataset's prompt table (a name or a "
                   "folder) instead of building one")
    d.add_argument("--dtype", default="auto",
                   help="generation dtype; auto: bfloat16 on a GPU or a CPU with native bf16 "
                   "matmuls, else float32 (default: %(default)s)")
    d.add_argument("--max-num-seqs", type=int, default=256,
                   help="requests in one engine batch (default: %(default)s)")
    d.add_argument("--kv-cache-gib", type=float, default=4.0)
    d.add_argument("--workers", type=int, default=1, help="Ray workers, one engine each")
    d.add_argument("--cpus-per-worker", type=int, default=2)
    d.add_argument("--ray-address", help="an existing Ray cluster (default: start a local one)")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(fn=run_cli)


def run_cli(a: Any) -> None:
    from vllm_carryover.train.paths import data_dir
    from vllm_carryover.train.prompts import build_prompts, dedupe

    from vllm_carryover.tools.testbed import smollm2_path

    target = a.target or str(smollm2_path())
    folder = Path(a.out) if a.out else data_dir(a.name)
    if (folder / store.PROMPTS).is_file():
        n = len(store.PromptTable.load(folder).rows)
        print(f"{folder}: continuing ({n} prompts in its table)", flush=True)
        known = (store.load_manifest(folder) if (folder / store.MANIFEST).is_file() else {})
        meta = {k: known[k] for k in KEPT_META if k in known}
        if "sampling" in known:
            known["temperature"] = temperature_of(known["sampling"])
        for key in ("shard_size", "max_tokens", "temperature"):  # every shard made alike
            given, have = getattr(a, key), known.get(key)
            if given is not None and have is not None and given != have:
                flag = "--" + key.replace("_", "-")
                raise SystemExit(f"{folder} was made with {flag} {have:g}; drop {flag} or "
                                 f"pass {flag} {have:g}")
            setattr(a, key, given if given is not None else have)
    elif a.prompts_from:
        source = Path(a.prompts_from)
        source = source if source.is_dir() else data_dir(a.prompts_from)
        known = store.load_manifest(source)
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / store.PROMPTS, folder / store.PROMPTS)
        print(f"prompt table: {known['prompts_total']} prompts of {source}", flush=True)
        meta = {k: known[k] for k in KEPT_META if k in known} | {"prompts_from": source.name}
        a.shard_size = a.shard_size or known["shard_size"]  # shard N holds the same prompts
        a.max_tokens = a.max_tokens or known["max_tokens"]
    else:
        t = time.perf_counter()
        prompts = build_prompts(a.num_train, a.num_eval, a.seed, tuple(a.categories))
        if a.self_prompts:
            from vllm_carryover.train.self_prompts import self_prompts

            prompts = dedupe(prompts + self_prompts(target, a.self_prompts, a.seed))
        table = build_table(folder, target, prompts, a.max_prompt_tokens)
        print(f"prompt table: {len(table.rows)} prompts in {time.perf_counter() - t:.0f} s",
              flush=True)
        meta = {"target": os.path.basename(target.rstrip("/")), "seed": a.seed,
                "self_prompts": a.self_prompts,
                "sources": "see train/prompts.py; split units: conversation, module file, "
                "generator + seed, Bible book, catalog domain, package"}
    a.shard_size, a.max_tokens = a.shard_size or 512, a.max_tokens or 256
    manifest = answer(folder, target, max_tokens=a.max_tokens, shard_size=a.shard_size,
                      workers=a.workers, cpus_per_worker=a.cpus_per_worker,
                      ray_address=a.ray_address, kv_cache_gib=a.kv_cache_gib,
                      max_num_seqs=a.max_num_seqs, dtype=a.dtype,
                      max_model_len=a.max_prompt_tokens + a.max_tokens, meta=meta,
                      stop_after=a.stop_after, temperature=a.temperature or 0.0,
                      shards=a.shards)
    print(json.dumps({k: manifest[k] for k in ("samples", "train", "heldout",
                                               "response_tokens", "shards_done",
                                               "shards_total")}, indent=2))
    print(folder)
