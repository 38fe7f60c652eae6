"""A carryover speculative config that cannot work stops vLLM at startup, saying why.

The plugin validates inside `EngineArgs.create_speculative_config`, which runs in
the main process before any engine starts, so most cases build the engine config
in-process; one case checks that the real `vllm serve` CLI exits with the message.
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
from pathlib import Path
from typing import Any

import pytest

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


@pytest.mark.parametrize("k", [2.5, "4"])
def test_non_integer_num_speculative_tokens_is_refused(smollm2, random_drafter, k):
    with pytest.raises(CarryoverConfigError,
                       match=r"'num_speculative_tokens' must be an integer"):
        engine_config(smollm2, carryover(random_drafter, num_speculative_tokens=k))


def test_non_bool_carryover_flag_is_refused(smollm2, random_drafter):
    with pytest.raises(CarryoverConfigError,
                       match=r"'carryover' must be true or false, got 'yes'"):
        engine_config(smollm2, carryover(random_drafter, carryover="yes"))


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
    edit_config(drafter_copy, lambda cfg: cfg.update(vocab_size=32000))
    with pytest.raises(CarryoverConfigError,
                       match=r"vocabulary size 32000 but the target has 49152"):
        engine_config(smollm2, carryover(drafter_copy))


def test_target_layer_beyond_target_depth_is_refused(smollm2, drafter_copy):
    def edit(cfg: dict[str, Any]) -> None:
        cfg["dflash_config"]["target_layer_ids"][-1] = 40

    edit_config(drafter_copy, edit)
    with pytest.raises(CarryoverConfigError,
                       match=r"reads target layers \[40\], outside 0\.\.28 of a 30-layer"):
        engine_config(smollm2, carryover(drafter_copy))


# -- broken drafter folder ---------------------------------------------------------------


def test_missing_drafter_folder_is_refused(smollm2, tmp_path):
    missing = tmp_path / "no_such_drafter"
    with pytest.raises(CarryoverConfigError, match=rf"drafter folder {missing} does not exist"):
        engine_config(smollm2, carryover(missing))


def test_missing_weights_file_is_refused(smollm2, drafter_copy):
    (drafter_copy / WEIGHTS_FILE).unlink()
    with pytest.raises(CarryoverConfigError, match=rf"has no {WEIGHTS_FILE}"):
        engine_config(smollm2, carryover(drafter_copy))


def test_truncated_weights_file_is_refused(smollm2, drafter_copy):
    weights = drafter_copy / WEIGHTS_FILE
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CarryoverConfigError,
                       match=rf"{WEIGHTS_FILE} is truncated or corrupt \(tensor data ends"):
        engine_config(smollm2, carryover(drafter_copy))


def test_corrupt_weights_header_is_refused(smollm2, drafter_copy):
    weights = drafter_copy / WEIGHTS_FILE
    with weights.open("r+b") as f:
        f.write(b"\xff" * 8)
    with pytest.raises(CarryoverConfigError,
                       match=rf"{WEIGHTS_FILE} is truncated or corrupt \(header length"):
        engine_config(smollm2, carryover(drafter_copy))


def test_tensor_of_wrong_shape_is_refused(smollm2, drafter_copy):
    from safetensors.torch import load_file, save_file

    weights = str(drafter_copy / WEIGHTS_FILE)
    state = load_file(weights)
    state["norm.weight"] = state["norm.weight"][:-1].clone()
    save_file(state, weights)
    with pytest.raises(CarryoverConfigError,
                       match=r"tensor norm\.weight has shape \[575\] but config\.json "
                       r"implies \[576\]"):
        engine_config(smollm2, carryover(drafter_copy))


# -- the real CLI ------------------------------------------------------------------------


def port_is_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_vllm_serve_exits_with_the_message_on_a_bad_config(smollm2, random_drafter,
                                                            tmp_path):
    port = free_port()
    spec = {"method": "carryover", "model": str(random_drafter), "bogus": 1}
    log = tmp_path / "serve.log"
    command = [
        "vllm", "serve", str(smollm2), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
        "--kv-cache-memory-bytes", str(1 << 30), "--speculative-config", json.dumps(spec),
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        started = time.monotonic()
        try:
            rc = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"vllm serve still running after 90 s:\n{log.read_text()[-3000:]}")
        output = log.read_text()
        assert rc != 0, output[-3000:]
        assert time.monotonic() - started < 90
        assert "unknown key(s) ['bogus']" in output, output[-3000:]
        assert not port_is_open(port)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
