"""What `python -m benchmarks draft-step` makes of its timed steps: the kept
steps, their statistics, the ratio of the two rows, the goal, a table and a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from vllm_carryover.benchmarks.report import fmt, markdown_table, pyplot, ratio

GOAL_BATCH, GOAL_RATIO = 8, 1.05  # the goal: on/off <= 1.05 at batch 8


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


def summarize(result: dict[str, Any], records: list[dict[str, Any]],
              batches: tuple[int, ...], repeats: int) -> None:
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
                                           for b in batches}
        result["rows"][name]["commands"] = [
            {"repeat": r["repeat"], "batch": r["batch"], "seconds": r["seconds"],
             "output_tokens": r["output_tokens"], "kept": len(r["kept"]),
             "steps": [[round(x["seconds"] * 1e3, 3), x["batch"], x["tokens"], x["rejected"],
                        x["carried"]] for x in r["steps"]]}
            for r in records if r["row"] == name]
    result["raw_step_fields"] = ["ms", "batch", "tokens", "rejected", "carried"]
    result["ratios"] = {str(b): on_off(b) for b in batches}
    result["ratios_per_repeat"] = {str(b): [on_off(b, rep) for rep in range(repeats)]
                                   for b in batches}
    # the goal (carryover's own cost) is about the default on/off pair only
    goal = result["ratios"].get(str(GOAL_BATCH)) if names == ["on", "off"] else None
    result["goal"] = {"batch": GOAL_BATCH, "max_ratio": GOAL_RATIO, "ratio": goal,
                      "met": None if goal is None else goal <= GOAL_RATIO}
    result["table"] = summary_table(result)
