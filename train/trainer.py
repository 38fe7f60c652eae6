"""The step loop shared by the training recipes.

A recipe builds its drafter, optimizer and sequences, then supplies the loss
of one training sequence and a held-out evaluation. The loop owns the rest:
LR schedule and time budget, the random draws (sequences, sampled-softmax
vocabulary, anchors: always in this order, on the CPU, so a run reproduces),
each drawn sequence's move to the device with its target states (the recipe's
`Feed`), autocast, gradient averaging over torchrun processes, log.jsonl, the
progress bar, periodic evaluations, and last.pt, from which `--resume`
continues bit for bit. Checkpoints hold CPU tensors, whatever the device.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm
from vllm_carryover.train.data import load_manifest
from vllm_carryover.train.device import Placement
from vllm_carryover.train.dflash_loss import cosine_lr, sample_anchors
from vllm_carryover.train.distributed import (
    average_gradients,
    check_joined,
    from_rank0,
    gather,
    is_main,
    rank,
    sum_over_ranks,
    world_size,
)
from vllm_carryover.train.options import RUN_CONTROL, TrainArgs
from vllm_carryover.train.paths import CHECKPOINTS, data_dir, run_dir
from vllm_carryover.train.vocab_subset import step_vocab

from vllm_carryover.drafter.checkpoint import load_drafter_state
from vllm_carryover.drafter.source import is_hub_id, resolve_drafter
from vllm_carryover.drafter.torch_model import TorchDrafter
from vllm_carryover.drafter.validation import validate_for_target_folder
from vllm_carryover.errors import CarryoverConfigError

LAST = "last.pt"
FINAL = "final.pt"
LOG = "log.jsonl"
LINEAGE_SEED_STRIDE = 1_000_003  # a prime above any world size: (rank, lineage) seeds never meet


@dataclass
class Sequence:
    """One training sequence: tokens, the first response position, aux states."""

    tokens: torch.Tensor  # [T]
    response_start: int
    aux: torch.Tensor | None  # [T, n_layers * H] bf16; None until the recipe's feed gives it
    category: str = ""  # the prompt's category (chat, code, ...), where the data has one
    row: int = -1  # its row in the dataset, where the state cache keeps its states
    proposals: torch.Tensor | None = None  # [T, K] slot proposals (`train.slot_proposals`)


@dataclass
class SeqResult:
    """One training sequence's loss and what it adds to the log and to the run totals."""

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)  # logged as means per step
    counts: dict[str, int] = field(default_factory=dict)  # summed over the run


# a loaded sequence -> the same on the training device, with its aux states
Feed = Callable[[Sequence], Sequence]
# (sequence, anchors, sampled-softmax token ids or None) -> its loss
SeqLoss = Callable[[Sequence, torch.Tensor, torch.Tensor | None], SeqResult]
# held-out evaluation of the current weights -> a JSON-able summary
Evaluate = Callable[[], dict[str, Any]]


@dataclass
class Progress:
    """What a run has done so far; last.pt saves it and `--resume` restores it."""

    step: int = 0
    train_seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)  # recipe values fixed at the start


class Trainer:
    """A recipe's run: `run` trains, `save_final` writes final.pt and meta.json."""

    def __init__(self, a: TrainArgs, name: str, model: TorchDrafter,
                 params: list[torch.nn.Parameter], opt: torch.optim.Optimizer,
                 config: dict[str, Any], train: list[Sequence], counts: dict[str, int],
                 place: Placement, feed: Feed, lineage_steps: int = 0) -> None:
        check_joined()
        self.a = a
        self.place = place
        self.feed = feed
        self.name = name
        self.model = model
        self.params = params
        self.opt = opt
        self.config = config  # the drafter's; --resume refuses another one
        self.train = train
        self.main = is_main()
        self.world = world_size()
        self.out = run_dir(a.run)
        self.data_sha = load_manifest(data_dir(a.data))["sha256"]
        # what each step draws (sequences, anchors, negatives): ranks draw differently, and
        # so does a run continued from a drafter already trained `lineage_steps` steps,
        # which would otherwise replay its predecessor's draws from the start
        self.gen = torch.Generator().manual_seed(
            a.seed + rank() + LINEAGE_SEED_STRIDE * lineage_steps)
        self.done = Progress(counts=dict(counts))
        self.log_bytes = 0  # log.jsonl's length at the restored checkpoint
        self.vocab = None
        # a drafter with a draft vocabulary can only ever score those tokens: its softmax
        # is over them (the data's among them, plus negatives from them); labels outside
        # are remapped to IGNORE, since no training can make them draftable
        self.universe = (None if model.draft_ids is None else model.draft_ids.cpu())
        if a.vocab_subset or self.universe is not None:
            self.vocab = torch.unique(torch.cat([s.tokens for s in train]))
            if self.universe is not None:
                self.vocab = self.vocab[torch.isin(self.vocab, self.universe)]
        if self.vocab is not None and self.main:
            print(f"sampled softmax over {self.vocab.numel()} data tokens + "
                  f"{a.num_negatives} random negatives per step"
                  + ("" if self.universe is None else
                     f" (all within the drafter's {self.universe.numel()}-token draft "
                     "vocabulary)"))
        if a.resume:
            self._restore()
        elif self.main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / LAST).unlink(missing_ok=True)  # never resume another run's state

    def run(self, seq_loss: SeqLoss, evaluate: Evaluate) -> bool:
        """Train until --steps, --minutes or --stop-after; True when the run is complete."""
        a, done = self.a, self.done
        log = self._open_log()
        # a time budget (--minutes) ends the run long before --steps: show its percent
        by_time = a.minutes > 0
        bar = tqdm(total=100 if by_time else a.steps, initial=0 if by_time else done.step,
                   desc=self.name, unit="%" if by_time else "step", disable=not self.main,
                   bar_format="{l_bar}{bar}| {n:.0f}/{total} % of the run [{elapsed}<{remaining}"
                   "{postfix}]" if by_time else None)
        complete, saved_at = True, -1
        for step in range(done.step, a.steps):
            t0 = time.perf_counter()
            progress = self._progress(step)
            if progress >= 1.0:
                break
            if a.stop_after and step >= a.stop_after:
                complete = False
                break
            lr = cosine_lr(step, progress, a.warmup, a.lr)
            for g in self.opt.param_groups:
                g["lr"] = lr * g.get("lr_mult", 1.0)
            metrics, counts, picks = self._step(seq_loss)
            done.step = step + 1
            done.train_seconds += time.perf_counter() - t0
            for k, v in counts.items():
                done.counts[k] += v
            if log is not None:
                log.write(json.dumps({"step": step, **metrics, "lr": lr,
                                      "seconds": done.train_seconds, "seqs": picks}) + "\n")
                if by_time:
                    bar.update(100 * min(1.0, max(done.step / a.steps, done.train_seconds
                                                  / (a.minutes * 60))) - bar.n)
                else:
                    bar.update(1)
                bar.set_postfix({k: f"{v:.0f}" if abs(v) >= 100 else f"{v:.3f}"
                                 for k, v in metrics.items()} | {"lr": f"{lr:.1e}"})
                if a.eval_every and done.step % a.eval_every == 0:
                    done.evals.append({"step": done.step, **evaluate()})
                    tqdm.write(f"step {done.step}: " + json.dumps(done.evals[-1]))
                    log.write(json.dumps(done.evals[-1]) + "\n")
                log.flush()
            if a.save_every and done.step % a.save_every == 0:
                self.save(log)
                saved_at = done.step
        bar.close()
        if saved_at != done.step:
            self.save(log)
        if log is not None:
            log.close()
        return complete

    def _step(self, seq_loss: SeqLoss
              ) -> tuple[dict[str, float], dict[str, int], list[int]]:
        """One optimizer step; (per-step means, counts), both over all ranks, and the
        training sequences this rank drew (indices into the train split)."""
        a = self.a
        picks = torch.randint(len(self.train), (a.seqs_per_step,), generator=self.gen).tolist()
        self.opt.zero_grad(set_to_none=True)
        ids = None if self.vocab is None else step_vocab(
            self.vocab, self.model.config.vocab_size, a.num_negatives, self.gen,
            self.universe).to(self.place.device)
        metrics: dict[str, float] = {}
        counts = dict.fromkeys(self.done.counts, 0)
        feed_s = feed_tokens = 0.0  # what getting the target states cost (online: a lot)
        for i in picks:
            seq = self.train[i]
            anchors = sample_anchors(seq.response_start, seq.tokens.shape[0] - 1,
                                     a.anchors_per_seq, self.gen).to(self.place.device)
            start = time.perf_counter()
            seq = self.feed(seq)
            feed_s += time.perf_counter() - start
            feed_tokens += seq.tokens.numel()
            with self.place.autocast():
                r = seq_loss(seq, anchors, ids)
            (r.loss / len(picks)).backward()
            for k, v in {"loss": r.loss.item(), **r.metrics}.items():
                metrics[k] = metrics.get(k, 0.0) + v / len(picks)
            for k, v in r.counts.items():
                counts[k] += v
        metrics |= {"feed_seconds": feed_s, "feed_tokens": feed_tokens}
        average_gradients(self.params)
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        n = self.world
        if n == 1:
            return metrics, counts, picks
        total = sum_over_ranks([*metrics.values(), *counts.values()])
        return (dict(zip(metrics, [v / n for v in total[:len(metrics)]], strict=True)),
                dict(zip(counts, [round(v) for v in total[len(metrics):]], strict=True)),
                picks)

    def _progress(self, step: int) -> float:
        """Fraction of the run done: steps, or time if further along (rank 0's clock)."""
        a = self.a
        progress = step / a.steps
        if a.minutes > 0:
            progress = from_rank0(max(progress, self.done.train_seconds / (a.minutes * 60)))
        return progress

    def save(self, log: TextIO | None) -> Path:
        """Write last.pt (rank 0) with every rank's random state; all ranks must call it."""
        digests = gather(weights_digest(self.model.state_dict()))
        if len(set(digests)) > 1:
            raise RuntimeError(f"ranks hold different weights at step {self.done.step}: "
                               f"{digests}")
        rng = gather({"generator": self.gen.get_state(), "torch": torch.get_rng_state()})
        path = self.out / LAST
        if not self.main:
            return path
        state = {"args": args_dict(self.a), "config": self.config,
                 "data_sha256": self.data_sha, "world_size": self.world,
                 "model": cpu(self.model.checkpoint_state()),
                 "optimizer": self.opt.state_dict(),
                 **asdict(self.done), "random": rng,
                 "log_bytes": log.tell() if log is not None else 0, "rank_digests": digests}
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)  # a kill while writing leaves the previous last.pt intact
        return path

    def _restore(self) -> None:
        path = self.out / LAST
        if not path.is_file():
            raise FileNotFoundError(f"--resume: {path} does not exist (run {self.a.run!r} "
                                    "saved no checkpoint yet); start it without --resume")
        # readable anywhere; load_state_dict moves the optimizer state to the parameters
        saved = torch.load(path, map_location="cpu")
        diffs = self._differences(saved)
        if diffs:
            raise ValueError(f"--resume: {path} was written with other settings: "
                             + "; ".join(diffs) + ". Resume with the saved settings, or "
                             "start a new --run.")
        self.model.load_checkpoint_state(saved["model"])  # as saved: with a draft vocabulary
        self.opt.load_state_dict(saved["optimizer"])
        self.done = Progress(**{f.name: saved[f.name] for f in fields(Progress)})
        rng = saved["random"][rank()]
        self.gen.set_state(rng["generator"])
        torch.set_rng_state(rng["torch"])
        self.log_bytes = saved["log_bytes"]
        if self.main:
            print(f"resuming {self.a.run} at step {self.done.step} "
                  f"({self.done.train_seconds:.0f} s trained)")

    def _differences(self, saved: dict[str, Any]) -> list[str]:
        """The saved settings that differ from this invocation's, as readable lines."""
        # a setting added since the checkpoint was written had its default then
        now, before = args_dict(self.a), args_dict(type(self.a)()) | saved["args"]
        out = [f"--{k.replace('_', '-')} {before.get(k)!r} -> {now.get(k)!r}"
               for k in sorted((now.keys() | before.keys()) - RUN_CONTROL)
               if before.get(k) != now.get(k)]
        if saved["data_sha256"] != self.data_sha:
            out.append(f"dataset {self.a.data!r} changed since (manifest sha256 "
                       f"{saved['data_sha256'][:12]} -> {self.data_sha[:12]})")
        cfg = saved["config"]
        out += [f"drafter config {k}: {cfg.get(k)!r} -> {self.config.get(k)!r}"
                for k in sorted(cfg.keys() | self.config.keys())
                if cfg.get(k) != self.config.get(k)]
        if saved["world_size"] != self.world:
            out.append(f"processes {saved['world_size']} -> {self.world} (each draws "
                       "its own sequences)")
        return out

    def _open_log(self) -> TextIO | None:
        """log.jsonl on rank 0: new, or on resume cut back to the checkpoint and appended."""
        if not self.main:
            return None
        path = self.out / LOG
        if not self.a.resume:
            return path.open("w")
        if path.is_file() and path.stat().st_size > self.log_bytes:
            with path.open("r+") as f:  # steps after the checkpoint are trained again
                f.truncate(self.log_bytes)
        return path.open("a")

    def save_final(self, config: dict[str, Any], state: dict[str, torch.Tensor],
                   meta: dict[str, Any]) -> Path:
        """Write final.pt (config, float32 state, metadata) and meta.json."""
        path = self.out / FINAL
        torch.save({"config": config, "state": cpu(state), "meta": meta}, path)
        (self.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        return path


def init_checkpoint(init: str, flag: str) -> Path:
    """The drafter that `flag`'s value `init` names: an existing path (a drafter folder: an
    export, a committed one on a fresh machine, a downloaded DFlash checkpoint), else a run
    name in the cache (its final.pt), else a Hugging Face hub id (its snapshot, resolved as
    serving resolves a drafter). Checked in that order, so that a value means one thing.

    Raises SystemExit naming the value, what it was taken for, and the fix.
    """
    path = Path(init).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise SystemExit(f"{flag} {init}: no drafter folder (it has no config.json); "
                             "pass a folder with config.json and model.safetensors, a run by "
                             "its name, or a Hugging Face hub id (owner/name)")
        return path
    if (run_dir(init) / FINAL).is_file():
        return run_dir(init) / FINAL
    if not is_hub_id(init):
        raise SystemExit(f"{flag} {init}: no such folder, no finished run of that name in "
                         f"the cache ({run_dir(init) / FINAL}), and no Hugging Face hub id "
                         "(owner/name); pass a drafter folder, a run name or a hub id")
    try:
        return resolve_drafter(init)
    except CarryoverConfigError as e:
        raise SystemExit(f"{flag} {init}: no finished run of that name in the cache "
                         f"({run_dir(init) / FINAL}), and as a hub id: {e}") from e


def load_init(init: str, target: str, flag: str
              ) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """(config, float32 state, its training metadata) of the drafter `init_checkpoint`
    finds. A folder is first checked against the target as serving checks it, so that a
    drafter made for another model fails here, naming the mismatch, before any target
    weights load; a DFlash checkpoint without a rejected embedding is read without one."""
    source = init_checkpoint(init, flag)
    if not source.is_dir():
        saved = torch.load(source)
        return saved["config"], saved["state"], saved["meta"]
    try:
        validate_for_target_folder(source, target, None)
    except CarryoverConfigError as e:
        raise SystemExit(f"{flag} {init}: {e}") from e
    cfg, state = load_drafter_state(source, fill_rejected=False)
    return cfg, {k: v.float() for k, v in state.items()}, cfg.get("carryover_config", {})


def args_dict(a: TrainArgs) -> dict[str, Any]:
    return {k: v for k, v in asdict(a).items() if k != "extra"}


def meta_args(a: TrainArgs) -> dict[str, Any]:
    """The settings that describe a run (not how one invocation of it was steered)."""
    return {k: (portable(v) if k in ("init", "init_run") and v else v)
            for k, v in args_dict(a).items() if k not in ("resume", "stop_after")}


def portable(init: str) -> str:
    """An init path relative to the checkout when it is inside it (metadata that reads
    the same on every machine); a run name or hub id as given."""
    if not Path(init).exists():
        return init
    try:
        return str(Path(init).resolve().relative_to(CHECKPOINTS.parent.parent))
    except ValueError:
        return init


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 of a state dict: equal on every rank while training is in sync."""
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict on the CPU (unchanged there), so that any machine can load it."""
    return {k: v.cpu() for k, v in state.items()}
