"""`python -m benchmarks acceptance`: acceptance per category and per draft position.

Every row (no speculation, vLLM's n-gram, vLLM's suffix decoding with its defaults,
vLLM's in-tree DFlash on the baseline drafter, the carryover drafter with carryover
off, and on) runs offline in its own fresh vLLM engine process over the same held-out
prompts, greedy, one category after another (`vllm_carryover.tools.acceptance_eval` does the
running). With `--prompt-set outside` the prompts are the outside set's instead
(`outside_prompts`: public benchmarks' prompts no one here wrote), one category per
source. From vLLM's own spec-decode counters, per row and category:

  tau                      1 + accepted / drafts (tokens per verify step, bonus included)
  acceptance at position i accepted at draft position i / drafts
  output tokens/s          output tokens / wall time of the category's generate call

Writes acceptance.json, acceptance.md, acceptance_tau.png and
acceptance_per_position.png to --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from vllm_carryover.benchmarks.cli import SUFFIX_ROW, row_benchmark_parser
from vllm_carryover.benchmarks.eval_prompts import chat_token_ids, heldout_prompts
from vllm_carryover.benchmarks.outside_prompts import SOURCE_NAMES, outside_prompts
from vllm_carryover.benchmarks.report import (
    default_dtype,
    default_out_dir,
    fmt,
    header,
    markdown_table,
    pyplot,
    write_json,
)
from vllm_carryover.train.prompts import CATEGORIES

from vllm_carryover.tools.acceptance_eval import EvalSettings, run_eval
from vllm_carryover.tools.rows import Row, parse_ratio, parse_row
from vllm_carryover.tools.run_settings import REPO, SHIPPED_DRAFTERS, resolve_target
from vllm_carryover.tools.tau import mean_tau, tau_table

SMOLLM2 = SHIPPED_DRAFTERS.relative_to(REPO)

DEFAULT_ROWS = ["none", "ngram", SUFFIX_ROW, f"dflash=dflash:{SMOLLM2 / 'copy3-long'}",
                f"carryover-off=carryover-off:{SMOLLM2 / 'carryover'}",
                f"carryover=carryover:{SMOLLM2 / 'carryover'}"]
DEFAULT_RATIOS = [("carryover", "dflash"), ("carryover", "carryover-off")]
SIZES: dict[str, dict[str, int]] = {"quick": {"num_prompts": 2, "max_tokens": 32},
                                    "full": {"num_prompts": 16, "max_tokens": 128}}


def position_rates(part: dict[str, Any]) -> list[float]:
    """Acceptance rate of each draft position: accepted there / drafts."""
    drafts = part["drafts"]
    return [round(a / drafts, 4) for a in part["accepted_per_pos"]] if drafts else []


def add_rates(result: dict[str, Any]) -> None:
    """Per-position acceptance of every category and of the pooled total, in place."""
    for row in result["rows"].values():
        for part in [*row["categories"].values(), row["total"]]:
            part["acceptance_per_position"] = position_rates(part)


def summary_markdown(result: dict[str, Any]) -> str:
    """tau (with the ratio columns), output tokens/s against no speculation, and the
    pooled acceptance per draft position."""
    rows = result["rows"]
    parts = [f"### tau per category (K={result['args']['k']}, greedy, "
             f"{result['args']['max_tokens']} tokens, {result['args']['dtype']})",
             "", tau_table(result), "", "model runner: " + ", ".join(
                 f"{n} {r.get('model_runner', '?')}" for n, r in rows.items())]
    if "none" in rows:
        speed = {**result, "args": {**result["args"],
                                    "ratios": [[n, "none"] for n in rows if n != "none"]}}
        parts += ["", "### output tokens/s per category (one engine, all prompts of a "
                  "category in one batch)", "", tau_table(speed, metric="tokens_per_s")]
    spec = {n: r for n, r in rows.items() if r["total"]["drafts"]}
    if spec:
        width = max(len(r["total"]["acceptance_per_position"]) for r in spec.values())
        table = [[n, *(fmt(v) for v in r["total"]["acceptance_per_position"]),
                  fmt(r["total"]["tau"])] for n, r in spec.items()]
        parts += ["", "### acceptance rate per draft position (all categories)", "",
                  markdown_table(["row", *(f"pos {i + 1}" for i in range(width)), "tau"],
                                 table)]
    return "\n".join(parts) + "\n"


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    """Bars of tau per category and row; lines of acceptance per draft position."""
    plt = pyplot()
    cats = result["categories"]
    spec = {n: r for n, r in result["rows"].items() if r["total"]["drafts"]}
    files = []
    if not spec:
        return files
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(spec)
    for i, (name, row) in enumerate(spec.items()):
        taus = [row["categories"][c]["tau"] or 0 for c in cats] + [mean_tau(row) or 0]
        ax.bar([x + i * width for x in range(len(cats) + 1)], taus, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cats) + 1)], [*cats, "average"])
    ax.set_ylabel("tau = 1 + accepted / drafts")
    ax.set_ylim(bottom=1.0)
    ax.set_title(f"Acceptance length per category (K={result['args']['k']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(out / "acceptance_tau.png")
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, row in spec.items():
        rates = row["total"]["acceptance_per_position"]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.set_title("Acceptance per draft position (all categories)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(out / "acceptance_per_position.png")
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)
    return files


def acceptance_prompts(settings: EvalSettings, prompt_set: str, seed: int
                       ) -> dict[str, list[list[int]]]:
    """`settings.num_prompts` chat-templated prompts per category: the held-out split's
    categories, or the outside set's sources (the first of each in `outside_prompts`'
    order for `seed`)."""
    if prompt_set == "heldout":
        categories = tuple(settings.categories or CATEGORIES)
        return chat_token_ids(settings.target,
                              heldout_prompts(settings.num_prompts, categories, seed))
    by_source: dict[str, list[Any]] = {name: [] for name in SOURCE_NAMES}
    for p in outside_prompts(seed=seed):
        if len(by_source[p.source]) < settings.num_prompts:
            by_source[p.source].append(p)
    return chat_token_ids(settings.target, by_source)


def run_acceptance(rows: list[Row], settings: EvalSettings, out: Path,
                   seed: int = 0, prompt_set: str = "heldout") -> dict[str, Any]:
    """Measure every row on the prompt set; write the JSON, markdown and plots."""
    prompts = acceptance_prompts(settings, prompt_set, seed)
    result = run_eval(rows, settings, out / "acceptance.json", prompts)
    result = {**header(), **{k: v for k, v in result.items() if k not in ("date", "command")}}
    result["args"]["prompt_set"] = prompt_set
    result["args"]["prompt_seed"] = seed
    add_rates(result)
    result["summary"] = summary_markdown(result)
    result["plots"] = [p.name for p in plot(result, out)]
    write_json(out / "acceptance.json", result)
    (out / "acceptance.md").write_text(result["summary"])
    return result


def _cmd_acceptance(a: argparse.Namespace) -> None:
    if a.prompt_set == "outside" and a.categories:
        raise SystemExit("--categories picks held-out categories; the outside set's "
                         f"categories are its sources ({', '.join(SOURCE_NAMES)})")
    size = SIZES["quick" if a.quick else "full"]
    target = resolve_target(a.target)
    rows = a.row or [parse_row(r) for r in DEFAULT_ROWS]
    settings = EvalSettings(target=target, categories=a.categories,
                            num_prompts=a.num_prompts or size["num_prompts"],
                            max_tokens=a.max_tokens or size["max_tokens"], k=a.k,
                            dtype=a.dtype or default_dtype(), ratios=a.ratio,
                            default_ratios=DEFAULT_RATIOS)
    out = Path(a.out) if a.out else default_out_dir("acceptance")
    result = run_acceptance(rows, settings, out, seed=a.seed, prompt_set=a.prompt_set)
    print("\n" + result["summary"])
    print(f"{out}/acceptance.json")
    for plot_file in result["plots"]:
        print(f"{out}/{plot_file}")


def add_cli(subparsers: Any) -> None:
    """The `acceptance` subcommand of `python -m benchmarks`."""
    p = row_benchmark_parser(
        subparsers, "acceptance", "tau, acceptance per draft position and tokens/s per "
        "category", __doc__, DEFAULT_ROWS, SIZES,
        num_prompts_help="prompts per held-out category or outside source (default: by size)")
    p.add_argument("--ratio", action="append", type=parse_ratio, metavar="NUM/DEN",
                   help="a tau ratio column (default: carryover/dflash, carryover/carryover-off)")
    p.add_argument("--seed", type=int, default=0, help="which prompts are drawn")
    p.add_argument("--prompt-set", choices=("heldout", "outside"), default="heldout",
                   help="heldout: the training corpora's held-out split, by category "
                   "(default); outside: public benchmarks' prompts, by source, "
                   "--num-prompts of each")
    p.set_defaults(fn=_cmd_acceptance)
