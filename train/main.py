"""`python -m train {data,baseline,carryover,export,draft-vocab,suffix-seed,eval,
headroom,lookup-headroom}`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_carryover.train import data, headroom, lookup_headroom, vllm_eval
from vllm_carryover.train.options import BaselineArgs, CarryoverArgs, add_train_options, args_from
from vllm_carryover.train.paths import DEFAULT_DATA, default_target

from vllm_carryover.lookups.suffix import SEED_ANSWERS


def cmd_baseline(a: argparse.Namespace) -> None:
    from vllm_carryover.train.baseline import train_baseline

    _train(train_baseline, args_from(BaselineArgs, a))


def cmd_carryover(a: argparse.Namespace) -> None:
    from vllm_carryover.train.carryover import train_carryover

    _train(train_carryover, args_from(CarryoverArgs, a))


def _train(recipe: Callable[[Any], Path], args: BaselineArgs | CarryoverArgs) -> None:
    """Run a recipe, alone or as one process of `torchrun --nproc-per-node N -m train`."""
    from vllm_carryover.train.device import resolve_device
    from vllm_carryover.train.distributed import is_main, process_group, rank0_first

    with process_group(resolve_device(args.device)):
        if not args.target:
            with rank0_first():  # rank 0 builds the testbed target if it is missing
                args.target = default_target()
        path = recipe(args)
        if is_main():
            print(path)


def cmd_export(a: argparse.Namespace) -> None:
    from vllm_carryover.train.export import export
    from vllm_carryover.train.paths import run_dir

    print(export(run_dir(a.run) / "final.pt", Path(a.out), a.target or default_target(),
                 a.draft_vocab))


def cmd_draft_vocab(a: argparse.Namespace) -> None:
    from vllm_carryover.train.export import convert_to_draft_vocab

    path = convert_to_draft_vocab(a.drafter, Path(a.out), a.target or default_target(),
                                  a.data, a.size)
    meta = json.loads((path / "config.json").read_text())["carryover_config"]["draft_vocab"]
    print(f"draft vocabulary of {a.size} tokens covers {meta['coverage']:.2%} of the "
          f"target's train response tokens in {a.data}", file=sys.stderr)
    print(path)


def cmd_suffix_seed(a: argparse.Namespace) -> None:
    from vllm_carryover.train.data import suffix_seed
    from vllm_carryover.train.paths import data_dir

    from vllm_carryover.lookups.suffix import SEED_FILE, save_seed

    answers = suffix_seed(data_dir(a.data), a.max_answers)
    path = Path(a.drafter) / SEED_FILE
    save_seed(path, answers)
    print(f"{len(answers):,} train responses of {a.data}", file=sys.stderr)
    print(path)


def main(argv: list[str] | None = None, prog: str = "python -m train") -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    data.add_cli(sub)

    b = sub.add_parser(
        "baseline", help="train a plain DFlash drafter",
        description="Plain DFlash training of a new block drafter on the target's own "
        "responses: per step a few sequences, per sequence many anchors (draft blocks) in "
        "parallel. Runs alone or data-parallel under torchrun (--nproc-per-node N; gloo on "
        "the CPU, NCCL on CUDA).")
    add_train_options(b, BaselineArgs())
    b.add_argument("--layers", type=int, default=BaselineArgs.layers,
                   help="decoder layers of a new drafter: a slot can look its bonus token up in "
                   "the context (and continue repeated text) from the second layer on; "
                   "--init-run keeps that drafter's depth (default: %(default)s)")
    b.add_argument("--block-size", type=int, default=BaselineArgs.block_size,
                   help="draft block size: the bonus token + block-size - 1 drafted tokens "
                   "(default: %(default)s)")
    b.add_argument("--intermediate-size", type=int, default=BaselineArgs.intermediate_size,
                   help="drafter MLP width (default: %(default)s)")
    b.add_argument("--target-layers", type=int, nargs="+",
                   help="target layers whose states feed the drafter (default: three spread "
                   "over the depth)")
    b.add_argument("--init-run", default=BaselineArgs.init_run,
                   help="start from this drafter folder (an export: a committed checkpoint "
                   "continues on a fresh machine; or a downloaded DFlash checkpoint), else "
                   "this run's final.pt, else this Hugging Face hub id (a public DFlash "
                   "drafter, resolved as serving resolves it: the HF cache, HF_HUB_OFFLINE), "
                   "with a fresh LR schedule; its drafter config wins (depth, block size, "
                   "target layers); steps and tokens add up in the metadata")
    b.add_argument("--draft-vocab", type=int, default=BaselineArgs.draft_vocab, metavar="N",
                   help="give a new drafter a draft vocabulary from the start: its LM head "
                   "over the N tokens the target writes most often in --data's train "
                   "responses (8192 cover ~99%%); every step's softmax is then over those, "
                   "which makes a CPU step about 2x cheaper than over the data's ~25k "
                   "tokens, and so is drafting; 0: the whole vocabulary (default: "
                   "%(default)s)")
    b.add_argument("--unvisited-weight", type=float, default=BaselineArgs.unvisited_weight,
                   metavar="W", help="loss weight of the blocks a greedy speculative run of "
                   "the current drafter would not anchor at (inside a stretch its previous "
                   "block drafted right); the others weigh 1. Serving meets the hard "
                   "positions after rejections more often than uniform anchors do; W < 1 "
                   "trains toward them. Needs most of each response's anchors "
                   "(--anchors-per-seq) to follow the walk (default: %(default)s)")
    b.add_argument("--bonus-weight", type=float, default=BaselineArgs.bonus_weight,
                   metavar="W", help="loss weight of the bonus token's row, trained to predict "
                   "the token after it as slot 1 does: with two or more layers that row is "
                   "where the slots read the bonus token from (default: %(default)s)")
    b.add_argument("--slot-proposals", action="store_true",
                   help="a new drafter whose block slots hold the suffix lookup's proposals "
                   "instead of the mask token where it has one (train/slot_proposals.py), "
                   "to keep or correct, each with its confidence level in the trees "
                   "(vllm_carryover/lookups/slots.py); each training sequence's proposals "
                   "come from an answer tree without its own answer. A drafter made so "
                   "keeps them when continued; with --init-run of a slot drafter that reads "
                   "no levels, it adds them (their embedding starts at zero)")
    b.set_defaults(fn=cmd_baseline)

    c = sub.add_parser(
        "carryover", help="fine-tune a drafter with parallel draft-verify-draft",
        description="Carryover training: per sequence and for all anchors at once, draft "
        "(greedy), verify against the data's tokens, run the target once over all rejected "
        "drafts (block-sparse mask) and draft again from the next anchor with those rejected "
        "states carried over. Loss: second draft + --first-draft-weight x first draft. Needs "
        "the target in memory (in --dtype, on --device; it also computes the target states "
        "not cached yet); costs one extra target pass per sequence. Runs alone or data-parallel "
        "under torchrun (--nproc-per-node N; gloo on the CPU, NCCL on CUDA).")
    add_train_options(c, CarryoverArgs())
    c.add_argument("--init", default=CarryoverArgs.init,
                   help="start from this drafter folder, else this run's final.pt in the "
                   "cache, else this Hugging Face hub id (resolved as serving resolves it: "
                   "the HF cache, HF_HUB_OFFLINE); a public DFlash drafter (e.g. "
                   "z-lab/Qwen3-8B-DFlash-b16 for Qwen/Qwen3-8B) keeps its depth, block size "
                   "and target layers and gets a rejected embedding, a random direction at "
                   "a context row's norm; default: the shipped SmolLM2 baseline drafter")
    c.add_argument("--first-draft-weight", type=float, default=CarryoverArgs.first_draft_weight,
                   help="lambda: weight of the plain (empty-slot) first-draft loss "
                   "(default: %(default)s)")
    c.add_argument("--rejected-lr-mult", type=float, default=CarryoverArgs.rejected_lr_mult,
                   help="learning-rate multiplier of the rejected embedding, which is new "
                   "while the rest is trained (default: %(default)s)")
    c.add_argument("--hide-carried", action="store_true",
                   help="the control arm: the same recipe, data and steps with the carried "
                   "rows hidden from the second draft (and no verify pass), i.e. the "
                   "baseline continued alike, to set carryover's gain against")
    c.set_defaults(fn=cmd_carryover)

    e = sub.add_parser(
        "export", help="write a trained run as a drafter folder (bf16)",
        description="Write a run's final.pt as a folder vLLM serves: config.json (with the "
        "training metadata under carryover_config) and bf16 model.safetensors, then check "
        "it against the target (hidden size, vocabulary, target layers).")
    e.add_argument("--target", help="target model folder (default: the testbed SmolLM2 folder)")
    e.add_argument("--run", default="smollm2-dflash-baseline",
                   help="run name in the cache (default: %(default)s)")
    e.add_argument("--out", default="train/checkpoints/smollm2-135m-instruct/dflash-baseline",
                   help="output folder; its config.json and model.safetensors are overwritten "
                   "(default: %(default)s)")
    e.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="cut the LM head to the N tokens the target writes most often in the "
                   "run's training data: a cheaper drafting step, same output (default: 0, "
                   "the whole vocabulary)")
    e.set_defaults(fn=cmd_export)

    v = sub.add_parser(
        "draft-vocab", help="a drafter with its LM head cut to the tokens the target writes",
        description="Copy a drafter folder (or hub id) with a draft vocabulary: its LM head "
        "over the --size tokens the target wrote most often in the dataset's train responses "
        "(end tokens always kept), the d2t map, bf16 weights. Verification is unchanged, so "
        "is the output; the drafting step gets cheaper. Exact on the kept tokens, since a "
        "drafter's LM head is the target's.")
    v.add_argument("--drafter", required=True, help="drafter folder or hub id to convert")
    v.add_argument("--out", required=True, help="folder to write")
    v.add_argument("--size", type=int, default=8192,
                   help="tokens in the draft vocabulary (default: %(default)s)")
    v.add_argument("--data", default=DEFAULT_DATA,
                   help="dataset whose responses rank the tokens (default: %(default)s)")
    v.add_argument("--target", help="target model folder (default: the testbed SmolLM2 folder)")
    v.set_defaults(fn=cmd_draft_vocab)

    t = sub.add_parser(
        "suffix-seed", help="the suffix lookup's first answers, written into a drafter folder",
        description="Up to --max-answers of the dataset's train responses, in a fixed "
        "random order, written to the drafter "
        "folder as suffix_seed.npz. Serving with \"suffix_lookup\": true puts them in "
        "its tree of past answers at startup (vllm_carryover/lookups/suffix.py).")
    t.add_argument("--drafter", required=True, help="drafter folder to write the seed into")
    t.add_argument("--data", default=DEFAULT_DATA,
                   help="dataset whose train responses make the seed (default: %(default)s)")
    t.add_argument("--max-answers", type=int, default=SEED_ANSWERS,
                   help="at most this many responses: the answer tree keeps no more than "
                   "suffix_decoding_max_cached_requests, whose default is vLLM's "
                   "(default: %(default)s)")
    t.set_defaults(fn=cmd_suffix_seed)

    vllm_eval.add_cli(sub)
    headroom.add_cli(sub)
    lookup_headroom.add_cli(sub)

    a = p.parse_args(argv)
    a.fn(a)

