"""One vLLM engine in a child process: started, talked to, and always stopped.

vLLM wants one engine per process, and a failed or stalled engine must not take
the caller down or leave processes behind. `EngineProcess` starts a child (a
module or a script, given a JSON job file), sends it JSON commands on its stdin
and reads JSON replies from a pipe of their own, so that vLLM's output (to a log
file) never mixes in. The child leads its own process group and dies with its
parent; `kill()` takes the whole group down and waits until its processes are
gone. `train eval`, the benchmarks and the tests' engine jobs all run through it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from vllm_carryover.tools.run_settings import REPO
from vllm_carryover.tools.server_process import die_with_parent

Reply = Callable[[dict[str, Any]], None]


def child_start() -> tuple[dict[str, Any], Reply]:
    """In the child (`argv`: JOB.json REPLY_FD): the job, and how to send a reply.

    On SIGTERM the child takes its whole group (the engine's processes) with it."""
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    job = json.loads(Path(sys.argv[1]).read_text())
    replies = os.fdopen(int(sys.argv[2]), "w")

    def reply(event: dict[str, Any]) -> None:
        replies.write(json.dumps(event) + "\n")
        replies.flush()

    return job, reply


def child_commands() -> Any:
    """In the child: the commands the parent sends, one JSON object each, until it closes."""
    return (json.loads(line) for line in sys.stdin)


class EngineProcess:
    """A child process owning one vLLM engine (see the module docstring).

    `entry` is a module name (`python -m entry`) or a script path; the child gets
    `JOB.json REPLY_FD` as arguments and uses `child_start()`.
    """

    def __init__(self, entry: str | Path, job: dict[str, Any], workdir: Path, name: str,
                 env: dict[str, str] | None = None, drop_env: tuple[str, ...] = (),
                 log_file: Path | None = None) -> None:
        self.name = name
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_file = log_file or workdir / f"{name}.log"
        job_file = workdir / f"{name}.json"
        job_file.write_text(json.dumps(job))
        child_env = {**os.environ, **(env or {})}
        for key in drop_env:
            child_env.pop(key, None)
        command = [sys.executable, str(entry)] if isinstance(entry, Path) else [
            sys.executable, "-m", entry]
        read_end, write_end = os.pipe()
        with self.log_file.open("wb") as log:
            self.proc = subprocess.Popen(
                [*command, str(job_file), str(write_end)], stdin=subprocess.PIPE,
                stdout=log, stderr=subprocess.STDOUT, env=child_env, cwd=REPO,
                pass_fds=(write_end,), start_new_session=True, preexec_fn=die_with_parent)
        os.close(write_end)
        self._replies: int | None = read_end
        self._buffer = b""

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        self.proc.stdin.flush()

    def receive(self, timeout_s: float) -> dict[str, Any]:
        """The next reply; fails with the log's tail if the engine dies or stalls."""
        assert self._replies is not None, "the engine process was killed"
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"engine {self.name}: no reply in {timeout_s:.0f} s; "
                                   f"last lines of {self.log_file}:\n{self.tail()}")
            if select.select([self._replies], [], [], min(left, 1.0))[0]:
                chunk = os.read(self._replies, 1 << 16)
                if not chunk:  # every writer has closed the pipe: the child is gone
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.proc.wait(5)
                    raise RuntimeError(self._exited())
                self._buffer += chunk
            elif self.proc.poll() is not None:
                raise RuntimeError(self._exited())
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def _exited(self) -> str:
        code = self.proc.returncode
        what = f"exited with {code}" if code is not None else "closed its reply pipe"
        return f"engine {self.name} {what}; last lines of {self.log_file}:\n{self.tail()}"

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])

    def kill(self, wait_s: float = 30.0) -> None:
        """SIGKILL the group, then wait until its processes are really gone: the
        engine's own processes are not our children, and a killed process with a
        large address space takes a moment to die."""
        try:
            members = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            members = []
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        if self._replies is not None:
            os.close(self._replies)
            self._replies = None
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(_alive(p) for p in members):
            time.sleep(0.1)


def _alive(process: psutil.Process) -> bool:
    """Running and not yet a zombie (a zombie holds no memory and no core)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
