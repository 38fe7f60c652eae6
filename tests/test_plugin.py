"""The plugin's contract with vLLM: version check, idempotent patches, pass-through."""

from __future__ import annotations

import pytest
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.spec_decode.dflash import DFlashProposer

import vllm_carryover
from vllm_carryover import vllm_patches


def test_other_vllm_versions_are_refused_with_the_supported_one_named():
    with pytest.raises(RuntimeError, match=r"written for vLLM 0\.32\.x.*found vLLM 0\.33\.1"):
        vllm_patches.check_vllm_version("0.33.1")
    vllm_patches.check_vllm_version("0.32.0")


def test_register_is_idempotent():
    vllm_carryover.register()
    wrapped = EngineArgs.create_speculative_config
    new = DFlashProposer.__new__
    vllm_carryover.register()
    assert EngineArgs.create_speculative_config is wrapped
    assert DFlashProposer.__new__ is new


def test_other_speculative_methods_pass_through_unchanged(smollm2):
    vllm_carryover.register()
    config = EngineArgs(model=str(smollm2), dtype="float32", enforce_eager=True,
                        max_model_len=512, kv_cache_memory_bytes=1 << 28,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                            "prompt_lookup_max": 3}).create_engine_config()
    assert config.speculative_config.method == "ngram"
