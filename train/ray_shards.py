"""Ray for the work that is parallel over prompts (data generation).

A local Ray instance by default (one worker fits this 2-core machine), or an
existing cluster given its address (`--ray-address`), where the same code spreads
the shards over the nodes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


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
    AVX2 machine, `benchmarks.generation_rate`, in git history); workers sharing a node, or on a
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
