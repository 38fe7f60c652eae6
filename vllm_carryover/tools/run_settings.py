"""What every measuring run shares: the checkout, the default target, the length limit.

`train eval`, the benchmarks and the demo all start vLLM on the same target with
the same serving length and record how they were started; one definition each.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]  # the checkout (shipped drafters, datasets)
SHIPPED_DRAFTERS = REPO / "train" / "checkpoints" / "smollm2-135m-instruct"
# The README main job's drafter among them: one layer, served beside SHIPPED_LOOKUPS.
MAIN_DRAFTER = "carryover-lookup"
# Outside a clone (an installed package) the shipped drafters are found through this
# variable: a folder holding MAIN_DRAFTER and the others, as the checkout's
# train/checkpoints/smollm2-135m-instruct does.
DRAFTERS_VAR = "VLLM_CARRYOVER_DRAFTERS"
# The shipped lookup beside the drafter: arctic-inference's suffix trees of the request's
# text and of past answers where they continue it, else the drafter's first token
# (docs/results.md).
SHIPPED_LOOKUPS = {"suffix_lookup": True, "lookup_drafter_k": 1}
# Serving length of every measuring run: the longest held-out prompt (1-2k-token
# passages) plus its answer fits.
SERVE_MAX_MODEL_LEN = 4096
# KV cache of one measuring engine (about 14k fp32 SmolLM2 tokens): room for a batch
# of held-out prompts without taking the memory a second engine needs.
KV_CACHE_BYTES = 1 << 30


def drafters_folder() -> Path:
    """The shipped SmolLM2 drafters: $VLLM_CARRYOVER_DRAFTERS, else the checkout's."""
    return Path(os.environ.get(DRAFTERS_VAR) or SHIPPED_DRAFTERS)


# vLLM's own CPU thread binding; a user who set either variable keeps it.
CPU_BINDING_VARS = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")
# numba's thread pool for vLLM's n-gram proposer (`serving_env`); a user's choice stays.
NUMBA_LAYER_VAR = "NUMBA_THREADING_LAYER"


def serving_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a server the demo or the serving benchmark starts: `extra`, and
    on a CPU vLLM's worker on every core of its NUMA node (unless the user's environment
    or `extra` chose a binding) with numba on its own thread pool (unless chosen too).

    By default vLLM's CPU worker leaves one core to the API server and the engine's
    scheduler. On a 2-core machine that halves the worker, while those processes use a
    small part of the other core: there every row served faster with both cores, no
    speculation 1.23x / 1.60x / 1.49x and carryover 1.27x / 1.45x / 1.48x at concurrency
    1 / 4 / 16 (docs/results.md, CPU settings).

    vLLM's n-gram proposer calls `numba.set_num_threads` around every proposal. With
    numba's default OpenMP layer that sets the OpenMP thread count torch uses on the
    worker's main thread, so after the first proposal the target runs on one thread.
    Numba's own "workqueue" pool leaves torch's alone: n-gram served 35.9 instead of 31.6
    tok/s at concurrency 1 and 234 instead of 158 at 16 (docs/results.md, CPU settings).
    No other row uses numba's parallel pool."""
    import torch

    extra = extra or {}
    if torch.cuda.is_available():
        return dict(extra)
    env: dict[str, str] = {}
    if not any(v in os.environ or v in extra for v in CPU_BINDING_VARS):
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    if NUMBA_LAYER_VAR not in os.environ:
        env[NUMBA_LAYER_VAR] = "workqueue"
    return env | extra


def resolve_target(target: str | None) -> str:
    """A target folder (absolute), a hub id as given, or the SmolLM2 testbed (None)."""
    if not target:
        from vllm_carryover.tools.testbed import smollm2_path

        return str(smollm2_path())
    return str(Path(target).resolve()) if Path(target).exists() else target


def serve_max_model_len(target: str) -> int:
    """`SERVE_MAX_MODEL_LEN`, or the target's own limit where that is shorter
    (vLLM refuses a `max_model_len` above `max_position_embeddings`)."""
    config = Path(target) / "config.json"
    if config.is_file():
        limit = json.loads(config.read_text()).get("max_position_embeddings")
    else:  # a hub id: transformers resolves it as vLLM does
        from transformers import AutoConfig

        limit = getattr(AutoConfig.from_pretrained(target), "max_position_embeddings", None)
    return min(SERVE_MAX_MODEL_LEN, limit or SERVE_MAX_MODEL_LEN)


def has_tokenizer(target: str) -> bool:
    """False for a local folder without tokenizer files (the tests' tiny target), which
    vLLM can only load with `skip_tokenizer_init`; with a tokenizer, EOS ends answers."""
    path = Path(target)
    return not path.is_dir() or any((path / f).is_file() for f in (
        "tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def model_runner(vllm_config: Any) -> str:
    """Which of vLLM's model runners an engine of this config runs on: "V1" or "V2"."""
    return "V2" if vllm_config.use_v2_model_runner else "V1"


def model_runner_of(target: str, speculative_config: dict[str, Any] | None, dtype: str,
                    max_model_len: int) -> str:
    """The runner a `vllm serve` of these settings picks, from the same engine config
    (built here, in this process's environment, which the server inherits)."""
    from vllm.engine.arg_utils import EngineArgs

    return model_runner(EngineArgs(model=target, speculative_config=speculative_config,
                                   dtype=dtype, max_model_len=max_model_len,
                                   enforce_eager=True).create_engine_config())


def command_line() -> str:
    """How this process was started, as a user would type it (for result files)."""
    argv = sys.argv
    if Path(argv[0]).name == "__main__.py":
        return shlex.join(["python", "-m", Path(argv[0]).parent.name, *argv[1:]])
    return shlex.join(["python", *argv])
