"""The shared training loop on a tiny Llama: --resume continues a run bit for bit, and
torchrun runs (2 processes, gloo) keep every rank's weights identical.

Runs go through `python -m train` (in-process, or torchrun in a subprocess) with
the cache in a temporary VLLM_CARRYOVER_CACHE, where the dataset is written directly
(no vLLM) and the first run's visits fill its target-state cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.tiny_models import make_tiny_drafter, make_tiny_target, write_random_dataset
from vllm_carryover.train.baseline import fresh_drafter_state
from vllm_carryover.train.dflash_loss import (
    IGNORE,
    WalkStats,
    cosine_lr,
    visit_weights,
    walk_visits,
    weighted_block_ce,
)
from vllm_carryover.train.main import main
from vllm_carryover.train.paths import run_dir
from vllm_carryover.train.target_states import stored_states
from vllm_carryover.train.trainer import weights_digest

from vllm_carryover.drafter.checkpoint import load_drafter_state
from vllm_carryover.drafter.format import DrafterConfig
from vllm_carryover.drafter.target_weights import target_final_norm

REPO = Path(__file__).resolve().parent.parent
DATA = "tiny-loop"


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny target, a drafter folder for it and a dataset in the cache."""
    tmp = tmp_path_factory.mktemp("train_loop")
    target = make_tiny_target(tmp / "target")
    drafter = make_tiny_drafter(target, tmp / "drafter", block_size=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CARRYOVER_CACHE", str(tmp / "cache"))
        write_random_dataset(target, DATA)
    return {"target": target, "drafter": drafter, "cache": tmp / "cache"}


@pytest.fixture
def cache(tiny_setup: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VLLM_CARRYOVER_CACHE", str(tiny_setup["cache"]))
    return tiny_setup["cache"]


def recipe_argv(recipe: str, setup: dict[str, Path], run: str, *extra: str) -> list[str]:
    """A few tiny steps of `recipe` (evaluation and checkpoints included)."""
    argv = [recipe, "--target", str(setup["target"]), "--data", DATA, "--run-name", run,
            "--steps", "6", "--seqs-per-step", "2", "--anchors-per-seq", "6",
            "--eval-every", "3", "--eval-anchors-per-seq", "3", "--num-negatives", "32",
            "--save-every", "2", "--threads", "1", "--warmup", "2"]
    if recipe == "baseline":
        argv += ["--block-size", "4", "--intermediate-size", "64"]
    else:
        argv += ["--init", str(setup["drafter"])]
    return [*argv, *extra]


def log_steps(run: str) -> list[dict[str, Any]]:
    """The per-step lines of a run's log.jsonl, without their wall-clock times (`seconds`,
    `feed_seconds`)."""
    lines = [json.loads(x) for x in (run_dir(run) / "log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if not k.endswith("seconds")} for x in lines]


@pytest.mark.parametrize(("recipe", "extra"), [
    ("baseline", ()), ("carryover", ()),
    # a cut LM head is saved beside the weights (lm_head, d2t) and must load back
    ("baseline", ("--draft-vocab", "64"))])
def test_resume_equals_an_uninterrupted_run(tiny_setup: dict[str, Path], cache: Path,
                                            recipe: str, extra: tuple[str, ...]) -> None:
    name = recipe + "".join(extra).replace("--", "-")
    whole, split = f"{name}-whole", f"{name}-split"
    main(recipe_argv(recipe, tiny_setup, whole, *extra))
    main(recipe_argv(recipe, tiny_setup, split, "--stop-after", "3", *extra))
    assert not (run_dir(split) / "final.pt").exists()
    first = torch.load(run_dir(split) / "last.pt")
    assert first["step"] == 3 and first["train_seconds"] > 0
    with (run_dir(split) / "log.jsonl").open("a") as log:  # as if killed after the save
        log.write('{"step": 3, "loss": 0.0}\n')
    main(recipe_argv(recipe, tiny_setup, split, "--resume", *extra))

    a, b = torch.load(run_dir(whole) / "final.pt"), torch.load(run_dir(split) / "final.pt")
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), k
    assert a["meta"]["steps"] == b["meta"]["steps"] == 6
    assert a["meta"]["evals"] == b["meta"]["evals"] and len(a["meta"]["evals"]) == 2
    assert a["meta"]["trained_label_tokens"] == b["meta"]["trained_label_tokens"]
    assert b["meta"]["train_seconds"] >= round(first["train_seconds"], 1)
    assert log_steps(whole) == log_steps(split)


@pytest.mark.parametrize("recipe", ["baseline", "carryover"])
def test_interrupted_multi_epoch_run_over_the_state_cache_resumes_to_the_online_result(
        tiny_setup: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        recipe: str) -> None:
    """16 steps of 2 draws over 12 training sequences, so most are visited several times.
    Online, every visit runs the target. Over a new state cache, interrupted after 5 steps
    and resumed, the target runs once per sequence (the resumed invocation reads what the
    first one stored) and the run ends with the online run's weights bit for bit. A third
    run of the same draws reads every state from the cache: the target never runs."""
    from vllm_carryover.train import baseline

    monkeypatch.setenv("VLLM_CARRYOVER_CACHE", str(tmp_path / "cache"))
    write_random_dataset(tiny_setup["target"], DATA)  # no target state stored yet
    computed: list[tuple[int, ...]] = []

    def counted(decoder: Any, batch: list[list[int]], layer_ids: list[int]
                ) -> list[torch.Tensor]:
        computed.extend(tuple(s) for s in batch)
        return stored_states(decoder, batch, layer_ids)

    monkeypatch.setattr(baseline, "stored_states", counted)
    steps = ("--steps", "16", "--eval-every", "8")
    main(recipe_argv(recipe, tiny_setup, "online", *steps, "--target-states", "online"))
    draws = [i for x in log_steps("online") if "seqs" in x for i in x["seqs"]]
    assert len(draws) == 32 and len(set(draws)) < len(draws)  # revisits: several epochs
    assert len(computed) == len(draws) + 3  # + the 3 held-out sequences, once per run

    computed.clear()
    split = (recipe, tiny_setup, "cached", *steps, "--target-states", "cached")
    main(recipe_argv(*split, "--stop-after", "5"))
    first = len(computed)
    main(recipe_argv(*split, "--resume"))
    assert len(computed) == len(set(computed)) == len(set(draws)) + 3  # once each
    assert 0 < first < len(computed)  # the first invocation filled part of the cache
    a, b = (torch.load(run_dir(r) / "final.pt")["state"] for r in ("online", "cached"))
    assert weights_digest(a) == weights_digest(b)
    assert log_steps("online") == log_steps("cached")

    def no_target(*args: Any) -> None:
        raise AssertionError("the target ran for a cached sequence")

    monkeypatch.setattr(baseline, "stored_states", no_target)
    main(recipe_argv(recipe, tiny_setup, "reread", *steps, "--target-states", "cached"))
    assert weights_digest(torch.load(run_dir("reread") / "final.pt")["state"]) == \
        weights_digest(a)


def test_resume_refuses_without_checkpoint_or_with_other_settings(
        tiny_setup: dict[str, Path], cache: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        main(recipe_argv("baseline", tiny_setup, "never-started", "--resume"))
    main(recipe_argv("baseline", tiny_setup, "short", "--stop-after", "1"))
    with pytest.raises(ValueError, match="--anchors-per-seq 6 -> 5"):
        main(recipe_argv("baseline", tiny_setup, "short", "--resume", "--anchors-per-seq", "5"))
    with pytest.raises(ValueError, match="block_size: 4 -> 5"):
        main(recipe_argv("baseline", tiny_setup, "short", "--resume", "--block-size", "5"))


@pytest.mark.parametrize("recipe", ["baseline", "carryover"])
def test_torchrun_two_processes_keep_identical_weights(tiny_setup: dict[str, Path],
                                                       cache: Path, recipe: str) -> None:
    run = f"{recipe}-ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", "-m", "train",
           *recipe_argv(recipe, tiny_setup, run, "--steps", "4", "--eval-every", "2")]
    env = dict(os.environ, VLLM_CARRYOVER_CACHE=str(cache), OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    final = torch.load(run_dir(run) / "final.pt")
    last = torch.load(run_dir(run) / "last.pt")
    assert final["meta"]["processes"] == 2 and final["meta"]["steps"] == 4
    # every rank hashed its own weights into last.pt: all equal, and equal to the saved ones
    assert last["rank_digests"] == [weights_digest(last["model"])] * 2
    for k, v in final["state"].items():
        assert torch.equal(v, last["model"][k]), k
    # the ranks drew different sequences; only rank 0 wrote the log
    assert last["random"][0]["generator"].ne(last["random"][1]["generator"]).any()
    lines = log_steps(run)
    assert [x["step"] for x in lines] == [0, 1, 2, 2, 3, 4]


def test_warmup_counts_optimizer_steps_even_when_a_time_budget_leads() -> None:
    """A --minutes run with a huge --steps is far ahead by time from its first step on;
    the warmup still ramps over real steps, then the cosine follows the progress."""
    peak, warmup = 4e-4, 30
    assert cosine_lr(0, 0.001, warmup, peak) == pytest.approx(peak / warmup)
    assert cosine_lr(14, 0.02, warmup, peak) == pytest.approx(peak * 15 / warmup)
    assert cosine_lr(warmup, 0.0, warmup, peak) == pytest.approx(peak)
    assert cosine_lr(warmup, 0.5, warmup, peak) == pytest.approx(peak * 0.525)
    assert cosine_lr(10_000, 1.0, warmup, peak) == pytest.approx(peak * 0.05)


def test_walked_tau_follows_the_anchors_a_speculative_run_visits() -> None:
    """Anchors at every response position: the walk starts at the first, jumps past each
    accepted prefix and the target's token, and stops at the first block without all its
    labels; anchors inside an accepted stretch never count."""
    k = 3
    accepted = [2, 3, 3, 0, 3, 3, 3, 3, 1, 0, 3]
    labels = torch.arange(len(accepted) * k).view(-1, k)
    drafts = labels.clone()
    for row, n in enumerate(accepted):
        if n < k:
            drafts[row, n] = -1
    labels[9:, 2] = IGNORE  # the last two blocks run past the response
    walk = WalkStats()
    walk.add(drafts, labels)
    assert (walk.rounds, walk.accepted) == (4, 2 + 0 + 3 + 1)  # anchors 0, 3, 4, 8
    assert walk.tau() == pytest.approx(1 + 6 / 4)


def test_walk_over_sampled_anchors_resumes_at_the_next_one() -> None:
    """A sample of anchors: where the run's next block is not sampled, the walk goes on
    from the next sampled anchor after it (never from one before it)."""
    anchors = torch.tensor([5, 6, 9, 10, 14, 20])
    accepted = torch.tensor([3, 0, 0, 2, 7, 1])
    # 5 (+3+1) -> 9 (+0+1) -> 10 (+2+1) -> 13 not sampled: 14 (+7+1) -> 22: none
    assert walk_visits(anchors, accepted, 5).tolist() == [True, False, True, True, True, False]
    assert walk_visits(anchors, accepted, 7).tolist() == [False, False, True, True, True, False]


def test_unvisited_blocks_weigh_less_in_the_loss() -> None:
    """visit_weights marks the walked blocks 1 and the others W, and the block loss is
    then the weighted mean over blocks (slot weights on top)."""
    k = 2
    labels = torch.arange(4 * k).view(4, k)
    drafts = labels.clone()
    drafts[1, 0] = drafts[2, 1] = drafts[3, 0] = -1  # accepted 2, 0, 1, 0
    w = visit_weights(drafts, labels, torch.arange(10, 14), 10, 0.25)
    assert w.tolist() == [1.0, 0.25, 0.25, 1.0]  # 10 (+2+1) -> 13
    logits = torch.randn(4, k, 8 * k)
    slots = torch.tensor([1.0, 0.5])
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                           reduction="none").view(4, k)
    want = (ce * slots * w[:, None]).sum() / (slots * w[:, None]).sum()
    torch.testing.assert_close(weighted_block_ce(logits, labels, slots, w)[0], want)


def test_unvisited_weight_one_is_the_plain_run(tiny_setup: dict[str, Path],
                                               cache: Path) -> None:
    """--unvisited-weight 1 trains exactly the plain recipe; another weight runs through
    the whole loop (the tiny random drafter accepts nothing, so every block is visited)."""
    main(recipe_argv("baseline", tiny_setup, "uniform", "--eval-every", "0"))
    main(recipe_argv("baseline", tiny_setup, "one", "--eval-every", "0", "--unvisited-weight", "1"))
    main(recipe_argv("baseline", tiny_setup, "focused", "--eval-every", "0",
                     "--unvisited-weight", "0.2"))
    states = {r: torch.load(run_dir(r) / "final.pt")["state"]
              for r in ("uniform", "one", "focused")}
    assert weights_digest(states["uniform"]) == weights_digest(states["one"])
    assert all(v.isfinite().all() for v in states["focused"].values())


def test_fresh_drafter_starts_with_silent_branches_and_the_targets_final_norm(
        tmp_path: Path) -> None:
    """A new drafter's residual stream starts as its input embedding (every o_proj and
    down_proj at zero), normed as the target norms its own last state."""
    target = make_tiny_target(tmp_path / "target")
    cfg = DrafterConfig.from_dict(load_drafter_state(make_tiny_drafter(target,
                                                                       tmp_path / "d"))[0])
    state = fresh_drafter_state(cfg, str(target), seed=0)
    branches = [k for k in state if k.endswith(("o_proj.weight", "down_proj.weight"))]
    assert branches and all(not state[k].any() for k in branches)
    assert torch.equal(state["norm.weight"], target_final_norm(target))
    assert state["layers.0.self_attn.q_proj.weight"].std() > 0


def test_slot_drafter_trains_its_confidence_levels_and_a_continued_one_gains_them(
        tiny_setup: dict[str, Path], cache: Path, tmp_path: Path) -> None:
    """`--slot-proposals` makes a drafter whose slots read the trees' proposals with
    their confidence levels, and the levels' embedding trains; exported, it is a valid
    folder. A slot drafter from before the levels, continued with the flag, gains a
    zero table (it drafts as before); one that reads mask tokens is refused."""
    from vllm_carryover.train.slot_proposals import with_slot_proposals

    from vllm_carryover.lookups.slots import CONFIDENCE_LEVELS, LEVELS_KEY

    main(recipe_argv("baseline", tiny_setup, "levels", "--eval-every", "0", "--slot-proposals"))
    saved = torch.load(run_dir("levels") / "final.pt")
    assert saved["config"]["slot_proposals"][LEVELS_KEY] == CONFIDENCE_LEVELS
    assert saved["state"]["slot_confidence"][1:].abs().sum() > 0  # proposals' levels trained
    main(["export", "--run", "levels", "--out", str(tmp_path / "out"),
          "--target", str(tiny_setup["target"])])
    assert load_drafter_state(tmp_path / "out")[1]["slot_confidence"].shape[0] == CONFIDENCE_LEVELS

    ids_alone = {"slot_proposals": {"source": "suffix", "max_tree_depth": 24}}
    gained = with_slot_proposals(ids_alone, asked=True, continued=True)
    assert gained["slot_proposals"] == ids_alone["slot_proposals"] | {LEVELS_KEY: CONFIDENCE_LEVELS}
    assert with_slot_proposals(ids_alone, asked=False, continued=True) is ids_alone
    with pytest.raises(SystemExit, match="reads mask tokens in its slots"):
        with_slot_proposals({}, asked=True, continued=True)
