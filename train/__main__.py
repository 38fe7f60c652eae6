"""`python -m train {data,baseline,carryover,export,eval-vllm}`: the drafter training pipeline."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from train.paths import CHECKPOINTS


def default_target() -> str:
    """The testbed target folder (SmolLM2-135M-Instruct), built if needed."""
    out = subprocess.run([sys.executable, "-m", "vllm_carryover.testbed"], check=True,
                         capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def cmd_data(a: argparse.Namespace) -> None:
    from train import data
    from train.paths import data_dir

    target = a.target or default_target()
    prompts = data.build_prompts(a.num_chat, a.num_templated, a.seed)
    heldout = data.split_groups(prompts, a.heldout_frac, a.seed)
    rows = data.generate(target, prompts, a.max_tokens)
    meta = {"target": target, "seed": a.seed, "num_chat": a.num_chat,
                "num_templated": a.num_templated, "max_tokens": a.max_tokens,
                "heldout_frac": a.heldout_frac, "sampling": "greedy"}
    manifest = data.write_dataset(data_dir(a.name), rows, heldout, meta)
    print(json.dumps(manifest, indent=2))
    print(data_dir(a.name))


def cmd_baseline(a: argparse.Namespace) -> None:
    from train.baseline import BaselineArgs, train_baseline

    args = BaselineArgs(**{k: v for k, v in vars(a).items()
                           if k in BaselineArgs.__dataclass_fields__})
    if not args.target:
        args.target = default_target()
    print(train_baseline(args))


def cmd_carryover(a: argparse.Namespace) -> None:
    from train.carryover import CarryoverArgs, train_carryover

    args = CarryoverArgs(**{k: v for k, v in vars(a).items()
                            if k in CarryoverArgs.__dataclass_fields__})
    if not args.target:
        args.target = default_target()
    print(train_carryover(args))


def cmd_export(a: argparse.Namespace) -> None:
    from train.export import export
    from train.paths import run_dir

    print(export(run_dir(a.run) / "final.pt", Path(a.out), a.target or default_target()))


def cmd_eval_vllm(a: argparse.Namespace) -> None:
    from train.vllm_eval import evaluate

    print(json.dumps(evaluate(a.target or default_target(), a.drafter, a.data, a.methods,
                              a.num_prompts, a.max_tokens, a.k, a.category), indent=2))


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    p = argparse.ArgumentParser(prog="python -m train", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("data", help="prompts + the target's greedy responses + manifest")
    d.add_argument("--target", help="target folder (default: the testbed SmolLM2 folder)")
    d.add_argument("--name", default="smollm2-chat-v1", help="dataset name in the cache")
    d.add_argument("--num-chat", type=int, default=400)
    d.add_argument("--num-templated", type=int, default=200)
    d.add_argument("--max-tokens", type=int, default=192)
    d.add_argument("--heldout-frac", type=float, default=0.1)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(fn=cmd_data)

    b = sub.add_parser("baseline", help="train a plain DFlash drafter")
    b.add_argument("--target")
    b.add_argument("--data", default="smollm2-chat-v1", help="dataset name in the cache")
    b.add_argument("--run", default="smollm2-dflash-baseline", help="run name in the cache")
    b.add_argument("--layers", type=int, default=1)
    b.add_argument("--block-size", type=int, default=8)
    b.add_argument("--intermediate-size", type=int, default=1024)
    b.add_argument("--target-layers", type=int, nargs="+")
    b.add_argument("--steps", type=int, default=400)
    b.add_argument("--minutes", type=float, default=0.0,
                   help="stop after this much training time (0: run all steps)")
    b.add_argument("--seqs-per-step", type=int, default=4)
    b.add_argument("--anchors-per-seq", type=int, default=32)
    b.add_argument("--lr", type=float, default=1e-3)
    b.add_argument("--warmup", type=int, default=20)
    b.add_argument("--gamma", type=float, default=4.0)
    b.add_argument("--eval-every", type=int, default=100)
    b.add_argument("--no-vocab-subset", dest="vocab_subset", action="store_false",
                   help="full-vocabulary softmax in training (slower on CPU)")
    b.add_argument("--num-negatives", type=int, default=4096,
                   help="random extra tokens per step in the sampled softmax")
    b.add_argument("--init-run", default="",
                   help="continue training from this run's final.pt (fresh LR schedule)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--threads", type=int, default=2)
    b.set_defaults(fn=cmd_baseline)

    c = sub.add_parser(
        "carryover", help="fine-tune a drafter with parallel draft-verify-draft",
        description="Carryover training: per sequence and for all anchors at once, draft "
        "(greedy), verify against the data's tokens, run the target once over all rejected "
        "drafts (block-sparse mask) and draft again from the next anchor with those rejected "
        "states carried over. Loss: second draft + --first-draft-weight x first draft. Needs "
        "the target in memory (float32); costs one extra target pass per sequence.")
    c.add_argument("--target")
    c.add_argument("--data", default="smollm2-chat-v1", help="dataset name in the cache")
    c.add_argument("--run", default="smollm2-carryover", help="run name in the cache")
    c.add_argument("--init", default=str(CHECKPOINTS / "smollm2-135m-instruct"
                                         / "dflash-baseline"),
                   help="start from this drafter folder, or a run name in the cache "
                   "(its final.pt); default: the shipped SmolLM2 baseline drafter")
    c.add_argument("--steps", type=int, default=200)
    c.add_argument("--minutes", type=float, default=0.0,
                   help="stop after this much training time (0: run all steps)")
    c.add_argument("--seqs-per-step", type=int, default=4)
    c.add_argument("--anchors-per-seq", type=int, default=32)
    c.add_argument("--lr", type=float, default=3e-4)
    c.add_argument("--warmup", type=int, default=10)
    c.add_argument("--gamma", type=float, default=4.0)
    c.add_argument("--first-draft-weight", type=float, default=1.0,
                   help="lambda: weight of the plain (empty-slot) first-draft loss")
    c.add_argument("--rejected-lr-mult", type=float, default=10.0,
                   help="learning-rate multiplier of the rejected embedding (starts at zero)")
    c.add_argument("--eval-every", type=int, default=50)
    c.add_argument("--eval-anchors-per-seq", type=int, default=16)
    c.add_argument("--no-vocab-subset", dest="vocab_subset", action="store_false",
                   help="full-vocabulary softmax in training (slower on CPU)")
    c.add_argument("--num-negatives", type=int, default=4096)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--threads", type=int, default=2)
    c.set_defaults(fn=cmd_carryover)

    e = sub.add_parser("export", help="write a trained run as a drafter folder (bf16)")
    e.add_argument("--target")
    e.add_argument("--run", default="smollm2-dflash-baseline")
    e.add_argument("--out", default="train/checkpoints/smollm2-135m-instruct/dflash-baseline")
    e.set_defaults(fn=cmd_export)

    v = sub.add_parser("eval-vllm", help="acceptance length of a drafter folder in vLLM")
    v.add_argument("--target")
    v.add_argument("--drafter", default="train/checkpoints/smollm2-135m-instruct/"
                   "dflash-baseline")
    v.add_argument("--data", default="smollm2-chat-v1")
    v.add_argument("--methods", nargs="+", default=["carryover", "dflash"],
                   help="carryover, dflash and/or none (no speculation)")
    v.add_argument("--num-prompts", type=int, default=16)
    v.add_argument("--max-tokens", type=int, default=128)
    v.add_argument("-k", type=int, default=7)
    v.add_argument("--category", default="chat", help="prompt category, or 'all'")
    v.set_defaults(fn=cmd_eval_vllm)

    a = p.parse_args(argv)
    a.fn(a)


if __name__ == "__main__":
    main()
