"""Run `engine_job.py` in an `EngineProcess` and return its reply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_carryover.tools.engine_process import EngineProcess

JOB = Path(__file__).with_name("engine_job.py")


def run_engine(job: dict[str, Any], workdir: Path, name: str,
               env: dict[str, str] | None = None, timeout: int = 900) -> dict[str, Any]:
    with EngineProcess(JOB, job, workdir, name, env=env) as engine:
        return engine.receive(timeout)
