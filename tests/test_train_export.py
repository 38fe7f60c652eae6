"""Drafters trained by `train/` export, load in vLLM and keep greedy output lossless.

A tiny baseline run and a tiny carryover run started from it (in a temporary
VLLM_CARRYOVER_CACHE, with the dataset's target states written directly as in
test_train_loop.py) are exported with the real CLI (`python -m train export`).
Each export is then served in vLLM, one engine per process: the baseline export
with the in-tree `dflash` method, the carryover export with `carryover` (baseline
weights under `carryover` are test_lossless.py's trained-drafter case). In
float32 every run must be token-identical to the tiny target alone, and every
speculative run must have drafted and had drafts accepted.

Acceptance shows that the trained weights, not just the format, survive the
export: the dataset holds the target's own greedy continuations of prompts over a
16-token alphabet (a random tiny Llama soon repeats one token over and over), which
a couple of hundred fast steps teach the drafter; a drafter with mangled weights
would propose tokens the target never picks.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.engine_runner import run_engine
from support.tiny_models import make_tiny_target, write_cached_dataset
from vllm_carryover.train.baseline import BaselineArgs, train_baseline
from vllm_carryover.train.carryover import CarryoverArgs, train_carryover
from vllm_carryover.train.paths import run_dir

from vllm_carryover.drafter.checkpoint import load_drafter_state

REPO = Path(__file__).resolve().parent.parent
K = 3  # block size 4: the bonus token + 3 drafted tokens
ALPHABET = (3, 19)  # prompt tokens: 3..18
MAX_TOKENS = 24
DATA = "tiny-export"
REJECTED = "rejected_embedding"
# vLLM pins a CPU worker to core 0 by default ("auto"), alongside every other engine on
# the machine; unpinned, a shared CPU starves it less (binding cannot change the tokens).
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
# Tiny runs (a few seconds), without intermediate evaluations or checkpoints.
RUN = dict(data=DATA, seqs_per_step=2, anchors_per_seq=6, warmup=1, eval_every=0,
           eval_anchors_per_seq=3, num_negatives=32, save_every=0, threads=1)
BASELINE_STEPS, CARRYOVER_STEPS = 200, 10
N_ROWS = 60  # 12 held out


def random_prompts(n: int, seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(*ALPHABET) for _ in range(rnd.randrange(4, 33))] for _ in range(n)]


def greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy continuation (transformers, float32)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def write_target_dataset(target: Path) -> None:
    """Prompts with the target's greedy responses, in the cache as `python -m train data`
    leaves them."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    rows = []
    for i, prompt in enumerate(random_prompts(N_ROWS, seed=0)):
        rows.append({"id": f"r{i}", "group": f"g{i}", "category": "chat", "messages": [],
                     "prompt_ids": prompt, "response_ids": greedy(model, prompt, 16),
                     "response": "", "split": "heldout" if i % 5 == 0 else "train"})
    write_cached_dataset(target, DATA, rows)


def export_run(target: Path, run: str, out: Path, cache: Path, *extra: str) -> Path:
    """`python -m train export` in a subprocess, as a user runs it."""
    cmd = [sys.executable, "-m", "train", "export", "--target", str(target), "--run", run,
           "--out", str(out), *extra]
    env = dict(os.environ, VLLM_CARRYOVER_CACHE=str(cache), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny target, both runs' cache and their exports."""
    tmp = tmp_path_factory.mktemp("train_export")
    target = make_tiny_target(tmp / "target")
    cache = tmp / "cache"
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CARRYOVER_CACHE", str(cache))
        torch.set_num_threads(1)  # the recipes do too (threads=1): far faster on a busy CPU
        write_target_dataset(target)
        train_baseline(BaselineArgs(target=str(target), run="tiny-baseline", block_size=K + 1,
                                    intermediate_size=64, lr=1e-2, steps=BASELINE_STEPS,
                                    **RUN))
        # every anchor of each drawn sequence: the trained tiny drafter is often right, and
        # a few sampled anchors can miss every rejection (no carried state to train on)
        train_carryover(CarryoverArgs(target=str(target), run="tiny-carryover",
                                      init="tiny-baseline", steps=CARRYOVER_STEPS,
                                      **(RUN | {"anchors_per_seq": 64})))
        torch.set_num_threads(threads)
    return {"target": target, "cache": cache,
            **{recipe: export_run(target, f"tiny-{recipe}", tmp / f"export-{recipe}", cache)
               for recipe in ("baseline", "carryover")}}


@pytest.mark.parametrize("recipe,tag,steps", [("baseline", "dflash-baseline", BASELINE_STEPS),
                                              ("carryover", "carryover", CARRYOVER_STEPS)])
def test_export_writes_metadata_and_bf16_weights(
        exported: dict[str, Path], recipe: str, tag: str, steps: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors import safe_open

    folder = exported[recipe]
    assert (folder / "model.safetensors").is_file()
    cfg = json.loads((folder / "config.json").read_text())
    meta = cfg["carryover_config"]
    assert meta["recipe"] == tag and meta["steps"] == steps
    assert meta["target"] == "target" and meta["args"]["target"] == "target"
    assert "evals" not in meta and meta["date"]
    assert cfg["block_size"] == K + 1 and cfg["torch_dtype"] == "bfloat16"
    if recipe == "carryover":
        assert meta["init_checkpoint"] == "tiny-baseline"
        assert meta["init_meta"]["recipe"] == "dflash-baseline"
        assert meta["init_meta"]["steps"] == BASELINE_STEPS
    else:  # both held-out estimates are acceptance lengths of a K-token block
        assert 1.0 <= meta["heldout_walk_tau"] <= K + 1
        assert 1.0 <= meta["heldout_tau_estimate"] <= K + 1

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert all(f.get_tensor(n).dtype == torch.bfloat16 for n in names)
    assert (REJECTED in names) == (recipe == "carryover")

    # The exported weights are the run's final weights, rounded to bf16.
    monkeypatch.setenv("VLLM_CARRYOVER_CACHE", str(exported["cache"]))
    saved = torch.load(run_dir(f"tiny-{recipe}") / "final.pt")
    _, state = load_drafter_state(folder)
    assert names == set(saved["state"])
    for name, value in saved["state"].items():
        assert torch.equal(state[name], value.to(torch.bfloat16)), name
    if recipe == "carryover":  # trained from zero on carried states: the mark has moved
        assert saved["meta"]["carried_states"] > 0 and state[REJECTED].abs().max() > 0


def test_draft_vocabulary_export_keeps_its_map_through_more_training(
        exported: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`export --draft-vocab 8` cuts the head to the 8 tokens the target wrote most in
    the run's data; a carryover run started from that folder trains within those 8
    tokens and keeps the same map."""
    from vllm_carryover.drafter.format import D2T, LM_HEAD

    folder = export_run(exported["target"], "tiny-carryover", tmp_path / "dv",
                        exported["cache"], "--draft-vocab", "8")
    cfg, state = load_drafter_state(folder)
    assert cfg["draft_vocab_size"] == 8 and state[D2T].dtype == torch.int64
    assert state[LM_HEAD].shape == (8, cfg["hidden_size"])
    assert 0.5 < cfg["carryover_config"]["draft_vocab"]["coverage"] <= 1.0
    monkeypatch.setenv("VLLM_CARRYOVER_CACHE", str(exported["cache"]))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_carryover(CarryoverArgs(target=str(exported["target"]), run="tiny-dv",
                                      init=str(folder), steps=3, **RUN))
    finally:
        torch.set_num_threads(threads)
    saved = torch.load(run_dir("tiny-dv") / "final.pt")
    assert saved["config"]["draft_vocab_size"] == 8
    assert torch.equal(saved["state"][D2T], state[D2T])


def test_a_new_baseline_with_a_draft_vocabulary_trains_within_it(
        exported: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`train baseline --draft-vocab 8`: the new drafter's head is the 8 tokens the
    target wrote most (the map `export --draft-vocab 8` makes from the same data), it
    keeps that map through training, and the export serves it unchanged."""
    from vllm_carryover.drafter.format import D2T, LM_HEAD

    monkeypatch.setenv("VLLM_CARRYOVER_CACHE", str(exported["cache"]))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_baseline(BaselineArgs(target=str(exported["target"]), run="tiny-dv-baseline",
                                    block_size=K + 1, intermediate_size=64, lr=1e-2,
                                    steps=3, draft_vocab=8, **RUN))
    finally:
        torch.set_num_threads(threads)
    saved = torch.load(run_dir("tiny-dv-baseline") / "final.pt")
    assert saved["config"]["draft_vocab_size"] == 8
    assert saved["state"][LM_HEAD].shape == (8, saved["config"]["hidden_size"])
    cut = export_run(exported["target"], "tiny-carryover", tmp_path / "cut",
                     exported["cache"], "--draft-vocab", "8")
    assert torch.equal(saved["state"][D2T], load_drafter_state(cut)[1][D2T])
    folder = export_run(exported["target"], "tiny-dv-baseline", tmp_path / "dv-baseline",
                        exported["cache"])
    assert torch.equal(load_drafter_state(folder)[1][D2T], saved["state"][D2T])


def test_a_baseline_continues_from_an_exported_folder(
        exported: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """`train baseline --init-run FOLDER`: a committed export is where a run continues on
    a fresh machine; its weights are the start, its steps add up, and it draws other
    sequences than its predecessor did (the same seed once replayed them)."""
    monkeypatch.setenv("VLLM_CARRYOVER_CACHE", str(exported["cache"]))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_baseline(BaselineArgs(target=str(exported["target"]), run="tiny-continued",
                                    init_run=str(exported["baseline"]), lr=1e-2, steps=2,
                                    **RUN))
    finally:
        torch.set_num_threads(threads)
    meta = torch.load(run_dir("tiny-continued") / "final.pt")["meta"]
    assert meta["steps"] == BASELINE_STEPS + 2
    assert meta["continued_from"] == [str(exported["baseline"])]
    assert meta["recipe"] == "dflash-baseline"
    assert meta["heldout_initial"]["tau"] > 1.0  # the trained export drafts, before any step
    drawn = {run: [x["seqs"] for x in map(json.loads, (run_dir(run) / "log.jsonl").open())
                   if "seqs" in x][:2] for run in ("tiny-baseline", "tiny-continued")}
    assert drawn["tiny-continued"] != drawn["tiny-baseline"]


def test_draft_vocab_command_converts_a_drafter_folder(exported: dict[str, Path],
                                                       tmp_path: Path) -> None:
    """`python -m train draft-vocab` on the baseline export (a plain DFlash folder): the
    copy has the map and the target's head rows, and stays a plain DFlash folder."""
    from vllm_carryover.drafter.checkpoint import read_weights_header
    from vllm_carryover.drafter.format import D2T, LM_HEAD
    from vllm_carryover.drafter.target_weights import target_lm_head
    from vllm_carryover.drafter.vocab import from_offsets

    out = tmp_path / "dv"
    cmd = [sys.executable, "-m", "train", "draft-vocab", "--drafter", str(exported["baseline"]),
           "--out", str(out), "--size", "6", "--data", DATA, "--target", str(exported["target"])]
    env = dict(os.environ, VLLM_CARRYOVER_CACHE=str(exported["cache"]), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    assert "draft vocabulary of 6 tokens covers" in proc.stderr
    cfg, state = load_drafter_state(out)
    assert cfg["draft_vocab_size"] == 6 and REJECTED not in read_weights_header(out)
    ids = from_offsets(state[D2T])
    head = target_lm_head(exported["target"])[ids].to(torch.bfloat16)
    assert torch.equal(state[LM_HEAD], head)


def generate(target: Path, workdir: Path, name: str,
             spec: dict[str, Any] | None = None) -> dict[str, Any]:
    job: dict[str, Any] = {"model": str(target), "prompts": random_prompts(4, seed=1),
                           "max_tokens": MAX_TOKENS}
    if spec is not None:
        job["engine"] = {"speculative_config": {**spec, "num_speculative_tokens": K}}
    return run_engine(job, workdir, name, env=ENGINE_ENV)


@pytest.fixture(scope="module")
def reference(exported: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, Any]:
    """The tiny target alone, no speculation."""
    return generate(exported["target"], tmp_path_factory.mktemp("reference"), "none")


@pytest.mark.parametrize("recipe,method", [("baseline", "dflash"), ("carryover", "carryover")])
def test_export_serves_in_vllm_token_identical_to_the_target(
        exported: dict[str, Path], reference: dict[str, Any], tmp_path: Path,
        recipe: str, method: str) -> None:
    out = generate(exported["target"], tmp_path, f"{recipe}-{method}",
                   {"method": method, "model": str(exported[recipe])})
    assert out["token_ids"] == reference["token_ids"]
    assert all(len(t) == MAX_TOKENS for t in out["token_ids"])
    spec, co = out["spec"], out["carryover"]
    drafts, accepted = spec["spec_decode_num_drafts"], spec["spec_decode_num_accepted_tokens"]
    assert drafts > 0 and spec["spec_decode_num_draft_tokens"] == K * drafts
    assert accepted > 0, "the trained drafter was never right: weights lost in the export?"
    if method == "dflash":
        assert co["carryover_draft_rounds"] == 0
    else:
        # every rejected draft token, and only those, was carried into the next round
        assert co["carryover_draft_rounds"] > 0
        assert co["carryover_rejected_states"] == K * drafts - accepted
