"""Optional wall time of every drafting step, for the draft-step benchmark.

Set `VLLM_CARRYOVER_STEP_TIMES=DIR` and every worker appends one JSON line per
proposer step to `DIR/worker-<pid>.jsonl`: the step's seconds, its batch size,
the verified target rows it got, the rejected drafts among them and the states
carried over (0 with carryover off). The time is taken around the proposer's
whole `propose` call, inside the worker, so it holds the drafting step only:
no scheduling, no target forward, no IPC. On CUDA the device is synchronized
before and after, so the time covers the kernels and not just their launch.
Off by default; when off the proposer skips it entirely.
"""

from __future__ import annotations

import inspect
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

ENV = "VLLM_CARRYOVER_STEP_TIMES"
FILE_GLOB = "worker-*.jsonl"

# vLLM passes propose()'s arguments by keyword today; binding also covers positions.
_PROPOSE = inspect.signature(SpecDecodeBaseProposer.propose)


@dataclass
class Step:
    """One timed step; the caller fills `carried` once the proposer has planned it."""

    batch: int
    tokens: int
    rejected: int | None
    carried: int = 0


class StepTimer:
    """Times proposer steps of one worker and appends them to its own file."""

    def __init__(self, directory: Path, device: torch.device) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.file = directory / f"worker-{os.getpid()}.jsonl"
        self._cuda = device.type == "cuda"

    @classmethod
    def from_env(cls, device: torch.device) -> StepTimer | None:
        path = os.environ.get(ENV)
        return cls(Path(path), device) if path else None

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    @contextmanager
    def step(self, proposer: Any, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Iterator[Step]:
        """Time the body, a `propose(*args, **kwargs)` call; write after the clock stops."""
        call = _PROPOSE.bind(proposer, *args, **kwargs).arguments
        rejected = call.get("num_rejected_tokens_gpu")
        step = Step(batch=call["common_attn_metadata"].batch_size(),
                    tokens=int(call["target_token_ids"].shape[0]),
                    rejected=int(rejected.sum()) if rejected is not None else None)
        self._sync()
        start = time.perf_counter()
        yield step
        self._sync()
        seconds = time.perf_counter() - start
        with self.file.open("a") as f:
            f.write(json.dumps({"seconds": seconds, "batch": step.batch, "tokens": step.tokens,
                                "rejected": step.rejected, "carried": step.carried}) + "\n")


def read_steps(directory: str | Path, offsets: dict[str, int]) -> list[dict[str, Any]]:
    """Complete records added to `directory` since `offsets` (file name -> bytes read),
    which is advanced; a half-written last line is left for the next call."""
    out: list[dict[str, Any]] = []
    for file in sorted(Path(directory).glob(FILE_GLOB)):
        data = file.read_bytes()[offsets.get(file.name, 0):]
        whole = data[:data.rfind(b"\n") + 1]
        offsets[file.name] = offsets.get(file.name, 0) + len(whole)
        out += [json.loads(line) for line in whole.splitlines() if line.strip()]
    return out
