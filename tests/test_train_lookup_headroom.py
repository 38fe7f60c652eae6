"""`python -m train lookup-headroom` on a tiny Llama: the suffix lookup, set up as
serving sets it up, proposes what followed the text's end earlier in the request or in
a seeded answer, and on responses that repeat their prompt its walks accept long runs
where a random drafter accepts next to nothing."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.tiny_models import make_tiny_drafter, make_tiny_target
from vllm_carryover.train.data import write_dataset
from vllm_carryover.train.lookup_headroom import (
    NO_DRAFT,
    POLICIES,
    anchored_drafts,
    serving_suffix_lookup,
)
from vllm_carryover.train.main import main
from vllm_carryover.train.paths import data_dir

VOCAB = 64
DATA = "tiny-lookup"


def test_the_lookup_proposes_what_followed_the_texts_end_in_the_request() -> None:
    """The request's tree holds its prompt and its response up to the anchor: the
    drafts continue the longest match of the text's end, at most as many tokens as the
    match is long (vLLM's max_spec_factor 1), and the request leaves the trees after."""
    suffix = serving_suffix_lookup([])
    tokens = torch.tensor([5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 8, 3])
    drafts, proposed = anchored_drafts(tokens, start=7, num_drafts=3, suffix=suffix)
    # anchor 7 ends in "5" (one token matched), 8 in "5 6", 9 in "5 6 7", 10 in "6 7 8"
    assert proposed.tolist() == [True] * 4
    assert drafts.tolist() == [[6, NO_DRAFT, NO_DRAFT], [7, 8, NO_DRAFT], [8, 9, 1],
                               [9, 1, 2]]
    assert not suffix.cache.active_requests and not suffix.cache.cached_requests
    _, never = anchored_drafts(torch.arange(1, 12), start=2, num_drafts=3, suffix=suffix)
    assert not never.any()  # no repeats, no proposals


def test_the_lookup_drafts_a_seeded_answer_and_no_earlier_walked_response() -> None:
    """The answer tree holds the seed (the train split's answers) throughout; a walked
    response leaves it, so a later held-out response that repeats it drafts nothing."""
    seeded = serving_suffix_lookup([[40, 41, 42, 43]])
    drafts, proposed = anchored_drafts(torch.tensor([1, 2, 40, 41, 42, 9]), start=2,
                                       num_drafts=3, suffix=seeded)
    assert drafts[:2].tolist() == [[41, NO_DRAFT, NO_DRAFT], [42, 43, NO_DRAFT]]
    assert proposed.tolist() == [True, True, True]  # anchor 4 ends in "40 41 42": 43
    assert list(seeded.cache.cached_requests) == [0]  # the seed, not the walked response
    unseeded = serving_suffix_lookup([])
    anchored_drafts(torch.tensor([1, 2, 40, 41, 42, 9]), start=2, num_drafts=3,
                    suffix=unseeded)
    _, again = anchored_drafts(torch.tensor([3, 4, 40, 41, 42, 9]), start=2, num_drafts=3,
                               suffix=unseeded)
    assert not again.any()


def walk_heldout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 response_of: Callable[[list[int], torch.Generator], list[int]],
                 *options: str) -> dict[str, dict[str, float]]:
    """`lookup-headroom`'s table over four held-out rows of random prompts, each answered
    by `response_of(prompt, generator)`."""
    target = make_tiny_target(tmp_path / "target", vocab=VOCAB)
    drafter = make_tiny_drafter(target, tmp_path / "drafter", block_size=4)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(4):
        prompt = torch.randperm(VOCAB - 1, generator=gen)[:12].add(1).tolist()
        rows.append({"id": f"r{i}", "group": f"g{i}", "category": ("chat", "code")[i % 2],
                     "messages": [], "prompt_ids": prompt,
                     "response_ids": response_of(prompt, gen),
                     "response": "", "split": "heldout"})
    monkeypatch.setenv("VLLM_CARRYOVER_CACHE", str(tmp_path / "cache"))
    write_dataset(data_dir(DATA), rows, {"target": str(target)})
    out = tmp_path / "lookup.json"
    main(["lookup-headroom", "--target", str(target), "--init", str(drafter),
          "--data", DATA, "--threads", "1", "--out", str(out), *options])
    return json.loads(out.read_text())


def test_lookup_headroom_walks_long_runs_on_repeated_text(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    table = walk_heldout(tmp_path, monkeypatch, lambda prompt, gen: prompt * 2)
    assert "| all |" in capsys.readouterr().out
    assert set(table) == {"all", "chat", "code"}
    for row in table.values():
        assert all(1.0 <= row[p] <= 4 for p in POLICIES)
        assert 0.0 <= row["lookup_share"] <= 1.0
    everything = table["all"]
    # a response's first step has nothing to look up (its last prompt token and first
    # response token never stood together before); every later one copies 3 right drafts
    assert everything["lookup"] > 3.0 and everything["both"] > 3.0
    assert everything["drafter"] < 1.5
    assert everything["lookup_share"] > 0.7


def test_max_response_tokens_walks_only_the_start_of_each_response(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def new_text_then_again(prompt: list[int], gen: torch.Generator) -> list[int]:
        # 12 tokens the prompt does not hold: only their repeats can be looked up
        fresh = [t for t in torch.randperm(VOCAB - 1, generator=gen).add(1).tolist()
                 if t not in prompt][:12]
        return fresh * 3

    whole = walk_heldout(tmp_path, monkeypatch, new_text_then_again)["all"]
    start = walk_heldout(tmp_path / "start", monkeypatch, new_text_then_again,
                         "--max-response-tokens", "12")["all"]
    assert start["lookup"] == 1.0  # nothing before the repeat is looked up
    assert whole["lookup"] > 1.5
