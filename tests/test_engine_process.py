"""The engine-process harness: replies arrive, a dying or silent child is reported with
its log, and `kill()` leaves nothing of the child's group behind. (Children here are
small scripts, not engines: the harness does not care what the child runs.)"""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from vllm_carryover.tools.engine_process import EngineProcess

ECHO = """
from vllm_carryover.tools.engine_process import child_commands, child_start
job, reply = child_start()
reply({"event": "ready", "job": job})
for command in child_commands():
    reply({"event": "done", "twice": 2 * command["x"]})
"""
CRASH = """
from vllm_carryover.tools.engine_process import child_start
child_start()
print("engine failed to load: out of memory", flush=True)
raise SystemExit(3)
"""
SILENT_WITH_GRANDCHILD = """
import subprocess, sys, time
from vllm_carryover.tools.engine_process import child_start
job, reply = child_start()
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
time.sleep(600)
"""


def script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return path


def test_child_gets_its_job_and_answers_each_command(tmp_path):
    with EngineProcess(script(tmp_path, "echo", ECHO), {"a": 1}, tmp_path, "echo") as child:
        assert child.receive(30) == {"event": "ready", "job": {"a": 1}}
        for x in (1, 5):
            child.send({"x": x})
            assert child.receive(30) == {"event": "done", "twice": 2 * x}


def test_a_child_that_dies_is_reported_with_its_log(tmp_path):
    with EngineProcess(script(tmp_path, "crash", CRASH), {}, tmp_path, "crash") as child, \
            pytest.raises(RuntimeError, match=r"(?s)exited with 3.*out of memory"):
        child.receive(30)


def test_a_silent_child_times_out_and_kill_takes_its_whole_group(tmp_path):
    child = EngineProcess(script(tmp_path, "silent", SILENT_WITH_GRANDCHILD), {}, tmp_path,
                          "silent")
    deadline = time.monotonic() + 30
    while not psutil.Process(child.proc.pid).children() and time.monotonic() < deadline:
        time.sleep(0.1)
    grandchildren = psutil.Process(child.proc.pid).children(recursive=True)
    assert grandchildren
    with pytest.raises(TimeoutError, match="no reply in 1 s"):
        child.receive(1)
    child.kill()
    assert not psutil.pid_exists(child.proc.pid) or psutil.Process(
        child.proc.pid).status() == psutil.STATUS_ZOMBIE
    assert not [p for p in grandchildren if p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]
