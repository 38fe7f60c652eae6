"""User experience: a bad carryover config ends a vLLM CLI with one line (patch 5).

5. `sys.excepthook`, only in a vLLM CLI process (`vllm serve`, `python -m
   vllm.entrypoints...`): a `CarryoverConfigError` that reaches the top ends the
   process like an argparse error, one line `vllm serve: error: <cause>` and exit
   status 2, instead of a traceback; every other exception goes to the previous
   hook. Library users (`LLM(...)`) still get the exception itself.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from types import TracebackType


def _cli_prog(argv: list[str]) -> str | None:
    """`vllm <subcommand>` or the module name when this process is a vLLM CLI, else None."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if main_spec is not None and main_spec.name.startswith("vllm.entrypoints"):
        return main_spec.name
    if argv and Path(argv[0]).name == "vllm":
        return " ".join(["vllm", *argv[1:2]])
    return None


def _install_cli_excepthook() -> None:
    """Make an uncaught CarryoverConfigError end a vLLM CLI with one line, exit status 2.

    Raising SystemExit from sys.excepthook makes CPython exit with that status
    (atexit handlers still run), so the exit matches argparse's for a bad flag.
    """
    from vllm_carryover.errors import CarryoverConfigError

    prog = _cli_prog(getattr(sys, "argv", []))
    previous = sys.excepthook
    if prog is None or getattr(previous, "_carryover", False):
        return

    def excepthook(exc_type: type[BaseException], exc: BaseException,
                   tb: TracebackType | None) -> None:
        if not isinstance(exc, CarryoverConfigError):
            previous(exc_type, exc, tb)
            return
        cause = " ".join(str(exc).split())
        with contextlib.suppress(OSError, ValueError):  # logs first, then the cause
            sys.stdout.flush()
        print(f"{prog}: error: {cause}", file=sys.stderr, flush=True)
        raise SystemExit(2)

    excepthook._carryover = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook
