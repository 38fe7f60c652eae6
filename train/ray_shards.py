"""Run one function over shards of a work list on Ray workers.

Data generation and target-state extraction are embarrassingly parallel over
prompts. Both go through `map_shards`: a local Ray instance by default (one
worker fits this 2-core machine), or an existing cluster given its address
(`--ray-address`), where the same code spreads the shards over the nodes. Each
shard is one Ray task, so a model is loaded once per shard, not per item.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")
R = TypeVar("R")


def split_even(items: Sequence[T], shards: int) -> list[list[T]]:
    """`shards` contiguous, near-equal, non-empty slices of `items` (order kept)."""
    shards = max(1, min(shards, len(items)))
    size, extra = divmod(len(items), shards)
    out, start = [], 0
    for i in range(shards):
        end = start + size + (i < extra)
        out.append(list(items[start:end]))
        start = end
    return out


def map_shards(fn: Callable[..., list[R]], items: Sequence[T], *, workers: int,
               cpus_per_worker: int, address: str | None = None, desc: str = "shards",
               **kwargs: Any) -> list[R]:
    """`fn(shard, **kwargs)` on `workers` shards in Ray tasks; results concatenated in order.

    `fn` must be importable by the workers (a module-level function of this
    package). Each task may use `cpus_per_worker` cores (its OMP_NUM_THREADS).
    """
    import ray

    if not items:
        return []
    with ray_session(workers, cpus_per_worker, address):
        task = ray.remote(num_cpus=cpus_per_worker)(fn)
        shards = split_even(items, workers)
        refs = [task.remote(s, **kwargs) for s in shards]
        results: dict[Any, list[R]] = {}
        pending = list(refs)
        with tqdm(total=len(refs), desc=desc, unit="shard") as bar:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                results[done[0]] = ray.get(done[0])
                bar.update(1)
        return [r for ref in refs for r in results[ref]]


@contextmanager
def ray_session(workers: int, cpus_per_worker: int, address: str | None = None
                ) -> Iterator[None]:
    """Ray for the block: a local instance sized for `workers` tasks (started and shut
    down here), the cluster at `address`, or the session already running."""
    import ray

    if ray.is_initialized():
        yield
        return
    # Ray starts workers at nice 15; a local run's shards are the main work
    os.environ.setdefault("RAY_worker_niceness", "0")
    local = {} if address else {"num_cpus": workers * cpus_per_worker}
    ray.init(address=address, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": str(cpus_per_worker),
                                       "VLLM_CPU_OMP_THREADS_BIND":
                                           thread_binding(workers, cpus_per_worker, address),
                                       **_forwarded_env()}}, **local)
    try:
        yield
    finally:
        ray.shutdown()


def thread_binding(workers: int, cpus_per_worker: int, address: str | None) -> str:
    """vLLM's CPU thread binding for the workers' engines.

    By default vLLM's CPU worker binds one core and leaves the rest to its
    scheduler. One local worker that owns the machine's first cores binds its
    threads to them (26% more output tok/s than unbound threads on a 2-core
    AVX2 machine, `benchmarks.generation_rate`); workers sharing a node, or on a
    cluster, leave placement to the OS. A VLLM_CPU_OMP_THREADS_BIND set by the
    user wins.
    """
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    if address is None and workers == 1 and cpus_per_worker <= (os.cpu_count() or 1):
        return f"0-{cpus_per_worker - 1}"
    return "nobind"


def _forwarded_env() -> dict[str, str]:
    """Cache location and plugin settings the workers must share with the driver."""
    keys = ("VLLM_CARRYOVER_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONPATH")
    return {k: os.environ[k] for k in keys if k in os.environ}
