"""Start `vllm serve` on 127.0.0.1 as a child process, and always stop it.

Used by the demo and the benchmarks: the server gets a free port, its output
goes to a log file, and leaving the `with` block (normally or by an exception,
including a server that fails to start) kills its whole process group and
session. If the starting process itself is killed, the server gets SIGTERM too
(PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from vllm_carryover.tools.run_settings import KV_CACHE_BYTES

PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)


_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None  # loaded before fork


def die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the process that started us dies,
    so a killed benchmark or test run does not leave a server behind (Linux)."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> bytes:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only
    with opener.open(url, timeout=timeout) as r:
        return r.read()


class VllmServer:
    """`with VllmServer(model, log, speculative_config=...) as s:` then use `s.url`."""

    def __init__(self, model: str | Path, log_file: str | Path,
                 speculative_config: dict[str, Any] | None = None, dtype: str = "bfloat16",
                 max_model_len: int = 2048, kv_cache_bytes: int = KV_CACHE_BYTES,
                 extra_args: list[str] | None = None, start_timeout: float = 300.0,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = Path(log_file)
        self.start_timeout = start_timeout
        self.cmd = ["vllm", "serve", str(model), "--host", "127.0.0.1",
                    "--port", str(self.port), "--dtype", dtype, "--enforce-eager",
                    "--max-model-len", str(max_model_len),
                    "--kv-cache-memory-bytes", str(kv_cache_bytes)]
        if speculative_config is not None:
            self.cmd += ["--speculative-config", json.dumps(speculative_config)]
        self.cmd += extra_args or []
        self.extra_env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> VllmServer:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_file.open("wb")
        env = {k: v for k, v in os.environ.items() if k != "VLLM_CARRYOVER_METRICS_DIR"}
        env.update(self.extra_env)
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True, preexec_fn=die_with_parent)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode} during "
                                   f"startup; last lines of {self.log_file}:\n{self.tail()}")
            try:
                _get(self.url + "/health", timeout=2)
                return
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"vllm serve not healthy after {self.start_timeout:.0f} s; "
                           f"see {self.log_file}:\n{self.tail()}")

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def metrics(self) -> dict[str, float]:
        """Unlabelled sums of the Prometheus counters on /metrics, by name."""
        out: dict[str, float] = {}
        for line in _get(self.url + "/metrics").decode().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return out

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL if it lingers, then
        SIGKILL to whatever is left in its session: Ray's raylet starts its agents
        in process groups of their own, and they can outlive the server by minutes."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        _kill_session(self.proc.pid)


def _kill_session(sid: int) -> None:
    """SIGKILL every live process of session `sid` (Linux: read from /proc)."""
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        try:
            if pid != os.getpid() and os.getsid(pid) == sid:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
