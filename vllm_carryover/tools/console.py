"""`vllm-carryover COMMAND ...`: one console command for the project's tools.

Each command is the same program as its `python -m` form, imported only when
chosen, so `vllm-carryover --help` stays fast and the plugin itself never
imports the training or benchmark code.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module with `main(argv, prog)`, what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("vllm_carryover.train.main", "make data; train, export and evaluate drafters"),
    "bench": ("vllm_carryover.benchmarks.main", "acceptance, serving and draft-step benchmarks"),
    "init-drafter": ("vllm_carryover.drafter.init_drafter", "write a random drafter for a target"),
    "testbed": ("vllm_carryover.tools.testbed",
                "build (once) and print the SmolLM2 testbed folder"),
    "demo": ("vllm_carryover.tools.demo", "serve SmolLM2 with carryover, show it answering"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return ("usage: vllm-carryover COMMAND [ARGS ...]\n\ncommands:\n" + "\n".join(lines)
            + "\n\n`vllm-carryover COMMAND --help` explains each; `train` and `bench` are also\n"
            "`python -m train` and `python -m benchmarks` inside the repository.")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        raise SystemExit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"vllm-carryover: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    importlib.import_module(COMMANDS[name][0]).main(rest, prog=f"vllm-carryover {name}")


if __name__ == "__main__":
    main()
