"""`python -m benchmarks draft-step`: latency of one drafting step, two rows side by side.

What is timed: the proposer's whole `propose` call inside the vLLM worker (the
drafter's context projection, its forward over the query block, sampling), via
`VLLM_CARRYOVER_STEP_TIMES` (`vllm_carryover.step_timer`). Scheduling, the
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
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from vllm_carryover.benchmarks.report import (
    DTYPE_HELP,
    DTYPES,
    default_dtype,
    default_out_dir,
    fmt,
    header,
    markdown_table,
    pyplot,
    ratio,
    write_json,
)

from vllm_carryover.engine_process import EngineProcess, child_commands, child_start
from vllm_carryover.rows import check_rows, parse_row
from vllm_carryover.run_settings import (
    REPO,
    SHIPPED_DRAFTERS,
    resolve_target,
    serve_max_model_len,
)
from vllm_carryover.step_timer import ENV, read_steps

SMOLLM2 = SHIPPED_DRAFTERS.relative_to(REPO)

CHILD_MODULE = "vllm_carryover.benchmarks.draft_step"
DEFAULT_DRAFTER = SMOLLM2 / "carryover"
KV_CACHE_BYTES = 1 << 30
GOAL_BATCH, GOAL_RATIO = 8, 1.05  # the goal: on/off <= 1.05 at batch 8
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


def _child() -> None:
    """Inside a row's process (`EngineProcess`): one engine, one reply per command.

    A command is `{"prompts": [token ids, ...], "max_tokens": N}`; its reply holds
    the step records the worker wrote meanwhile.
    """
    job, reply = child_start()
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=job["target"], speculative_config=job["speculative_config"],
              dtype=job["dtype"], enforce_eager=True,
              max_model_len=serve_max_model_len(job["target"]),
              kv_cache_memory_bytes=KV_CACHE_BYTES, seed=0)
    reply({"event": "ready", "startup_seconds": round(time.perf_counter() - start, 2)})
    steps_dir, offsets = os.environ[ENV], {}
    for cmd in child_commands():
        params = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"],
                                ignore_eos=True, detokenize=False)
        prompts = [{"prompt_token_ids": p} for p in cmd["prompts"]]
        read_steps(steps_dir, offsets)  # skip anything recorded before this command
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        reply({"event": "done", "seconds": round(time.perf_counter() - start, 3),
               "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
               "steps": read_steps(steps_dir, offsets)})


def kept_steps(steps: list[dict[str, Any]], batch: int, k: int,
               warmup: int) -> list[dict[str, Any]]:
    """Full-batch decode steps of one command, after its first `warmup` ones."""
    decode = [s for s in steps if s["batch"] == batch and s["tokens"] == batch * (k + 1)]
    return decode[warmup:]


def step_stats(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, p90 and mean step time (ms) and carried / rejected states per step."""
    if not steps:
        return {"steps": 0, "median_ms": None, "p90_ms": None, "mean_ms": None,
                "carried_per_step": None, "rejected_per_step": None}
    ms = np.array([s["seconds"] * 1e3 for s in steps])
    return {"steps": len(steps),
            "median_ms": round(float(np.median(ms)), 4),
            "p90_ms": round(float(np.percentile(ms, 90)), 4),
            "mean_ms": round(float(ms.mean()), 4),
            "carried_per_step": round(float(np.mean([s["carried"] for s in steps])), 3),
            "rejected_per_step": round(float(np.mean([s["rejected"] or 0 for s in steps])), 3)}


def row_specs(s: DraftStepSettings) -> tuple[str, str]:
    """The two rows measured: `s.rows`, or the drafter with carryover on and off."""
    if s.rows:
        if len(s.rows) != 2:
            raise SystemExit(f"draft-step compares two rows; got {len(s.rows)} --row")
        return s.rows[0], s.rows[1]
    return f"on=carryover:{s.drafter}", f"off=carryover-off:{s.drafter}"


def summary_table(result: dict[str, Any]) -> str:
    """One line per batch size: both rows' median and p90, the ratio, the counts."""
    first, second = names = list(result["rows"])
    lines = []
    for b in result["args"]["batches"]:
        on, off = (result["rows"][r]["batches"][str(b)] for r in names)
        lines.append([str(b), fmt(on["median_ms"], 2), fmt(on["p90_ms"], 2),
                      fmt(off["median_ms"], 2), fmt(off["p90_ms"], 2),
                      fmt(result["ratios"][str(b)]),
                      " ".join(fmt(r, 3) for r in result["ratios_per_repeat"][str(b)]),
                      f"{on['steps']} / {off['steps']}", fmt(on["carried_per_step"], 2)])
    return markdown_table(["batch", f"{first} median ms", f"{first} p90 ms",
                           f"{second} median ms", f"{second} p90 ms",
                           f"{first}/{second} (median)", f"{first}/{second} per repeat",
                           f"steps {first} / {second}", f"carried states / step ({first})"],
                          lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Step ms against batch size (median, p90 dashed) and the on/off ratio."""
    plt = pyplot()
    batches = result["args"]["batches"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(result["rows"])
    for name, color in zip(names, ("tab:red", "tab:blue"), strict=True):
        per = result["rows"][name]["batches"]
        left.plot(batches, [per[str(b)]["median_ms"] for b in batches], "o-", color=color,
                  label=f"{name} (median)")
        left.plot(batches, [per[str(b)]["p90_ms"] for b in batches], "--", color=color,
                  alpha=0.5, label=f"{name} (p90)")
    left.set(xscale="log", xlabel="batch size", ylabel="drafting step (ms)",
             title="drafting step latency")
    left.set_xticks(batches, [str(b) for b in batches])
    left.minorticks_off()
    left.legend()
    right.plot(batches, [result["ratios"][str(b)] for b in batches], "o-", color="black")
    right.axhline(1.0, color="gray", linewidth=0.8)
    right.set(xscale="log", xlabel="batch size", ylabel=f"{names[0]} / {names[1]} (median)",
              title="step time ratio")
    right.set_xticks(batches, [str(b) for b in batches])
    right.minorticks_off()
    if result["goal"]["ratio"] is not None:
        right.axhline(GOAL_RATIO, color="tab:green", linestyle=":",
                      label=f"goal {GOAL_RATIO}x")
        right.legend()
    fig.suptitle(f"{result['machine']['platform']}, {result['machine']['cpus']} CPUs, "
                 f"K={result['args']['k']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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


def _summarize(result: dict[str, Any], records: list[dict[str, Any]],
               s: DraftStepSettings) -> None:
    """Per row and batch the pooled step statistics, the on/off ratios (pooled and per
    repeat), the goal, and every command's raw steps; in place."""
    def kept(row: str, batch: int, rep: int | None = None) -> list[dict[str, Any]]:
        return [x for r in records if r["row"] == row and r["batch"] == batch
                and rep in (None, r["repeat"]) for x in r["kept"]]

    def median(row: str, batch: int, rep: int | None = None) -> float | None:
        return step_stats(kept(row, batch, rep))["median_ms"]

    first, second = names = list(result["rows"])

    def on_off(batch: int, rep: int | None = None) -> float | None:
        value = ratio(median(first, batch, rep), median(second, batch, rep))
        return None if value is None else round(value, 4)

    for name in names:
        result["rows"][name]["batches"] = {str(b): step_stats(kept(name, b))
                                           for b in s.batches}
        result["rows"][name]["commands"] = [
            {"repeat": r["repeat"], "batch": r["batch"], "seconds": r["seconds"],
             "output_tokens": r["output_tokens"], "kept": len(r["kept"]),
             "steps": [[round(x["seconds"] * 1e3, 3), x["batch"], x["tokens"], x["rejected"],
                        x["carried"]] for x in r["steps"]]}
            for r in records if r["row"] == name]
    result["raw_step_fields"] = ["ms", "batch", "tokens", "rejected", "carried"]
    result["ratios"] = {str(b): on_off(b) for b in s.batches}
    result["ratios_per_repeat"] = {str(b): [on_off(b, rep) for rep in range(s.repeats)]
                                   for b in s.batches}
    # the goal (carryover's own cost) is about the default on/off pair only
    goal = result["ratios"].get(str(GOAL_BATCH)) if names == ["on", "off"] else None
    result["goal"] = {"batch": GOAL_BATCH, "max_ratio": GOAL_RATIO, "ratio": goal,
                      "met": None if goal is None else goal <= GOAL_RATIO}
    result["table"] = summary_table(result)


def run_draft_step(s: DraftStepSettings, out: Path) -> dict[str, Any]:
    """Measure both rows interleaved; write JSON, markdown and PNG to `out`."""
    rows = [parse_row(spec) for spec in row_specs(s)]
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
    _summarize(result, records, s)
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


if __name__ == "__main__":
    _child()
