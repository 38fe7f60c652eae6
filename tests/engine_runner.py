"""Start `engine_job.py` in a subprocess and return its JSON result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

JOB = Path(__file__).with_name("engine_job.py")


def run_engine(job: dict[str, Any], workdir: Path, name: str,
               env: dict[str, str] | None = None, timeout: int = 900) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    inp, out, log = (workdir / f"{name}.{ext}" for ext in ("in.json", "out.json", "log"))
    inp.write_text(json.dumps(job))
    with log.open("w") as f:
        proc = subprocess.run([sys.executable, str(JOB), str(inp), str(out)], stdout=f,
                              stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                              timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"engine job {name} failed; log tail:\n"
                             + "\n".join(log.read_text().splitlines()[-40:]))
    return json.loads(out.read_text())
