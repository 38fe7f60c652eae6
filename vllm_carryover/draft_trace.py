"""Optional per-round dump of the proposer's inputs and draft logits.

Set `VLLM_CARRYOVER_TRACE=DIR` and every drafting round of every worker writes
`DIR/<pid>-<round>.pt`: request ids, verify rows (fused target states and their
positions), rejected and carried counts, bonus tokens, query positions and ids, the
draft logits and, for a drafter with a Markov head, the drafted tokens. A step
that drafts nothing writes its rows alone (no logits): they are context too. Tests
replay these rounds through the plain PyTorch drafter to check the vLLM path
against an explicit computation; it is also a debugging aid.
Off by default; when off it costs nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

ENV = "VLLM_CARRYOVER_TRACE"


class DraftTrace:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._round = 0
        self._pending: dict[str, Any] | None = None

    @classmethod
    def from_env(cls) -> DraftTrace | None:
        path = os.environ.get(ENV)
        return cls(Path(path)) if path else None

    def begin(self, **inputs: torch.Tensor | list[str]) -> None:
        """Keep a round's inputs until its logits are known (a round begun before
        and never finished drafted nothing: it is written as context alone)."""
        self._write_pending()
        self._pending = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                         for k, v in inputs.items()}

    def finish(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> None:
        """Write the round: the backbone's logits and, when given, the drafted tokens."""
        if self._pending is None:
            return
        self._pending["logits"] = logits.detach().float().cpu()
        if drafts is not None:
            self._pending["drafts"] = drafts.detach().cpu()
        self._write_pending()

    def _write_pending(self) -> None:
        if self._pending is None:
            return
        torch.save(self._pending, self.directory / f"{os.getpid()}-{self._round:06d}.pt")
        self._round += 1
        self._pending = None


def load_rounds(directory: str | Path) -> list[dict[str, Any]]:
    """All traced rounds of a directory, in the order they were drafted."""
    files = sorted(Path(directory).glob("*.pt"),
                   key=lambda f: (f.stem.split("-")[0], int(f.stem.split("-")[1])))
    return [torch.load(f, weights_only=False) for f in files]
