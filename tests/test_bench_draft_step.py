"""`python -m benchmarks draft-step` end to end, smaller than --quick.

Two real engines (SmolLM2 + the shipped carryover drafter, carryover on and
off), batches 1 and 4, one repeat, 16 tokens: the result must hold timed steps
for both rows at every batch size, carried states only with carryover on, its
three files, and no process of the benchmark may outlive it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
from vllm_carryover.benchmarks.draft_step import add_cli

from vllm_carryover.tools.run_settings import MAIN_DRAFTER, SHIPPED_DRAFTERS

DRAFTER = SHIPPED_DRAFTERS / MAIN_DRAFTER


def _session_members(leaders: list[int]) -> list[str]:
    """Live (not zombie) processes in the sessions of `leaders`, each engine child
    leading its own, so the engine's processes count too: "pid cmdline"."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) in leaders \
                    and (entry / "stat").read_text().rsplit(") ", 1)[1][0] != "Z":
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append(f"{entry.name} {cmdline}")
        except (ProcessLookupError, PermissionError, FileNotFoundError, IndexError):
            continue
    return found


def test_draft_step_quick(smollm2: Path, tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    assert (DRAFTER / "model.safetensors").is_file(), f"missing shipped drafter {DRAFTER}"
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    add_cli(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "out"
    args = parser.parse_args(["draft-step", "--quick", "--batches", "1", "4",
                              "--max-tokens", "16", "--target", str(smollm2),
                              "--drafter", str(DRAFTER), "--out", str(out)])
    args.fn(args)

    for name in ("draft_step.json", "draft_step.md", "draft_step.png"):
        assert (out / name).stat().st_size > 0, name
    result = json.loads((out / "draft_step.json").read_text())
    assert result["args"]["batches"] == [1, 4] and result["args"]["repeats"] == 1
    assert set(result["rows"]) == {"on", "off"}
    for name, row in result["rows"].items():
        assert set(row["batches"]) == {"1", "4"}
        for batch, stats in row["batches"].items():
            assert stats["steps"] > 0 and stats["median_ms"] > 0, (name, batch)
            assert stats["p90_ms"] >= stats["median_ms"]
            carried = stats["carried_per_step"]
            assert carried > 0 if name == "on" else carried == 0, (name, batch, carried)
    assert result["rows"]["off"]["speculative_config"]["carryover"] is False
    for batch in ("1", "4"):
        assert result["ratios"][batch] > 0
        assert len(result["ratios_per_repeat"][batch]) == 1
    assert result["goal"]["ratio"] is None  # no batch 8 in this run
    assert "| 4 |" in result["table"] and result["table"] in capsys.readouterr().out

    assert len(result["child_pids"]) == 2
    assert _session_members(result["child_pids"]) == [], "benchmark processes left behind"
