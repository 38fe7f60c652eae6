"""Options of the training recipes: one dataclass per recipe over shared fields, plus argparse.

Kept free of torch so that `python -m train --help` stays fast; the recipes
(`train.baseline`, `train.carryover`) re-export their dataclass.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, TypeVar

from vllm_carryover.train.paths import CHECKPOINTS, DEFAULT_DATA

# Options that only steer one invocation (not what is trained): `--resume` may change them.
# The device is one (a CPU run may go on on a GPU), and so are the target states: cached
# ones are what the same function computes online (`train.state_cache`).
RUN_CONTROL = frozenset({"resume", "stop_after", "save_every", "eval_every",
                         "eval_anchors_per_seq", "threads", "device", "target_states",
                         "extra"})
DTYPES = ("auto", "float32", "bfloat16")
TARGET_STATES = ("auto", "cached", "online")


@dataclass
class TrainArgs:
    """What every recipe's step loop needs (`train.trainer.Trainer`)."""

    target: str = ""
    data: str = DEFAULT_DATA
    run: str = ""
    steps: int = 400
    minutes: float = 0.0
    seqs_per_step: int = 4
    anchors_per_seq: int = 32
    lr: float = 1e-3
    warmup: int = 20
    gamma: float = 4.0
    eval_every: int = 100
    eval_anchors_per_seq: int = 16
    vocab_subset: bool = True
    num_negatives: int = 4096
    markov_rank: int = 0
    markov_lr_mult: float = 10.0
    seed: int = 0
    threads: int = 2
    device: str = "auto"
    dtype: str = "auto"
    target_states: str = "auto"
    save_every: int = 50
    stop_after: int = 0
    resume: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class BaselineArgs(TrainArgs):
    run: str = "smollm2-dflash-baseline"
    layers: int = 1
    block_size: int = 8
    intermediate_size: int = 1024
    target_layers: list[int] | None = None
    init_run: str = ""
    draft_vocab: int = 0
    unvisited_weight: float = 1.0
    bonus_weight: float = 1.0
    slot_proposals: bool = False


@dataclass
class CarryoverArgs(TrainArgs):
    run: str = "smollm2-carryover"
    steps: int = 200
    lr: float = 3e-4
    warmup: int = 10
    eval_every: int = 50
    init: str = str(CHECKPOINTS / "smollm2-135m-instruct" / "dflash-baseline")
    first_draft_weight: float = 1.0
    rejected_lr_mult: float = 10.0
    hide_carried: bool = False


def add_train_options(p: argparse.ArgumentParser, d: TrainArgs) -> None:
    """The options every recipe shares, with `d`'s values as defaults."""
    p.add_argument("--target", help="target model folder (default: the testbed SmolLM2 folder)")
    p.add_argument("--data", default=d.data,
                   help="dataset name in the cache, as `python -m train data` wrote it "
                   "(default: %(default)s)")
    p.add_argument("--run", "--run-name", dest="run", default=d.run,
                   help="run name: the output folder $VLLM_CARRYOVER_CACHE/train/runs/RUN "
                   "(log.jsonl, last.pt, final.pt, meta.json); under torchrun spell it "
                   "--run-name (torchrun reads --run as its own --run-path) "
                   "(default: %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps,
                   help="optimizer steps; the cosine LR schedule spans them "
                   "(default: %(default)s)")
    p.add_argument("--minutes", type=float, default=d.minutes,
                   help="training-time budget (evaluations excluded); the LR schedule follows "
                   "whichever of steps and time is further along; 0: no budget "
                   "(default: %(default)s)")
    p.add_argument("--seqs-per-step", type=int, default=d.seqs_per_step,
                   help="training sequences per step and process; under torchrun the batch "
                   "is nproc x this (default: %(default)s)")
    p.add_argument("--anchors-per-seq", type=int, default=d.anchors_per_seq,
                   help="draft blocks (anchors) sampled per training sequence, inside its "
                   "response (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr,
                   help="peak AdamW learning rate (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup,
                   help="linear LR warm-up steps (default: %(default)s)")
    p.add_argument("--gamma", type=float, default=d.gamma,
                   help="loss weight decay over block slots: slot j weighs exp(-(j-1)/gamma) "
                   "(default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="held-out evaluation every this many steps; 0: only at the end "
                   "(default: %(default)s)")
    p.add_argument("--eval-anchors-per-seq", type=int, default=d.eval_anchors_per_seq,
                   help="anchors per held-out sequence in evaluations (default: %(default)s)")
    p.add_argument("--no-vocab-subset", dest="vocab_subset", action="store_false",
                   help="full-vocabulary softmax in training (slower on CPU); by default "
                   "the softmax covers the data's tokens plus random negatives")
    p.add_argument("--num-negatives", type=int, default=d.num_negatives,
                   help="random extra tokens per step in the sampled softmax "
                   "(default: %(default)s)")
    p.add_argument("--markov-rank", type=int, default=d.markov_rank,
                   help="train the semi-autoregressive variant: add a Markov head of this "
                   "rank (a low-rank logit bias from the previous block token) to a drafter "
                   "that has none; it starts at zero, i.e. as the drafter it extends; a "
                   "drafter that has a head keeps it; 0: no new head (default: %(default)s)")
    p.add_argument("--markov-lr-mult", type=float, default=d.markov_lr_mult,
                   help="learning-rate multiplier of the Markov head (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the initial weights and of the sequence / anchor draws; "
                   "process r of torchrun draws with seed + r (default: %(default)s)")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="CPU threads per process (default: %(default)s)")
    p.add_argument("--device", default=d.device,
                   help="where the drafter, its batches and the target (when it runs: "
                   "carryover's verify pass, online target states) run: auto (CUDA when "
                   "torch sees a GPU, under torchrun cuda:LOCAL_RANK; else cpu), cpu, cuda or "
                   "cuda:N; torchrun's processes then join over NCCL (CUDA) or gloo (CPU); "
                   "the CUDA and NCCL paths are reviewed but not yet run on a GPU "
                   "(default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default=d.dtype,
                   help="precision of the forward passes: bfloat16 autocasts the drafter and "
                   "loads the target in bf16; the drafter's weights, gradients and optimizer "
                   "stay float32; auto: bfloat16 on CUDA and on a CPU with native bf16 matmuls "
                   "(AVX512-BF16, AMX), else float32 "
                   "(default: %(default)s)")
    p.add_argument("--target-states", choices=TARGET_STATES, default=d.target_states,
                   help="the target's hidden states the drafter reads: cached (the target "
                   "runs on a sequence's first visit and its bf16 states go to a "
                   "memory-mapped file on local disk in the cache folder, one per dataset, "
                   "target layers and --dtype; later visits, later epochs and later runs "
                   "read them from there, a sequence at a time, never the whole file into "
                   "memory) or online (the target runs in the training loop on every "
                   "training sequence it visits, the held-out ones once per run: no disk); "
                   "auto: cached while the disk under the cache folder has room for all "
                   "the dataset's states with a margin to spare, else online "
                   "(default: %(default)s)")
    p.add_argument("--save-every", type=int, default=d.save_every,
                   help="write last.pt (what --resume continues from) every this many steps; "
                   "it is also written at the end; 0: only at the end (default: %(default)s)")
    p.add_argument("--stop-after", type=int, default=d.stop_after,
                   help="end this invocation once this many steps are done in total, "
                   "without the final evaluation and final.pt (e.g. to split a run over "
                   "jobs); continue with --resume; 0: no such stop (default: %(default)s)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run from its last.pt: weights, optimizer, step, "
                   "training time and random state; log.jsonl continues. The settings must "
                   f"match the saved ones, except {', '.join(_control_flags())}")


A = TypeVar("A", bound=TrainArgs)


def args_from(cls: type[A], ns: argparse.Namespace) -> A:
    """The dataclass `cls` filled from parsed options (unknown names ignored)."""
    return cls(**{k: v for k, v in vars(ns).items() if k in cls.__dataclass_fields__})


def _control_flags() -> list[str]:
    return ["--" + k.replace("_", "-") for k in sorted(RUN_CONTROL - {"extra"})]
