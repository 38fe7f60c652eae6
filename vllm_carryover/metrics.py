"""Carryover counters, counted where drafting happens and shown on vLLM's /metrics.

The proposer runs in a worker process; vLLM's Prometheus registry lives in the
API server process. Each worker keeps its counters in a small memory-mapped
file under a directory that the main process creates and hands down through
the environment (children inherit it); a Prometheus collector in the main
process sums the files. Nothing crosses the engine's own IPC.

With several API servers (`--api-server-count N`, or data parallelism) vLLM
serves /metrics in Prometheus multiprocess mode: each scrape builds a registry
that reads only the files under PROMETHEUS_MULTIPROC_DIR, so no collector can
join it. The workers then also count in prometheus_client counters, which in
that mode live in those files and are summed over processes: the engine's total,
once, on every API server.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

ENV_DIR = "VLLM_CARRYOVER_METRICS_DIR"

# name -> help text; the order is the layout of each worker's counter file.
COUNTERS: dict[str, str] = {
    "carryover_draft_rounds": "Request-rounds drafted by the carryover proposer.",
    "carryover_nonempty_slot_rounds": "Request-rounds whose draft attended to a non-empty "
    "carryover slot.",
    "carryover_rejected_states": "Rejected target states carried over into a slot.",
    "carryover_lookup_rounds": "Request-rounds whose draft began with the suffix lookup's "
    "tokens (for a drafter that reads them in its slots: whose first slot held one).",
    "carryover_lookup_only_steps": "Steps whose drafts all came from lookups, so the "
    "drafter's forward was skipped.",
    "carryover_drafter_gated_off_steps": "Of those, steps in which some request had no "
    "lookup run, but the lookups alone had measured faster at that batch size.",
}


def metrics_dir(create: bool = False) -> Path | None:
    """The counter directory of the current engine.

    `create=True` (the process that builds an engine config) makes a new one, so
    an engine never adds up the stale files of an earlier engine whose directory
    it inherited; its workers inherit the new one. The exception are the extra
    API servers of `vllm serve --api-server-count N` (and of data parallelism):
    they build the same engine config again, but must read the engine's own
    directory, which they inherited from the process that started the engine.
    """
    inherited = os.environ.get(ENV_DIR)
    if create and not (is_api_server_child() and inherited and Path(inherited).is_dir()):
        path = tempfile.mkdtemp(prefix="vllm-carryover-metrics-")
        os.environ[ENV_DIR] = path
        owner = os.getpid()
        atexit.register(lambda: os.getpid() == owner and shutil.rmtree(path, True))
    path = os.environ.get(ENV_DIR)
    return Path(path) if path else None


def is_api_server_child() -> bool:
    """Whether this process is one of the API servers vLLM spawns when it runs more than
    one: `APIServerProcessManager` names them ApiServer_<index>."""
    return multiprocessing.current_process().name.startswith("ApiServer_")


class CarryoverCounters:
    """Monotonic counters of one worker process, backed by a mapped file.

    `record` runs in every drafting round, so it never waits for the device: the
    counts accumulate in a device tensor, which is copied to pinned host memory
    without blocking, and a copy is published to the file once its event has
    completed (on CUDA the file thus lags the device by at most the rounds whose
    copy is still in flight; on CPU it is exact after every round).
    """

    def __init__(self, file: Path | None) -> None:
        if file is None:
            self._values = np.zeros(len(COUNTERS), dtype=np.int64)
        else:
            file.parent.mkdir(parents=True, exist_ok=True)
            self._values = np.memmap(file, dtype=np.int64, mode="w+", shape=(len(COUNTERS),))
        self._prometheus = _multiprocess_counters() if file is not None else None
        self._device: torch.Tensor | None = None  # running totals where drafting runs
        self._host: torch.Tensor | None = None  # their latest copy (pinned on CUDA)
        self._copied: torch.cuda.Event | None = None  # set when that copy has landed

    @classmethod
    def for_this_process(cls, tp_rank: int = 0) -> CarryoverCounters:
        """The worker's counters; only tensor-parallel rank 0 writes a file, since every
        rank of a TP group drafts the same requests."""
        base = metrics_dir()
        keep = base is not None and tp_rank == 0
        return cls(base / f"worker-{os.getpid()}.bin" if keep else None)

    def record(self, carried: torch.Tensor) -> None:
        """Count one drafting round; `carried` is the slot size of each request."""
        totals = self._totals_on(carried.device)
        c = carried.to(torch.int64)
        totals[0] += c.numel()
        totals[1] += (c > 0).sum()
        totals[2] += c.sum()
        self._publish(carried.device)

    def record_lookup(self, from_lookup: torch.Tensor, drafter_ran: bool,
                      gated_off: bool = False) -> None:
        """Count the requests whose draft began with a lookup's tokens, and the step if
        the drafter did not run (and if `drafter_gate` kept it off); `from_lookup` is
        [batch, K] bool (`suffix_lookup`)."""
        totals = self._totals_on(from_lookup.device)
        totals[3] += from_lookup[:, 0].sum()
        totals[4] += int(not drafter_ran)
        totals[5] += int(gated_off)
        self._publish(from_lookup.device)

    def _totals_on(self, device: torch.device) -> torch.Tensor:
        if self._device is None or self._device.device != device:
            self._device = torch.zeros(len(COUNTERS), dtype=torch.int64, device=device)
            self._host = torch.zeros(len(COUNTERS), dtype=torch.int64,
                                     pin_memory=device.type == "cuda")
        return self._device

    def _publish(self, device: torch.device) -> None:
        assert self._device is not None and self._host is not None
        if device.type != "cuda":  # the CPU (or another device: one blocking copy)
            self._store(self._device.cpu().numpy())
            return
        if self._copied is not None:
            if not self._copied.query():  # the last copy is still in flight
                return
            self._store(self._host.numpy())
        self._host.copy_(self._device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def _store(self, totals: np.ndarray) -> None:
        if self._prometheus is not None:
            for counter, delta in zip(self._prometheus, totals - self._values, strict=True):
                if delta:
                    counter.inc(int(delta))
        self._values[:] = totals

    def as_dict(self) -> dict[str, int]:
        return dict(zip(COUNTERS, (int(v) for v in self._values), strict=True))


def _multiprocess_counters() -> list[Any] | None:
    """prometheus_client counters backed by PROMETHEUS_MULTIPROC_DIR, when vLLM runs
    several API servers (None otherwise: the collector serves the counters)."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()  # not this process's global one: the files are the point
    return [Counter(f"vllm:{name}", text, registry=registry) for name, text in COUNTERS.items()]


def read_counters(base: Path | None = None) -> dict[str, int]:
    """Sum of all workers' counters (zeros when nothing was recorded)."""
    base = base or metrics_dir()
    total = np.zeros(len(COUNTERS), dtype=np.int64)
    for file in sorted(base.glob("worker-*.bin")) if base and base.is_dir() else []:
        values = np.fromfile(file, dtype=np.int64)
        if values.shape == total.shape:
            total += values
    return dict(zip(COUNTERS, (int(v) for v in total), strict=True))


def spec_decode_counters(llm: object) -> dict[str, object]:
    """vLLM's own spec-decode counters of an offline `LLM` (needs log stats on),
    plus `accepted_per_pos`: how often draft position i was accepted."""
    out: dict[str, object] = {}
    for m in llm.get_metrics():  # type: ignore[attr-defined]
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = list(m.values)
        elif m.name.startswith("vllm:spec_decode") and hasattr(m, "value"):
            out[m.name.removeprefix("vllm:")] = m.value
    return out


def acceptance_length(counters: dict[str, object]) -> float | None:
    """tau = 1 + accepted / drafts: tokens committed per verify step, bonus included."""
    drafts = float(counters.get("spec_decode_num_drafts", 0) or 0)
    accepted = float(counters.get("spec_decode_num_accepted_tokens", 0) or 0)
    return 1 + accepted / drafts if drafts else None


class _Collector:
    """Prometheus collector exposing `read_counters()` as `vllm:carryover_*_total`."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        for name, value in read_counters().items():
            family = CounterMetricFamily(f"vllm:{name}", COUNTERS[name])
            family.add_metric([], value)
            yield family


_registered = False


def register_prometheus_collector() -> None:
    """Expose the counters on this process's Prometheus registry (idempotent)."""
    global _registered
    if _registered:
        return
    from prometheus_client import REGISTRY

    REGISTRY.register(_Collector())
    _registered = True
