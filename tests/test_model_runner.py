"""Carryover keeps to vLLM's V1 model runner without moving anything else there.

vLLM picks Model Runner V2 unless a config needs a feature V2 lacks; the plugin
adds carryover to that list for carryover configs only (no process-wide
`VLLM_USE_V2_MODEL_RUNNER=0`), so an in-tree dflash engine built in the same
process keeps vLLM's own choice, and the benchmarks report each row's runner.
"""

from __future__ import annotations

import os

import pytest
from test_bad_config import carryover, engine_config

from vllm_carryover.tools.run_settings import model_runner

CARRYOVER_UNSUPPORTED = "speculative method 'carryover'"


def test_only_carryover_configs_are_unsupported_on_model_runner_v2(
        smollm2, random_drafter, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    config = engine_config(smollm2, carryover(random_drafter))
    assert CARRYOVER_UNSUPPORTED in config._get_v2_model_runner_unsupported_features()
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ  # nothing forced process-wide
    assert model_runner(config) == "V1"
    dflash = engine_config(smollm2, {"method": "dflash", "model": str(random_drafter),
                                     "num_speculative_tokens": 4})
    assert CARRYOVER_UNSUPPORTED not in dflash._get_v2_model_runner_unsupported_features()
