"""`python -m benchmarks draft-step`: latency of one drafting step, two rows side by side.

What is timed: the proposer's whole `propose` call inside the vLLM worker (the
drafter's context projection, its forward over the query block, sampling), via
`VLLM_CARRYOVER_STEP_TIMES` (`vllm_carryover.control.step_timer`). Scheduling, the
target's verify forward and IPC are left out, so the step's own cost shows.

How: two real vLLM engines, each in its own process and alive the whole run, on
the same target. By default both serve the same carryover drafter, one with
`"carryover": true` ("on") and one with `"carryover": false` ("off", plain
DFlash drafting on the same weights); `--row NAME=SPEC` twice compares any two
rows instead (for example a drafter against its draft-vocabulary copy), the
ratio being first/second. Both get the same held-out prompts (categories mixed), greedy,
`ignore_eos`, all of a batch at once. Timings on this small shared CPU drift by
more than the effect, so the two rows are measured interleaved in one run: per
repeat and batch size, one engine generates while the other idles, then the
other (the order alternates), and the result is the ratio on/off of the median
step times. (Two engines generating at once would also fight over the cores
vLLM's CPU backend pins its workers to.)

Kept steps: full-batch decode steps (the requested batch, 1 + K verified rows
per request), minus the first `--warmup-steps` of each command. The batch fills
over the first steps (prefill) and thins out at the end, because requests that
accept more drafts reach `--max-tokens` sooner. Writes draft_step.json (with
every step), draft_step.md, draft_step.png and the engines' logs to --out.

This module runs the two engines and holds the CLI; each engine's own process is
`draft_step_engine`, and `draft_step_report` turns the timed steps into the
statistics, ratios, table and plot.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_carryover.benchmarks.draft_step_report import (
    kept_steps,
    plot,
    step_stats,
    summarize,
)
from vllm_carryover.benchmarks.report import (
    DTYPE_HELP,
    DTYPES,
    default_dtype,
    default_out_dir,
    fmt,
    header,
    write_json,
)

from vllm_carryover.control.step_timer import ENV
from vllm_carryover.tools.engine_process import EngineProcess
from vllm_carryover.tools.rows import Row, check_rows, parse_row
from vllm_carryover.tools.run_settings import (
    MAIN_DRAFTER,
    REPO,
    SHIPPED_DRAFTERS,
    resolve_target,
)

SMOLLM2 = SHIPPED_DRAFTERS.relative_to(REPO)

CHILD_MODULE = "vllm_carryover.benchmarks.draft_step_engine"
DEFAULT_DRAFTER = SMOLLM2 / MAIN_DRAFTER
PROMPTS_PER_CATEGORY = 8
WARMUP_TOKENS = 4  # warm-up command per engine: first shapes, allocator
SETTLE_S = 0.5  # pause between commands, so one engine is idle before the other runs
SIZES: dict[str, dict[str, Any]] = {
    "quick": {"batches": (1, 8), "repeats": 1, "max_tokens": 32},
    "full": {"batches": (1, 8, 32), "repeats": 3, "max_tokens": 64},
}

EPILOG = """\
sizes (explicit --batches / --repeats / --max-tokens win):
  --quick   batches 1 8, 1 repeat, 32 tokens (a few minutes on a 2-core CPU)
  full      batches 1 8 32, 3 repeats, 64 tokens

example:
  python -m benchmarks draft-step --quick
  python -m benchmarks draft-step --batches 1 8 --repeats 5 --out /tmp/draft-step
"""


@dataclass
class DraftStepSettings:
    """Everything one run measures with; recorded as the result's `args`."""

    target: str
    drafter: str = str(DEFAULT_DRAFTER)
    rows: tuple[str, ...] = ()  # two NAME=SPEC rows; empty: the drafter, carryover on/off
    batches: tuple[int, ...] = SIZES["full"]["batches"]
    repeats: int = SIZES["full"]["repeats"]
    max_tokens: int = SIZES["full"]["max_tokens"]
    k: int = 7
    dtype: str = "bfloat16"
    warmup_steps: int = 2
    timeout_s: float = 600.0  # per engine start and per command
    size: str = "full"


def _interleaved_prompts(target: str, n: int) -> list[list[int]]:
    """`n` held-out prompts as chat token ids, categories round-robin, so even a
    small batch mixes every category."""
    from vllm_carryover.benchmarks.eval_prompts import chat_token_ids, heldout_prompts

    per_category = chat_token_ids(target, heldout_prompts(PROMPTS_PER_CATEGORY))
    mixed = [p for group in zip(*per_category.values(), strict=True) for p in group]
    return [mixed[i % len(mixed)] for i in range(n)]


def compared_rows(s: DraftStepSettings) -> tuple[Row, Row]:
    """The two rows measured: `s.rows`, or the drafter with carryover on and off."""
    if s.rows:
        if len(s.rows) != 2:
            raise SystemExit(f"draft-step compares two rows; got {len(s.rows)} --row")
        return parse_row(s.rows[0]), parse_row(s.rows[1])
    return Row("on", f"carryover:{s.drafter}"), Row("off", f"carryover-off:{s.drafter}")


def _interleave(engines: dict[str, EngineProcess], prompts: list[list[int]],
                s: DraftStepSettings) -> list[dict[str, Any]]:
    """Every (repeat, batch) on both engines in turn, the order alternating; one
    record per command with all its steps and the kept ones."""
    records = []
    for rep in range(s.repeats):
        for i, batch in enumerate(s.batches):
            names = list(engines)
            for name in names if (rep + i) % 2 == 0 else names[::-1]:
                engines[name].send({"prompts": prompts[:batch], "max_tokens": s.max_tokens})
                reply = engines[name].receive(s.timeout_s)
                kept = kept_steps(reply["steps"], batch, s.k, s.warmup_steps)
                records.append({"row": name, "repeat": rep, "batch": batch,
                                "seconds": reply["seconds"],
                                "output_tokens": reply["output_tokens"],
                                "steps": reply["steps"], "kept": kept})
                st = step_stats(kept)
                print(f"[repeat {rep + 1}/{s.repeats}] batch {batch} {name}: {st['steps']} "
                      f"steps, median {fmt(st['median_ms'], 2)} ms, p90 "
                      f"{fmt(st['p90_ms'], 2)} ms, carried {fmt(st['carried_per_step'], 1)}"
                      f"/step ({reply['seconds']:.1f} s)", flush=True)
                time.sleep(SETTLE_S)
    return records


def run_draft_step(s: DraftStepSettings, out: Path) -> dict[str, Any]:
    """Measure both rows interleaved; write JSON, markdown and PNG to `out`."""
    rows = compared_rows(s)
    if rows[0].name == rows[1].name:
        raise SystemExit(f"draft-step: both rows are named {rows[0].name!r}; use NAME=SPEC")
    configs = check_rows(rows, s.k)  # fails on a missing drafter before anything starts
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="draft-step-") as tmp:
        engines: dict[str, EngineProcess] = {}
        try:
            for name in configs:
                job = {"target": s.target, "speculative_config": configs[name],
                       "dtype": s.dtype}
                engines[name] = EngineProcess(
                    CHILD_MODULE, job, Path(tmp), name, log_file=out / f"engine-{name}.log",
                    env={ENV: str(Path(tmp) / f"steps-{name}")},
                    drop_env=("VLLM_CARRYOVER_METRICS_DIR",))  # each engine makes its own
            # while the engines load:
            result: dict[str, Any] = {**header(), "args": asdict(s), "rows": {},
                                      "child_pids": [e.proc.pid for e in engines.values()]}
            result["machine"]["cpus_usable"] = len(os.sched_getaffinity(0))
            prompts = _interleaved_prompts(s.target, max(s.batches))
            for name, engine in engines.items():
                ready = engine.receive(s.timeout_s)
                print(f"[{name}] engine ready in {ready['startup_seconds']:.1f} s", flush=True)
                result["rows"][name] = {"speculative_config": configs[name],
                                        "startup_seconds": ready["startup_seconds"]}
                engine.send({"prompts": prompts, "max_tokens": WARMUP_TOKENS})
                engine.receive(s.timeout_s)  # warm-up, not measured
            records = _interleave(engines, prompts, s)
        finally:
            for engine in engines.values():
                engine.kill()
    summarize(result, records, s.batches, s.repeats)
    write_json(out / "draft_step.json", result)
    (out / "draft_step.md").write_text(
        f"### Drafting step, {' vs '.join(configs)} (K={s.k}, {s.dtype}, {s.max_tokens} tokens, "
        f"{s.repeats} repeat(s), interleaved)\n\n{result['table']}\n\n"
        f"`{result['command']}`, {result['date']}, {result['machine']['platform']}\n")
    plot(result, out / "draft_step.png")
    return result


def _cmd_draft_step(a: argparse.Namespace) -> None:
    size = SIZES["quick" if a.quick else "full"]
    target = resolve_target(a.target)
    settings = DraftStepSettings(
        target=target, drafter=a.drafter, rows=tuple(a.row or ()), k=a.k,
        dtype=a.dtype or default_dtype(),
        warmup_steps=a.warmup_steps,
        batches=tuple(a.batches or size["batches"]), repeats=a.repeats or size["repeats"],
        max_tokens=a.max_tokens or size["max_tokens"], timeout_s=a.timeout,
        size="quick" if a.quick else "full")
    out = Path(a.out) if a.out else default_out_dir("draft-step")
    result = run_draft_step(settings, out)
    print(f"\ndrafting step, {' vs '.join(result['rows'])} (K={settings.k}, "
          f"{settings.dtype}):\n")
    print(result["table"])
    goal = result["goal"]
    if goal["ratio"] is not None:
        print(f"\ngoal at batch {goal['batch']}: on/off {goal['ratio']:.3f} "
              f"{'<=' if goal['met'] else '>'} {goal['max_ratio']}")
    print(f"\n{out}")


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `draft-step` subcommand to `python -m benchmarks`'s subparsers."""
    p = subparsers.add_parser(
        "draft-step", help="drafting-step latency, carryover on vs off or two rows (interleaved)",
        description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the small size (see below)")
    p.add_argument("--batches", type=int, nargs="+", metavar="N",
                   help="batch sizes (concurrent requests)")
    p.add_argument("--repeats", type=int, metavar="N", help="passes over all batch sizes")
    p.add_argument("--max-tokens", type=int, metavar="N", help="new tokens per request")
    p.add_argument("--warmup-steps", type=int, default=2, metavar="N",
                   help="decode steps dropped at the start of each command")
    p.add_argument("--drafter", default=str(DEFAULT_DRAFTER), metavar="PATH",
                   help="carryover drafter folder (default: the shipped SmolLM2 one)")
    p.add_argument("--row", action="append", metavar="NAME=SPEC",
                   help="give twice to compare two rows instead of --drafter with carryover "
                   "on and off (SPEC: carryover:PATH, carryover-off:PATH, dflash:PATH or "
                   "JSON); the ratio is first/second")
    p.add_argument("--target", metavar="PATH",
                   help="target folder (default: the testbed SmolLM2 folder)")
    p.add_argument("-k", type=int, default=7, help="drafted tokens per step")
    p.add_argument("--dtype", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="seconds allowed per engine start and per command")
    p.add_argument("--out", metavar="DIR", help="result folder (default: "
                   "$VLLM_CARRYOVER_CACHE/benchmarks/draft-step/DATE-TIME)")
    p.set_defaults(fn=_cmd_draft_step)
    return p

