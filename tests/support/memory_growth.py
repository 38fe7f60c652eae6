"""Resident memory of a `vllm serve` process tree over a long mixed workload.

Runs the soak test's request mix (random prompt and output lengths, 20% of the
streams aborted mid-way, a KV cache small enough to preempt) in phases against
one server and prints each process's RSS after every phase, with carryover on
and then off, so growth caused by carryover can be told apart from the engine's
own. Example:

    cd tests && python -m support.memory_growth --phases 4 --requests-per-phase 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import psutil

from support.soak_workload import (
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    drive,
    make_requests,
)
from vllm_carryover.tools.run_settings import MAIN_DRAFTER, SHIPPED_DRAFTERS
from vllm_carryover.tools.server_process import VllmServer
from vllm_carryover.tools.testbed import smollm2_path

DRAFTER = SHIPPED_DRAFTERS / MAIN_DRAFTER


def rss_by_process(server: VllmServer) -> dict[str, float]:
    assert server.proc is not None
    root = psutil.Process(server.proc.pid)
    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            out[p.name()] = out.get(p.name(), 0.0) + p.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            continue
    return out


def run(carryover: bool, args: argparse.Namespace) -> list[dict[str, float]]:
    target = smollm2_path()
    spec = {"method": "carryover", "model": str(args.drafter),
            "num_speculative_tokens": args.k, "carryover": carryover}
    log = Path(args.log_dir) / f"serve-carryover-{'on' if carryover else 'off'}.log"
    rows = []
    with VllmServer(target, log, speculative_config=spec, dtype="float32",
                    max_model_len=MAX_MODEL_LEN, kv_cache_bytes=KV_CACHE_BYTES) as server:
        rows.append({"phase": 0, "requests": 0, **rss_by_process(server)})
        for phase in range(1, args.phases + 1):
            start = time.perf_counter()
            reqs = make_requests(target, args.requests_per_phase, seed=100 + phase)
            asyncio.run(drive(server.url, str(target), reqs))
            rows.append({"phase": phase, "requests": phase * args.requests_per_phase,
                         "seconds": round(time.perf_counter() - start, 1),
                         **rss_by_process(server)})
            print(f"carryover={carryover} " + json.dumps(
                {k: round(v, 1) if isinstance(v, float) else v for k, v in rows[-1].items()}),
                flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", type=int, default=4)
    parser.add_argument("--requests-per-phase", type=int, default=64)
    parser.add_argument("--k", type=int, default=7, help="num_speculative_tokens")
    parser.add_argument("--drafter", type=Path, default=DRAFTER)
    parser.add_argument("--carryover", choices=["both", "on", "off"], default="both",
                        help="which servers to run (each one after the other)")
    parser.add_argument("--log-dir", default="results/memory_growth")
    parser.add_argument("--out", default="results/memory_growth/memory_growth.json")
    args = parser.parse_args()
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.carryover]
    result = {f"carryover_{'on' if c else 'off'}": run(c, args) for c in modes}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
