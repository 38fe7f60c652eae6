"""Integration: how vLLM starts a carryover engine (patches 1-4).

1. `EngineArgs.create_speculative_config`: accept `method: "carryover"`,
   validate it against the target, and hand vLLM a DFlash config; vLLM's own
   refusal of that config (a pydantic ValidationError) becomes a one-line
   `CarryoverConfigError`, and so does a vLLM that would reserve fewer KV slots
   past the verified tokens than the slot and the next block need; a drafter
   whose length limit is below the serving `max_model_len` is warned about.
2. `DFlashProposer.__new__`: build a `CarryoverProposer` when the drafter's
   config asks for carryover (isinstance checks on DFlashProposer still hold).
3. `ModelRegistry`: register the `CarryoverDraftModel` architecture.
4. Model Runner V2 does not know carryover: `VllmConfig` counts it among V2's
   unsupported features, so vLLM picks V1 for carryover configs only.
"""

from __future__ import annotations

import os
from typing import Any


def _patch_engine_args() -> None:
    from pydantic import ValidationError
    from vllm.engine.arg_utils import EngineArgs

    from vllm_carryover import config as sc
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
        except ValidationError as e:
            raise sc.vllm_refusal(e) from e
        finally:
            self.speculative_config = user_spec  # re-entrant: a second call sees carryover
        sc.attach(config, settings)
        check_kv_lookahead(config)
        warning = sc.short_drafter_warning(config.draft_model_config.max_model_len,
                                           target_model_config.max_model_len,
                                           config.num_speculative_tokens)
        if warning:
            sc.logger.warning("%s", warning)
        return config

    create_speculative_config._carryover = True  # type: ignore[attr-defined]
    EngineArgs.create_speculative_config = create_speculative_config


def check_kv_lookahead(spec: Any) -> None:
    """Refuse to start unless vLLM reserves the KV slots carryover writes into.

    Runs vLLM's own `VllmConfig.num_lookahead_tokens` rule on the translated
    config: if a vLLM release reserved fewer slots past the verified tokens, the
    shifted query block would be clamped into another block instead of failing."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig

    from vllm_carryover.errors import CarryoverConfigError
    from vllm_carryover.slot import required_lookahead

    k = spec.num_speculative_tokens
    have = VllmConfig.num_lookahead_tokens.fget(SimpleNamespace(  # type: ignore[attr-defined]
        speculative_config=spec, num_speculative_tokens=k, diffusion_config=None))
    if have < required_lookahead(k):
        raise CarryoverConfigError(
            f"this vLLM reserves {have} KV slots past a request's verified tokens "
            f"(VllmConfig.num_lookahead_tokens) but carryover stores its slot and the next "
            f"draft block there and needs {required_lookahead(k)} for "
            f"num_speculative_tokens={k}; use vLLM 0.32.x, which reserves K + 1 for DFlash")


def _use_v1_model_runner() -> None:
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").lower() in ("1", "true"):
        raise ValueError(
            "speculative method 'carryover' runs on vLLM's V1 model runner; "
            "unset VLLM_USE_V2_MODEL_RUNNER")


def _keep_carryover_on_the_v1_runner() -> None:
    """vLLM picks Model Runner V2 unless a config needs something V2 lacks
    (`VllmConfig._get_v2_model_runner_unsupported_features`): carryover is one of those
    things, for carryover configs only, so an in-tree dflash engine beside it keeps V2."""
    from vllm.config import VllmConfig

    from vllm_carryover.config import wants_carryover

    original = VllmConfig._get_v2_model_runner_unsupported_features
    if getattr(original, "_carryover", False):
        return

    def _get_v2_model_runner_unsupported_features(self: Any) -> list[str]:
        unsupported = original(self)
        if wants_carryover(self):
            unsupported.append("speculative method 'carryover'")
        return unsupported

    _get_v2_model_runner_unsupported_features._carryover = True  # type: ignore[attr-defined]
    VllmConfig._get_v2_model_runner_unsupported_features = (  # type: ignore[method-assign]
        _get_v2_model_runner_unsupported_features)


def _patch_dflash_proposer() -> None:
    from vllm.v1.spec_decode.dflash import DFlashProposer

    if getattr(DFlashProposer.__new__, "_carryover", False):
        return

    def __new__(cls: type, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm_carryover.config import wants_carryover
        from vllm_carryover.patches.length_limit import _patch_runner_per_request_drafts
        from vllm_carryover.proposer import CarryoverProposer

        if cls is DFlashProposer and wants_carryover(vllm_config):
            cls = CarryoverProposer
            _patch_runner_per_request_drafts()
        return object.__new__(cls)

    __new__._carryover = True  # type: ignore[attr-defined]
    DFlashProposer.__new__ = __new__  # type: ignore[method-assign]


def _register_model() -> None:
    from vllm import ModelRegistry

    from vllm_carryover.drafter.vllm_model import ARCHITECTURE

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE,
                                     "vllm_carryover.drafter.vllm_model:CarryoverDraftModel")
