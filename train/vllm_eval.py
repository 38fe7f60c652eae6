"""`python -m train eval`: acceptance length per category on a dataset's held-out split.

The running (one fresh vLLM engine process per row, tau from vLLM's counters)
is `vllm_carryover.tools.acceptance_eval`, shared with `benchmarks acceptance`; this
module picks the prompts (the dataset's held-out split) and the default rows
(the shipped SmolLM2 drafters).
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from vllm_carryover.train.data import MANIFEST_FILE, load_samples, sampling_name
from vllm_carryover.train.paths import DEFAULT_DATA, cache_root, data_dir

from vllm_carryover.tools.acceptance_eval import EvalSettings, run_eval
from vllm_carryover.tools.rows import parse_ratio, parse_row, rows_help
from vllm_carryover.tools.run_settings import REPO, SHIPPED_DRAFTERS, resolve_target

SMOLLM2 = SHIPPED_DRAFTERS.relative_to(REPO)
DEFAULT_ROWS = [f"baseline=carryover-off:{SMOLLM2 / 'dflash-baseline'}",
                f"carryover=carryover:{SMOLLM2 / 'carryover'}",
                f"carryover-off=carryover-off:{SMOLLM2 / 'carryover'}",
                f"dspark-baseline=carryover-off:{SMOLLM2 / 'dspark-baseline'}",
                f"dspark-carryover=carryover:{SMOLLM2 / 'dspark-carryover'}"]
# Ratio columns shown whenever both rows exist (and no --ratio is given).
DEFAULT_RATIOS = [("carryover", "baseline"), ("carryover", "carryover-off"),
                  ("dspark-carryover", "dspark-baseline"), ("dspark-baseline", "baseline")]

ROW_HELP = rows_help(DEFAULT_ROWS) + """
ratio columns: --ratio NUM/DEN (repeatable) adds tau[NUM] / tau[DEN]; default:
  carryover/baseline, carryover/carryover-off, dspark-carryover/dspark-baseline and
  dspark-baseline/baseline, where both rows exist.
The "average" row is the unweighted mean over categories; the JSON also holds each
row's pooled totals and vLLM's raw counters.

example:
  python -m train eval -k 7 --num-prompts 16 \\
      --row baseline=carryover-off:train/checkpoints/smollm2-135m-instruct/dflash-baseline \\
      --row carryover=carryover:train/checkpoints/smollm2-135m-instruct/carryover \\
      --row carryover-off=carryover-off:train/checkpoints/smollm2-135m-instruct/carryover
"""


def resolve_data(data: str | Path) -> Path:
    """A dataset folder, or the name of one in the training cache."""
    path = Path(data).expanduser()
    return path.resolve() if (path / MANIFEST_FILE).is_file() else data_dir(str(data))


def heldout_prompts(data: Path, categories: list[str] | None, num_prompts: int,
                    target: str) -> dict[str, list[list[int]]]:
    """The first `num_prompts` held-out prompts of each category (default: all present).

    Without a dataset at `data`, the held-out prompts are built straight from the
    corpora (`train.prompts`, the same split rule), as the benchmarks do."""
    if not (data / MANIFEST_FILE).is_file():
        from vllm_carryover.train.prompts import CATEGORIES, build_prompts, prompt_token_ids

        print(f"no dataset at {data} (`python -m train data --name {data.name}` builds "
              "one); using held-out prompts built from the corpora", flush=True)
        wanted = tuple(categories or CATEGORIES)
        built = build_prompts(0, num_prompts, 0, wanted)
        return {c: prompt_token_ids(target, [p for p in built if p.category == c])
                for c in wanted}
    rows = load_samples(data, "heldout")
    present = sorted({r["category"] for r in rows})
    wanted_list = categories or present
    missing = [c for c in wanted_list if c not in present]
    if missing or not wanted_list:
        raise SystemExit(f"no held-out prompts for categories {missing or wanted_list} in "
                         f"{data}; present: {', '.join(present) or 'none'}")
    return {c: [r["prompt_ids"] for r in rows if r["category"] == c][:num_prompts]
            for c in wanted_list}


def _cmd_eval(a: argparse.Namespace) -> None:
    target = resolve_target(a.target)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(a.out) if a.out else cache_root() / "eval" / f"{stamp}.json"
    from vllm_carryover.dtype import resolve_dtype

    a.dtype = resolve_dtype(a.dtype)
    data = resolve_data(a.data)
    manifest = data / MANIFEST_FILE
    settings = EvalSettings(target=target, data=str(data), data_sha256=json.loads(
                                manifest.read_text()).get("sha256") if manifest.is_file() else None,
                            categories=a.categories, num_prompts=a.num_prompts,
                            max_tokens=a.max_tokens, k=a.k, dtype=a.dtype,
                            temperature=a.temperature, ratios=a.ratio,
                            default_ratios=DEFAULT_RATIOS)
    rows = a.row or [parse_row(r) for r in DEFAULT_ROWS]
    prompts = heldout_prompts(data, a.categories, a.num_prompts, target)
    result = run_eval(rows, settings, out, prompts)
    print(f"\ntau per category ({result['args']['k']} drafts/step, "
          f"{sampling_name(a.temperature)}, "
          f"{a.max_tokens} tokens, {a.dtype}):\n")
    print(result["table"])
    print(f"\n{out}")


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `eval` subcommand to `python -m train`'s subparsers."""
    p = subparsers.add_parser(
        "eval", help="acceptance length (tau) per prompt category through vLLM",
        description="Acceptance length tau = 1 + accepted / drafts per prompt category of\n"
        "the held-out split, from vLLM's spec-decode counters; greedy unless --temperature.\n"
        "Each row runs in its own process (one engine, categories one after another).\n"
        "Writes a JSON file and prints a markdown table.",
        epilog=ROW_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row", action="append", type=parse_row, metavar="NAME=SPEC",
                   help="a method to measure (repeatable, see below; default: baseline, "
                   "carryover, carryover-off on the shipped SmolLM2 drafters)")
    p.add_argument("--ratio", action="append", type=parse_ratio, metavar="NUM/DEN",
                   help="a tau ratio column (repeatable; default: see below)")
    p.add_argument("--target", metavar="PATH",
                   help="target folder (default: the testbed SmolLM2 folder)")
    p.add_argument("--data", default=DEFAULT_DATA,
                   help="dataset name in the cache, or a dataset folder")
    p.add_argument("--categories", nargs="+", metavar="CAT",
                   help="categories in table order (default: all in the held-out split, "
                   "sorted)")
    p.add_argument("--num-prompts", type=int, default=16, metavar="N",
                   help="held-out prompts per category (the first ones)")
    p.add_argument("--max-tokens", type=int, default=128, metavar="N", help="new tokens per prompt")
    p.add_argument("-k", type=int, default=7, help="drafted tokens per step")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature of every request; 0 is greedy (default: "
                   "%(default)s). Sampled rows differ in their outputs, so compare them over "
                   "many prompts")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto: bfloat16 on a GPU or a CPU with native bf16 matmuls, else "
                   "float32 (default: %(default)s)")
    p.add_argument("--out", metavar="PATH", help="JSON result file (default: "
                   "$VLLM_CARRYOVER_CACHE/train/eval/DATE.json)")
    p.set_defaults(fn=_cmd_eval)
    return p

