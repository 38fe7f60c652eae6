"""Training data: prompts in four categories and the target's own greedy responses.

Prompts come from `train.prompts` (chat, code, math, translation, each split
into train and held-out eval sets by conversation, module, seed or book). The
target answers every prompt greedily through vLLM, sharded over Ray workers
(`train.ray_shards`), so the drafter learns the target's own distribution.
`samples.jsonl` holds one row per prompt (its `split` included) and
`manifest.json` what made them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from train.prompts import Prompt
from train.ray_shards import map_shards

SAMPLES_FILE = "samples.jsonl"
MANIFEST_FILE = "manifest.json"


def prompt_token_ids(target: str, prompts: list[Prompt]) -> list[list[int]]:
    """Chat-templated prompt token ids (generation prompt added)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    out = []
    for p in prompts:
        ids = tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out


def _generate_shard(rows: list[dict[str, Any]], target: str, max_tokens: int,
                    max_model_len: int, chunk: int = 96) -> list[dict[str, Any]]:
    """One Ray task: a vLLM engine answers its shard of prompts greedily.

    Batches of `chunk` prompts, one progress line each (Ray forwards lines, not
    the carriage-return updates of a progress bar)."""
    import time

    from vllm import LLM, SamplingParams

    llm = LLM(model=target, dtype="bfloat16", enforce_eager=True,
              max_model_len=max_model_len, kv_cache_memory_bytes=1 << 30, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out: list[dict[str, Any]] = []
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(rows), chunk):
        part = rows[i:i + chunk]
        outs = llm.generate([{"prompt_token_ids": r["prompt_ids"]} for r in part], params,
                            use_tqdm=False)
        for r, o in zip(part, outs, strict=True):
            out.append(dict(r, response_ids=list(o.outputs[0].token_ids),
                            response=o.outputs[0].text))
            tokens += len(o.outputs[0].token_ids)
        print(f"generated {len(out)}/{len(rows)} responses, "
              f"{tokens / (time.perf_counter() - start):.0f} output tok/s", flush=True)
    return out


def generate(target: str, prompts: list[Prompt], max_tokens: int, *, workers: int = 1,
             cpus_per_worker: int = 2, ray_address: str | None = None,
             max_model_len: int = 1024) -> list[dict[str, Any]]:
    """Greedy target responses for all prompts (token ids included), sharded over Ray."""
    ids = prompt_token_ids(target, prompts)
    rows = [dict(asdict(p), prompt_ids=i) for p, i in zip(prompts, ids, strict=True)
            if len(i) + max_tokens <= max_model_len]
    return map_shards(_generate_shard, rows, workers=workers, cpus_per_worker=cpus_per_worker,
                      address=ray_address, desc="generate", target=target,
                      max_tokens=max_tokens, max_model_len=max_model_len)


def write_dataset(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any]
                  ) -> dict[str, Any]:
    """Write `samples.jsonl` (rows carry their `split`) and `manifest.json`; return it."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in rows]
    blob = ("\n".join(lines) + "\n").encode()
    (out / SAMPLES_FILE).write_bytes(blob)
    splits = [json.loads(x)["split"] for x in lines]
    manifest = dict(meta, samples=len(rows), train=splits.count("train"),
                    heldout=splits.count("heldout"),
                    per_category={c: {sp: sum(1 for r in rows if r["category"] == c
                                              and r["split"] == sp) for sp in ("train", "heldout")}
                                  for c in sorted({r["category"] for r in rows})},
                    tokens=sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows),
                    response_tokens=sum(len(r["response_ids"]) for r in rows),
                    sha256=hashlib.sha256(blob).hexdigest())
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def load_samples(data: Path, split: str | None = None) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (data / SAMPLES_FILE).read_text().splitlines() if x]
    return [r for r in rows if split is None or r["split"] == split]


def load_manifest(data: Path) -> dict[str, Any]:
    return json.loads((data / MANIFEST_FILE).read_text())


DATA_HELP = """\
Build a training dataset: prompts in four categories (chat, code, math,
translation; train and held-out eval prompts from disjoint conversations,
module files, generator seeds and Bible books), the target's greedy answers
through vLLM, and the target's hidden states at the drafter's context layers.

Generation and state extraction are sharded over Ray workers: a local Ray
instance by default, or a running cluster with --ray-address. The states are
cached (bf16, in the dataset folder) rather than recomputed per step: training
visits every sequence several times and a target forward per visit would cost
more than the drafter step it feeds.
"""


def add_cli(sub: Any) -> None:
    """The `data` subcommand of `python -m train`."""
    import argparse

    from train.paths import DEFAULT_DATA
    from train.prompts import CATEGORIES

    d = sub.add_parser("data", help="prompts + the target's greedy responses + hidden states",
                       description=DATA_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("--target", help="target folder (default: the testbed SmolLM2 folder)")
    d.add_argument("--name", default=DEFAULT_DATA, help="dataset name in the cache")
    d.add_argument("--num-train", type=int, default=300, help="train prompts per category")
    d.add_argument("--num-eval", type=int, default=24, help="held-out prompts per category")
    d.add_argument("--categories", nargs="+", default=list(CATEGORIES), choices=CATEGORIES)
    d.add_argument("--max-tokens", type=int, default=160, help="response length limit")
    d.add_argument("--layers", type=int, nargs="+",
                   help="target layers to extract states of (default: the drafter default "
                   "for the target, as `python -m train baseline` uses)")
    d.add_argument("--workers", type=int, default=1, help="Ray workers (shards)")
    d.add_argument("--cpus-per-worker", type=int, default=2)
    d.add_argument("--ray-address", help="an existing Ray cluster (default: start a local one)")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(fn=run_cli)


def run_cli(a: Any) -> None:
    from train.paths import data_dir
    from train.prompts import build_prompts
    from train.target_states import dataset_states
    from vllm_carryover.init_drafter import default_target_layers
    from vllm_carryover.testbed import smollm2_path

    target = a.target or str(smollm2_path())
    ray = {"workers": a.workers, "cpus_per_worker": a.cpus_per_worker,
           "ray_address": a.ray_address}
    prompts = build_prompts(a.num_train, a.num_eval, a.seed, tuple(a.categories))
    rows = generate(target, prompts, a.max_tokens, **ray)
    meta = {"target": target, "seed": a.seed, "categories": a.categories,
            "num_train": a.num_train, "num_eval": a.num_eval, "max_tokens": a.max_tokens,
            "sampling": "greedy", "split_units": "chat: conversation, code: module file, "
            "math: generator seed, translation: Bible book"}
    folder = data_dir(a.name)
    manifest = write_dataset(folder, rows, meta)
    layers = a.layers or default_target_layers(
        json.loads((Path(target) / "config.json").read_text())["num_hidden_layers"])
    dataset_states(target, folder, layers, **ray)
    print(json.dumps(manifest, indent=2))
    print(folder)

