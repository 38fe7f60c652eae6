"""What every benchmark writes: a JSON result, a markdown summary and PNG plots.

Each result records when, where and how it was made (date, machine, versions,
the command line), because numbers from these small shared machines mean little
without that.
"""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from vllm_carryover.tools.run_settings import command_line
from vllm_carryover.tools.testbed import cache_root


def default_out_dir(benchmark: str) -> Path:
    """$VLLM_CARRYOVER_CACHE/benchmarks/NAME/DATE-TIME: a fresh folder per run."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return cache_root() / "benchmarks" / benchmark / stamp


DTYPES = ("bfloat16", "float16", "float32")
DTYPE_HELP = ("default: the machine's fastest: bfloat16 on a GPU or a CPU with native bf16 "
              "matmuls (AVX512-BF16, AMX), float32 on other CPUs, where bf16 is emulated")


def default_dtype() -> str:
    """The dtype a user would serve in: the machine's fastest (`vllm_carryover.dtype`)."""
    from vllm_carryover.dtype import fastest_dtype

    return fastest_dtype()


def cpu_model() -> str:
    """The CPU's model name (`platform.processor()` is empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def header() -> dict[str, Any]:
    """Date, machine and command line of this run."""
    import torch
    import vllm

    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": command_line(),
            "machine": {"platform": platform.platform(), "processor": cpu_model(),
                        "cpus": os.cpu_count(), "torch": torch.__version__,
                        "vllm": vllm.__version__}}


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def markdown_table(header_row: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header_row) + " |", "|" + "---|" * len(header_row)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def pyplot():
    """matplotlib without a display (the benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
