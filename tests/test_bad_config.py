"""A carryover speculative config that cannot work stops vLLM at startup, saying why.

The plugin validates inside `EngineArgs.create_speculative_config`, which runs in
the main process before any engine starts, so most cases build the engine config
in-process. Every bad-input case of issue 7 also runs through the real `vllm serve`
CLI: it must exit non-zero at startup with a one-line cause, no traceback, its port
closed and no process of its group left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from vllm_carryover import vllm_patches
from vllm_carryover.checkpoint import WEIGHTS_FILE, CarryoverConfigError
from vllm_carryover.server_process import free_port


def engine_config(target: Path, spec: dict[str, Any]) -> Any:
    """Build vLLM's engine config for `target` with speculative config `spec` (no engine)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(target),
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        kv_cache_memory_bytes=1 << 30,
        speculative_config=spec,
    ).create_engine_config()


def carryover(drafter: Path, **extra: Any) -> dict[str, Any]:
    return {"method": "carryover", "model": str(drafter), "num_speculative_tokens": 4,
            **extra}


@pytest.fixture
def drafter_copy(random_drafter: Path, tmp_path: Path) -> Path:
    """A private copy of the random drafter, free to break."""
    return Path(shutil.copytree(random_drafter, tmp_path / "drafter"))


def edit_config(drafter: Path, edit: Any) -> None:
    cfg_file = drafter / "config.json"
    cfg = json.loads(cfg_file.read_text())
    edit(cfg)
    cfg_file.write_text(json.dumps(cfg))


# Ways to break a drafter folder in place, shared by the in-process and CLI cases.


def remove_weights(drafter: Path) -> None:
    (drafter / WEIGHTS_FILE).unlink()


def truncate_weights(drafter: Path) -> None:
    weights = drafter / WEIGHTS_FILE
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(size // 2)


def corrupt_weights_header(drafter: Path) -> None:
    with (drafter / WEIGHTS_FILE).open("r+b") as f:
        f.write(b"\xff" * 8)


def shrink_norm_weight(drafter: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = str(drafter / WEIGHTS_FILE)
    state = load_file(weights)
    state["norm.weight"] = state["norm.weight"][:-1].clone()
    save_file(state, weights)


def use_other_vocabulary(drafter: Path) -> None:
    edit_config(drafter, lambda cfg: cfg.update(vocab_size=32000))


def read_layer_beyond_depth(drafter: Path) -> None:
    def edit(cfg: dict[str, Any]) -> None:
        cfg["dflash_config"]["target_layer_ids"][-1] = 40

    edit_config(drafter, edit)


# -- valid configs ---------------------------------------------------------------------


def test_valid_config_becomes_dflash_with_carryover_enabled(smollm2, random_drafter):
    config = engine_config(smollm2, carryover(random_drafter))
    spec = config.speculative_config
    assert spec.method == "dflash"
    assert spec.num_speculative_tokens == 4
    assert spec.draft_model_config.hf_config.carryover_runtime == {"enabled": True}


def test_carryover_false_keeps_dflash_with_carryover_disabled(smollm2, random_drafter):
    config = engine_config(smollm2, carryover(random_drafter, carryover=False))
    assert config.speculative_config.method == "dflash"
    assert config.speculative_config.draft_model_config.hf_config.carryover_runtime == {
        "enabled": False}


# -- bad speculative-config keys and values ----------------------------------------------


def test_unknown_key_is_refused_listing_allowed_keys(smollm2, random_drafter):
    with pytest.raises(CarryoverConfigError,
                       match=r"unknown key\(s\) \['bogus'\].*allowed keys: method, model, "
                       r"num_speculative_tokens.*carryover"):
        engine_config(smollm2, carryover(random_drafter, bogus=1))


def test_num_speculative_tokens_beyond_block_size_is_refused(smollm2, random_drafter):
    with pytest.raises(CarryoverConfigError,
                       match=r"num_speculative_tokens=8 .*block_size 8.*use 1\.\.7"):
        engine_config(smollm2, carryover(random_drafter, num_speculative_tokens=8))


@pytest.mark.parametrize("k", [0, -1])
def test_num_speculative_tokens_below_one_is_refused(smollm2, random_drafter, k):
    with pytest.raises(CarryoverConfigError,
                       match=rf"'num_speculative_tokens' must be at least 1, got {k}; leave "
                       r"it out"):
        engine_config(smollm2, carryover(random_drafter, num_speculative_tokens=k))


@pytest.mark.parametrize("k", [2.5, "4"])
def test_non_integer_num_speculative_tokens_is_refused(smollm2, random_drafter, k):
    with pytest.raises(CarryoverConfigError,
                       match=r"'num_speculative_tokens' must be an integer"):
        engine_config(smollm2, carryover(random_drafter, num_speculative_tokens=k))


def test_non_bool_carryover_flag_is_refused(smollm2, random_drafter):
    with pytest.raises(CarryoverConfigError,
                       match=r"'carryover' must be true or false, got 'yes'"):
        engine_config(smollm2, carryover(random_drafter, carryover="yes"))


def test_wrong_type_for_a_vllm_key_is_refused_in_one_line(smollm2, random_drafter):
    with pytest.raises(CarryoverConfigError,
                       match=r"^vLLM refused the carryover speculative config: max_model_len: "
                       r"Input should be a valid integer.* \(got 'x'\)$") as info:
        engine_config(smollm2, carryover(random_drafter, max_model_len="x"))
    assert "\n" not in str(info.value)


def test_unpadded_drafter_batch_is_refused(smollm2, random_drafter):
    with pytest.raises(CarryoverConfigError,
                       match=r"padded drafter batch.*disable_padded_drafter_batch"):
        engine_config(smollm2, carryover(random_drafter, disable_padded_drafter_batch=True))


# -- drafter that does not fit the target ------------------------------------------------


def test_drafter_for_other_hidden_size_is_refused(smollm2, tmp_path):
    from transformers import LlamaConfig

    from vllm_carryover.init_drafter import init_drafter

    tiny_target = tmp_path / "tiny_target"
    LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32).save_pretrained(tiny_target)
    drafter = init_drafter(tiny_target, tmp_path / "tiny_drafter", block_size=8)
    with pytest.raises(CarryoverConfigError,
                       match=r"built for hidden size 128 .*target's hidden size is 576"):
        engine_config(smollm2, carryover(drafter))


def test_vocabulary_mismatch_is_refused(smollm2, drafter_copy):
    use_other_vocabulary(drafter_copy)
    with pytest.raises(CarryoverConfigError,
                       match=r"vocabulary size 32000 but the target has 49152"):
        engine_config(smollm2, carryover(drafter_copy))


def test_target_layer_beyond_target_depth_is_refused(smollm2, drafter_copy):
    read_layer_beyond_depth(drafter_copy)
    with pytest.raises(CarryoverConfigError,
                       match=r"reads target layers \[40\], outside 0\.\.28 of a 30-layer"):
        engine_config(smollm2, carryover(drafter_copy))


# -- broken drafter folder ---------------------------------------------------------------


def test_missing_drafter_folder_is_refused(smollm2, tmp_path):
    missing = tmp_path / "no_such_drafter"
    with pytest.raises(CarryoverConfigError, match=rf"drafter folder {missing} does not exist"):
        engine_config(smollm2, carryover(missing))


def test_missing_config_json_is_refused(smollm2, drafter_copy):
    (drafter_copy / "config.json").unlink()
    with pytest.raises(CarryoverConfigError, match=r"has no config\.json"):
        engine_config(smollm2, carryover(drafter_copy))


def test_missing_weights_file_is_refused(smollm2, drafter_copy):
    remove_weights(drafter_copy)
    with pytest.raises(CarryoverConfigError, match=rf"has no {WEIGHTS_FILE}"):
        engine_config(smollm2, carryover(drafter_copy))


def test_truncated_weights_file_is_refused(smollm2, drafter_copy):
    truncate_weights(drafter_copy)
    with pytest.raises(CarryoverConfigError,
                       match=rf"{WEIGHTS_FILE} is truncated or corrupt \(tensor data ends"):
        engine_config(smollm2, carryover(drafter_copy))


def test_corrupt_weights_header_is_refused(smollm2, drafter_copy):
    corrupt_weights_header(drafter_copy)
    with pytest.raises(CarryoverConfigError,
                       match=rf"{WEIGHTS_FILE} is truncated or corrupt \(header length"):
        engine_config(smollm2, carryover(drafter_copy))


def test_tensor_of_wrong_shape_is_refused(smollm2, drafter_copy):
    shrink_norm_weight(drafter_copy)
    with pytest.raises(CarryoverConfigError,
                       match=r"tensor norm\.weight has shape \[575\] but config\.json "
                       r"implies \[576\]"):
        engine_config(smollm2, carryover(drafter_copy))


def add_markov_head_weights(drafter: Path, rank: int = 4) -> None:
    from safetensors.torch import load_file, save_file

    from vllm_carryover.markov_head import fresh_markov_state

    weights = str(drafter / WEIGHTS_FILE)
    save_file(load_file(weights) | fresh_markov_state(49152, rank), weights)


def test_markov_head_weights_without_markov_rank_are_refused(smollm2, drafter_copy):
    add_markov_head_weights(drafter_copy)
    with pytest.raises(CarryoverConfigError,
                       match=r"hold a Markov head .* config\.json has no markov_rank; add "
                       r"\"markov_rank\": R"):
        engine_config(smollm2, carryover(drafter_copy))


def test_markov_rank_without_head_weights_is_refused(smollm2, drafter_copy):
    edit_config(drafter_copy, lambda cfg: cfg.update(markov_rank=4))
    with pytest.raises(CarryoverConfigError,
                       match=r"lack 2 tensors \(first: markov_head\.markov_w1\.weight\)"):
        engine_config(smollm2, carryover(drafter_copy))


def test_markov_head_of_another_rank_than_the_config_is_refused(smollm2, drafter_copy):
    add_markov_head_weights(drafter_copy, rank=4)
    edit_config(drafter_copy, lambda cfg: cfg.update(markov_rank=8))
    with pytest.raises(CarryoverConfigError,
                       match=r"markov_head\.markov_w1\.weight has shape \[49152, 4\] but "
                       r"config\.json implies \[49152, 8\]"):
        engine_config(smollm2, carryover(drafter_copy))


@pytest.mark.parametrize("rank", [-1, 2.5, "8"])
def test_markov_rank_that_is_not_a_count_is_refused(smollm2, drafter_copy, rank):
    edit_config(drafter_copy, lambda cfg: cfg.update(markov_rank=rank))
    with pytest.raises(CarryoverConfigError, match=r"markov_rank .* must be a non-negative int"):
        engine_config(smollm2, carryover(drafter_copy))


# -- the CLI exception hook --------------------------------------------------------------


@pytest.fixture
def cli_process(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Pretend to be `vllm serve` with a recording excepthook; returns what it records."""
    seen: list[tuple[Any, ...]] = []
    monkeypatch.setattr(sys, "argv", ["/usr/bin/vllm", "serve", "model"])
    monkeypatch.setattr(sys, "excepthook", lambda *exc: seen.append(exc))
    return seen


def test_cli_hook_turns_carryover_error_into_one_line_and_exit_2(cli_process, capsys):
    vllm_patches._install_cli_excepthook()
    with pytest.raises(SystemExit) as info:
        sys.excepthook(CarryoverConfigError, CarryoverConfigError("bad\ndrafter"), None)
    assert info.value.code == 2
    assert capsys.readouterr().err == "vllm serve: error: bad drafter\n"
    assert cli_process == []


def test_cli_hook_leaves_other_exceptions_to_the_previous_hook(cli_process, capsys):
    vllm_patches._install_cli_excepthook()
    error = RuntimeError("not ours")
    sys.excepthook(RuntimeError, error, None)
    assert cli_process == [(RuntimeError, error, None)]
    assert capsys.readouterr().err == ""


def test_cli_hook_is_not_installed_for_library_users(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/usr/bin/python", "my_script.py"])
    hook = sys.excepthook
    vllm_patches._install_cli_excepthook()
    assert sys.excepthook is hook


# -- the real CLI ------------------------------------------------------------------------

CLI_TIMEOUT_S = 240
CLI_WORKERS = 3


@dataclass(frozen=True)
class CliCase:
    """One bad input for `vllm serve`: how to make it, and what the error line must say."""

    spec: dict[str, Any] | str
    expected: str
    break_drafter: Callable[[Path], None] | None = None


CLI_CASES: dict[str, CliCase] = {
    "malformed_json": CliCase('{"method": "carryover", "model": ',
                              "argument --speculative-config/-sc: Value {"),
    "unknown_key": CliCase({"bogus": 1}, "unknown key(s) ['bogus']"),
    "wrong_type_ours": CliCase({"num_speculative_tokens": "4"},
                               "'num_speculative_tokens' must be an integer, got '4'"),
    "wrong_type_vllm": CliCase({"max_model_len": "x"},
                               "vLLM refused the carryover speculative config: max_model_len: "
                               "Input should be a valid integer"),
    "k_zero": CliCase({"num_speculative_tokens": 0},
                      "'num_speculative_tokens' must be at least 1, got 0"),
    "k_beyond_block": CliCase({"num_speculative_tokens": 8},
                              "num_speculative_tokens=8 but drafter"),
    "missing_weights": CliCase({}, f"has no {WEIGHTS_FILE}", remove_weights),
    "truncated_weights": CliCase({}, "is truncated or corrupt (tensor data ends",
                                 truncate_weights),
    "corrupt_header": CliCase({}, "is truncated or corrupt (header length",
                              corrupt_weights_header),
    "wrong_shape": CliCase({}, "tensor norm.weight has shape [575] but config.json implies "
                           "[576]", shrink_norm_weight),
    "other_vocabulary": CliCase({}, "vocabulary size 32000 but the target has 49152",
                                use_other_vocabulary),
    "layer_beyond_depth": CliCase({}, "reads target layers [40], outside 0..28",
                                  read_layer_beyond_depth),
}


@dataclass(frozen=True)
class CliRun:
    """What one `vllm serve` run left behind."""

    returncode: int | None
    seconds: float
    stdout: str
    stderr: str
    port_open: bool
    survivors: list[str]


def port_is_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def group_members(pgid: int) -> list[str]:
    """Live processes of process group `pgid`, as "pid name"."""
    members = []
    for proc in psutil.process_iter(["pid", "name"]):
        try:
            if os.getpgid(proc.info["pid"]) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(f"{proc.info['pid']} {proc.info['name']}")
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def run_vllm_serve(target: Path, spec_arg: str, log_dir: Path) -> CliRun:
    """Run `vllm serve` in its own session until it exits (or CLI_TIMEOUT_S passes)."""
    port = free_port()
    command = [
        "vllm", "serve", str(target), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
        "--kv-cache-memory-bytes", str(1 << 30), "--speculative-config", spec_arg,
    ]
    out_file, err_file = log_dir / "stdout.log", log_dir / "stderr.log"
    with out_file.open("wb") as out, err_file.open("wb") as err:
        started = time.monotonic()
        proc = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            returncode: int | None = proc.wait(timeout=CLI_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            returncode = None
        seconds = time.monotonic() - started
    port_open = port_is_open(port)
    survivors = group_members(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return CliRun(returncode, seconds, out_file.read_text(errors="replace"),
                  err_file.read_text(errors="replace"), port_open, survivors)


@pytest.fixture(scope="module")
def cli_runs(smollm2: Path, random_drafter: Path,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, CliRun]:
    """Every CLI case, CLI_WORKERS at a time: each run spends ~15 s importing vLLM."""
    root = tmp_path_factory.mktemp("bad_cli")
    args: dict[str, tuple[str, Path]] = {}
    for name, case in CLI_CASES.items():
        case_dir = root / name
        case_dir.mkdir()
        drafter = random_drafter
        if case.break_drafter is not None:
            drafter = Path(shutil.copytree(random_drafter, case_dir / "drafter"))
            case.break_drafter(drafter)
        spec_arg = case.spec if isinstance(case.spec, str) else json.dumps(
            carryover(drafter, **case.spec))
        args[name] = (spec_arg, case_dir)
    started = time.monotonic()
    with ThreadPoolExecutor(CLI_WORKERS) as pool:
        futures = {name: pool.submit(run_vllm_serve, smollm2, spec_arg, case_dir)
                   for name, (spec_arg, case_dir) in args.items()}
        runs = {name: future.result() for name, future in futures.items()}
    timings = ", ".join(f"{name} {run.seconds:.0f}s" for name, run in runs.items())
    print(f"\n{len(runs)} vllm serve runs in {time.monotonic() - started:.0f} s "
          f"({CLI_WORKERS} at a time): {timings}")
    return runs


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_vllm_serve_stops_at_startup_with_a_one_line_cause(cli_runs, case):
    run = cli_runs[case]
    expected = CLI_CASES[case].expected
    output = run.stdout + run.stderr
    assert run.returncode is not None, f"still running after {CLI_TIMEOUT_S} s:\n{output}"
    assert run.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    stderr_lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert stderr_lines, output[-3000:]
    assert stderr_lines[-1].startswith("vllm serve: error: "), run.stderr[-3000:]
    assert expected in stderr_lines[-1], run.stderr[-3000:]
    assert sum(expected in line for line in output.splitlines()) == 1, output[-3000:]
    assert not run.port_open
    assert run.survivors == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
