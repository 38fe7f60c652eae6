"""The options every row-based benchmark shares (`acceptance`, `serving`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from vllm_carryover.benchmarks.report import DTYPE_HELP, DTYPES
from vllm_carryover.train.prompts import CATEGORIES

from vllm_carryover.tools.rows import parse_row, rows_help

# vLLM's suffix decoding (arctic-inference; scripts/setup.sh builds it) with vLLM's
# defaults: up to suffix_decoding_max_tree_depth = 24 tokens a step, as many as its
# trees' probabilities back. Spelled out because a JSON row otherwise gets -k.
SUFFIX = {"method": "suffix", "num_speculative_tokens": 24}
SUFFIX_ROW = "suffix=" + json.dumps(SUFFIX)


def row_benchmark_parser(subparsers: Any, name: str, help_text: str, doc: str,
                         default_rows: list[str], sizes: dict[str, dict[str, Any]],
                         num_prompts_help: str = "held-out prompts per category (default: "
                         "by size)") -> argparse.ArgumentParser:
    """A subcommand with --quick, --row, --target, --categories, --num-prompts,
    --max-tokens, -k, --dtype and --out; the caller adds its own options."""
    p = subparsers.add_parser(
        name, help=help_text, description=doc,
        epilog=rows_help(default_rows) + "\nexample (the README's full run):\n"
        f"  python -m benchmarks {name} --out benchmarks/results/{name}\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"small size for smoke checks: {sizes['quick']} (full: {sizes['full']})")
    p.add_argument("--row", action="append", type=parse_row, metavar="NAME=SPEC",
                   help="a method to measure (repeatable; default: the rows below)")
    p.add_argument("--target", metavar="PATH", help="target folder (default: SmolLM2 testbed)")
    p.add_argument("--categories", nargs="+", choices=CATEGORIES, metavar="CAT",
                   help=f"prompt categories, in table order (default: {' '.join(CATEGORIES)})")
    p.add_argument("--num-prompts", type=int, metavar="N", help=num_prompts_help)
    p.add_argument("--max-tokens", type=int, metavar="N",
                   help="max new tokens per prompt (default: by size)")
    p.add_argument("-k", type=int, default=7, help="drafted tokens per step")
    p.add_argument("--dtype", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--out", metavar="DIR", help="result folder (default: "
                   f"$VLLM_CARRYOVER_CACHE/benchmarks/{name}/DATE)")
    return p
