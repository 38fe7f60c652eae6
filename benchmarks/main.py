"""`python -m benchmarks {acceptance,serving,draft-step}`: carryover side by side with
what users would run instead, through real vLLM, on the same prompts in one run."""

from __future__ import annotations

import argparse

from vllm_carryover.benchmarks import acceptance, draft_step, serving


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks") -> None:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__,
        epilog="Each subcommand has --quick (a few minutes, for smoke checks) and --help.\n"
        "Results: a JSON file, a markdown summary and PNG plots in --out.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    acceptance.add_cli(sub)
    serving.add_cli(sub)
    draft_step.add_cli(sub)
    args = parser.parse_args(argv)
    args.fn(args)

