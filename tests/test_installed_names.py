"""The project installs under one name of its own: `vllm_carryover`, with kernels/,
train/ and benchmarks/ as `vllm_carryover.kernels`, `.train` and `.benchmarks`.

Outside the repository `import train` (or `kernels`, a Hugging Face package on PyPI)
must not resolve to this project, while every entry point works: the console
command, `python -m vllm_carryover.*` anywhere, and `python -m train` / `python -m
benchmarks` inside the repository. A wheel built from the tree holds nothing else.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOOL_FOLDERS = ("kernels", "train", "benchmarks")


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def test_the_folder_names_do_not_resolve_to_the_project_outside_the_repository(
        tmp_path: Path) -> None:
    probe = ("import importlib.util as u, json;"
             f"print(json.dumps({{n: getattr(u.find_spec(n), 'origin', None) "
             f"for n in {TOOL_FOLDERS!r}}}))")
    proc = run([sys.executable, "-c", probe], tmp_path)
    assert proc.returncode == 0, proc.stderr
    origins = json.loads(proc.stdout)
    for name, origin in origins.items():
        assert origin is None or not Path(origin).resolve().is_relative_to(REPO), (name, origin)
    proc = run([sys.executable, "-c", "import train"], tmp_path)
    assert proc.returncode != 0 and "No module named 'train'" in proc.stderr


@pytest.mark.parametrize("cmd", [
    ["vllm-carryover", "train", "--help"],
    ["vllm-carryover", "bench", "--help"],
    ["vllm-carryover", "init-drafter", "--help"],
    ["vllm-carryover", "testbed", "--help"],
    ["vllm-carryover", "demo", "--help"],
    [sys.executable, "-m", "vllm_carryover.train", "--help"],
    [sys.executable, "-m", "vllm_carryover.drafter.init_drafter", "--help"],
], ids=" ".join)
def test_every_entry_point_works_outside_the_repository(cmd: list[str], tmp_path: Path) -> None:
    """(`python -m vllm_carryover.benchmarks` is the same __main__ as `bench`, and slow to
    import: vLLM's argument parser.)"""
    if cmd[0] == "vllm-carryover":
        cmd = [str(Path(sys.executable).with_name("vllm-carryover")), *cmd[1:]]
    proc = run(cmd, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("usage:"), proc.stdout


@pytest.mark.parametrize("tool", ["train", "benchmarks"])
def test_python_m_of_a_tool_folder_works_inside_the_repository(tool: str) -> None:
    proc = run([sys.executable, "-m", tool, "--help"], REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"usage: python -m {tool}" in proc.stdout


def test_the_console_command_lists_its_commands_and_rejects_unknown_ones() -> None:
    exe = str(Path(sys.executable).with_name("vllm-carryover"))
    listing = run([exe, "--help"], REPO)
    assert listing.returncode == 0
    for name in ("train", "bench", "init-drafter", "testbed", "demo"):
        assert f"\n  {name} " in listing.stdout
    unknown = run([exe, "serve"], REPO)
    assert unknown.returncode == 2 and "unknown command 'serve'" in unknown.stderr


def test_a_wheel_of_the_tree_installs_only_the_vllm_carryover_package(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "datasets", "checkpoints", "results")
    for folder in ("vllm_carryover", *TOOL_FOLDERS):
        shutil.copytree(REPO / folder, src / folder, ignore=skip)
    proc = run([sys.executable, "-m", "pip", "wheel", "-q", ".", "--no-deps",
                "--no-build-isolation", "-w", str(tmp_path / "wheel")], src)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"vllm_carryover"}
    for module in ("kernels/__init__", "train/__main__", "benchmarks/__main__", "tools/console"):
        assert f"vllm_carryover/{module}.py" in names
