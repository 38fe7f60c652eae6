"""Acceptance length from vLLM's spec-decode counters, and the table that shows it.

tau = 1 + accepted / drafts: tokens committed per verify step, bonus included.
vLLM's counters are cumulative, so one `generate` call's share is the difference
of the counters read before and after it.
"""

from __future__ import annotations

from typing import Any

COUNTERS = ("drafts", "draft_tokens", "accepted")


def counter_totals(raw: dict[str, Any]) -> dict[str, Any]:
    """vLLM's spec-decode counters under short names (zeros without speculation)."""
    return {"drafts": int(raw.get("spec_decode_num_drafts", 0) or 0),
            "draft_tokens": int(raw.get("spec_decode_num_draft_tokens", 0) or 0),
            "accepted": int(raw.get("spec_decode_num_accepted_tokens", 0) or 0),
            "accepted_per_pos": [int(v) for v in raw.get("accepted_per_pos", [])]}


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What one `generate` call added to vLLM's cumulative counters, with its tau."""
    a, b = counter_totals(after), counter_totals(before)
    out: dict[str, Any] = {c: a[c] - b[c] for c in COUNTERS}
    b_pos = b["accepted_per_pos"]
    out["accepted_per_pos"] = [x - (b_pos[i] if i < len(b_pos) else 0)
                               for i, x in enumerate(a["accepted_per_pos"])]
    out["tau"] = round(1 + out["accepted"] / out["drafts"], 4) if out["drafts"] else None
    return out


def pooled(parts: Any) -> dict[str, Any]:
    """All categories together: summed counters and tokens, tau of the sums."""
    parts = list(parts)
    out: dict[str, Any] = {c: sum(p[c] for p in parts) for c in
                           ("prompts", "output_tokens", *COUNTERS)}
    out["seconds"] = round(sum(p["seconds"] for p in parts), 3)
    out["tokens_per_s"] = round(out["output_tokens"] / out["seconds"], 2) \
        if out["seconds"] > 0 else None
    width = max((len(p["accepted_per_pos"]) for p in parts), default=0)
    out["accepted_per_pos"] = [sum(p["accepted_per_pos"][i] for p in parts
                                   if i < len(p["accepted_per_pos"])) for i in range(width)]
    out["tau"] = round(1 + out["accepted"] / out["drafts"], 4) if out["drafts"] else None
    return out


def mean_tau(row: dict[str, Any]) -> float | None:
    """The table's "average": unweighted mean of the categories' tau."""
    taus = [c["tau"] for c in row["categories"].values() if c["tau"] is not None]
    return sum(taus) / len(taus) if taus else None


def active_ratios(names: list[str], ratios: list[tuple[str, str]] | None,
                  defaults: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The ratio columns: the given ones (checked), or the defaults whose rows exist."""
    if ratios is None:
        return [(a, b) for a, b in defaults if a in names and b in names]
    unknown = sorted({n for pair in ratios for n in pair if n not in names})
    if unknown:
        raise SystemExit(f"--ratio names unknown rows {unknown}; rows: {', '.join(names)}")
    return ratios


def tau_table(result: dict[str, Any], metric: str = "tau") -> str:
    """Categories + "average" down, rows across, then the ratio columns."""
    rows, ratios = result["rows"], [tuple(r) for r in result["args"]["ratios"]]

    def cell(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    header = ["category", *rows, *(f"{a}/{b}" for a, b in ratios)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for category in result["categories"]:
        values = {n: r["categories"][category][metric] for n, r in rows.items()}
        lines.append("| " + " | ".join([category, *(cell(v) for v in values.values()),
                                        *(cell(ratio(values[a], values[b]))
                                          for a, b in ratios)]) + " |")
    if metric == "tau":
        avg = {n: mean_tau(r) for n, r in rows.items()}
    else:
        avg = {n: sum(r["categories"][c][metric] or 0 for c in result["categories"])
               / len(result["categories"]) for n, r in rows.items()}
    lines.append("| " + " | ".join(["average", *(cell(v) for v in avg.values()),
                                    *(cell(ratio(avg[a], avg[b])) for a, b in ratios)])
                 + " |")
    return "\n".join(lines)

