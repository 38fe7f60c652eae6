"""`python -m train eval`: per-category acceptance through vLLM, on tiny random models.

Two rows (no speculation, carryover) over a tiny dataset with two held-out
categories (plus one that only the training split has, which must not show up).
The per-category counters must add up to the engine's own cumulative totals,
so no draft is lost or counted twice between categories.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest
from support.tiny_models import make_tiny_drafter, make_tiny_target
from vllm_carryover.train.data import write_dataset
from vllm_carryover.train.paths import data_dir
from vllm_carryover.train.vllm_eval import add_cli

from vllm_carryover.tools.rows import parse_row, speculative_config

K = 3
MAX_TOKENS = 16
PROMPTS_PER_CATEGORY = 3


def tiny_dataset(name: str) -> Path:
    """Held-out prompts in "alpha" and "beta"; "gamma" is training-only."""
    rnd = random.Random(0)
    rows = []
    for category in ("beta", "alpha", "gamma"):
        for i in range(PROMPTS_PER_CATEGORY + 1):
            heldout = category != "gamma" and i < PROMPTS_PER_CATEGORY
            prompt = [rnd.randrange(3, 500) for _ in range(rnd.randrange(8, 40))]
            rows.append({"id": f"{category}-{i}", "group": f"{category}-{i}",
                         "category": category, "split": "heldout" if heldout else "train",
                         "prompt_ids": prompt, "response_ids": [rnd.randrange(3, 500)] * 8})
    out = data_dir(name)
    write_dataset(out, rows, {"target": "tiny"})
    return out


def eval_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m train")
    add_cli(parser.add_subparsers(dest="cmd", required=True))
    return parser


@pytest.mark.parametrize("text,name,config", [
    ("none", "none", None),
    ("ng=ngram", "ng", {"method": "ngram", "num_speculative_tokens": K,
                        "prompt_lookup_min": 2, "prompt_lookup_max": 4}),
    ("on=carryover:/d", "on", {"method": "carryover", "model": "/d",
                               "num_speculative_tokens": K, "carryover": True}),
    ("off=carryover-off:/d", "off", {"method": "carryover", "model": "/d",
                                     "num_speculative_tokens": K, "carryover": False}),
    ("dflash:/d", "dflash", {"method": "dflash", "model": "/d", "num_speculative_tokens": K}),
    ("carryover-lookup:/d", "carryover-lookup", {
        "method": "carryover", "model": "/d", "num_speculative_tokens": K,
        "num_speculative_tokens_per_batch_size": "goodput", "suffix_lookup": True,
        "lookup_drafter_k": 1}),
    ('{"method": "carryover", "model": "/d", "num_speculative_tokens": 1}', "carryover",
     {"method": "carryover", "model": "/d", "num_speculative_tokens": 1}),
])
def test_row_specs(text: str, name: str, config: dict | None) -> None:
    row = parse_row(text)
    assert row.name == name
    assert speculative_config(row.spec, K) == config


@pytest.mark.parametrize("bad", ["x=eagle", "x=dflash:", "x y=none", "x={no json"])
def test_bad_rows_are_refused_by_the_parser(bad: str) -> None:
    with pytest.raises(SystemExit):
        eval_parser().parse_args(["eval", "--row", bad])


def tiny_eval_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, Path]:
    """(tiny target, tiny drafter, result path), with the dataset "tiny" in a fresh cache."""
    monkeypatch.setenv("VLLM_CARRYOVER_CACHE", str(tmp_path / "cache"))
    target = make_tiny_target(tmp_path / "target")
    drafter = make_tiny_drafter(target, tmp_path / "drafter", block_size=K + 1)
    tiny_dataset("tiny")
    return target, drafter, tmp_path / "eval.json"


def test_eval_per_category(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    target, drafter, out = tiny_eval_setup(tmp_path, monkeypatch)
    args = eval_parser().parse_args([
        "eval", "--target", str(target), "--data", "tiny", "--row", "none",
        "--row", f"carryover=carryover:{drafter}", "--ratio", "carryover/none", "-k", str(K),
        "--max-tokens", str(MAX_TOKENS), "--num-prompts", str(PROMPTS_PER_CATEGORY),
        "--dtype", "float32", "--out", str(out)])
    args.fn(args)
    printed = capsys.readouterr().out

    result = json.loads(out.read_text())
    assert set(result) == {"date", "command", "args", "categories", "prompts", "rows", "table"}
    assert result["categories"] == ["alpha", "beta"]
    assert result["prompts"] == {"alpha": PROMPTS_PER_CATEGORY, "beta": PROMPTS_PER_CATEGORY}
    assert result["args"]["k"] == K and result["args"]["ratios"] == [["carryover", "none"]]
    assert list(result["rows"]) == ["none", "carryover"]
    for name, row in result["rows"].items():
        assert set(row["categories"]) == {"alpha", "beta"}
        parts = [*row["categories"].values(), row["warmup"]]
        for counter in ("drafts", "draft_tokens", "accepted"):
            assert sum(p[counter] for p in parts) == row["engine_counters"][counter], name
        per_pos = [sum(p["accepted_per_pos"][i] for p in parts) for i in range(K)] \
            if name == "carryover" else []
        assert per_pos == row["engine_counters"]["accepted_per_pos"]
        for category, c in row["categories"].items():
            assert c["prompts"] == PROMPTS_PER_CATEGORY
            assert 0 < c["output_tokens"] <= PROMPTS_PER_CATEGORY * MAX_TOKENS
            assert c["tokens_per_s"] > 0
            assert f"[{name}] {category}: " in printed
        assert row["total"]["output_tokens"] == sum(
            c["output_tokens"] for c in row["categories"].values())

    assert all(c["drafts"] == 0 and c["tau"] is None
               for c in result["rows"]["none"]["categories"].values())
    carryover = result["rows"]["carryover"]
    assert carryover["speculative_config"]["model"] == str(drafter)
    assert carryover["drafter_sha256"]
    assert "[carryover] alpha: tau " in printed
    for c in carryover["categories"].values():
        assert c["drafts"] > 0 and c["draft_tokens"] == K * c["drafts"]
        assert c["tau"] >= 1 and len(c["accepted_per_pos"]) == K

    lines = result["table"].splitlines()
    assert lines[0] == "| category | none | carryover | carryover/none |"
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| alpha", "| beta", "| average"]
    assert all(line.count("|") == 5 and line.endswith("| - |") for line in lines[2:])
    assert result["table"] in printed


def test_sampled_eval_runs_at_the_given_temperature(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    target, drafter, out = tiny_eval_setup(tmp_path, monkeypatch)
    args = eval_parser().parse_args([
        "eval", "--target", str(target), "--data", "tiny", "--row", f"carryover:{drafter}",
        "-k", str(K), "--max-tokens", str(MAX_TOKENS), "--num-prompts", "1",
        "--temperature", "1", "--dtype", "float32", "--out", str(out)])
    args.fn(args)

    result = json.loads(out.read_text())
    assert result["args"]["temperature"] == 1.0
    assert all(c["drafts"] > 0 for c in result["rows"]["carryover"]["categories"].values())
    assert "drafts/step, temperature 1," in capsys.readouterr().out
