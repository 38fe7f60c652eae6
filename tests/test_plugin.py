"""The plugin's contract with vLLM: version check, idempotent patches, pass-through."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.cpu_kernels import register_cpu_kernels
from support.rejection_step import verify_step
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.spec_decode.dflash import DFlashProposer

import vllm_carryover
from vllm_carryover import patches
from vllm_carryover.patches import cpu_fixes


def test_other_vllm_versions_are_refused_with_the_supported_one_named():
    with pytest.raises(RuntimeError, match=r"written for vLLM 0\.32\.x.*found vLLM 0\.33\.1"):
        patches.check_vllm_version("0.33.1")
    patches.check_vllm_version("0.32.0")


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
                        speculative_config={"method": "ngram", "num_speculative_tokens": 3}
                        ).create_engine_config()
    assert config.speculative_config.method == "ngram"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cpu_rejection_sampling_gives_vllms_tokens(temperature):
    """Patch 9: steps that verify no draft (greedy or seeded random draws) and all-greedy
    steps without logits processing give the tokens of vLLM's own rejection sampler,
    with tied logits and uneven draft counts (K by goodput, the length limit)."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    register_cpu_kernels()
    sampler = RejectionSampler(Sampler())
    vllms = RejectionSampler.forward._carryover_original
    for seed, counts in enumerate(([0] * 8, [1], [4, 4, 4], [7, 0, 3, 7, 1], [7] * 8)):
        if temperature and max(counts):
            continue  # sampled steps with drafts are vLLM's own: nothing to compare
        ours = sampler(*_step_args(counts, temperature, seed))
        theirs = vllms(sampler, *_step_args(counts, temperature, seed))  # fresh generators
        assert ours.sampled_token_ids.dtype == theirs.sampled_token_ids.dtype
        assert torch.equal(ours.sampled_token_ids, theirs.sampled_token_ids), counts


def _step_args(counts: list[int], temperature: float, seed: int, **sampling: Any) -> tuple:
    return verify_step(counts, 256, temperature, seed, ties=True, **sampling)


def test_cpu_rejection_sampling_leaves_edited_logits_to_vllm():
    """Patch 9 hands vLLM's own sampler every greedy step whose logits something edits
    (a repetition penalty, a logit bias) or that asks for logprobs; an idle built-in
    logits processor edits nothing."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    register_cpu_kernels()
    seen: list[Any] = []
    fast = cpu_fixes.fast_rejection_forward(lambda self, *a: seen.append(a[3]) or "vllm's own")
    sampler = RejectionSampler(Sampler())
    bias = LogitBiasLogitsProcessor(None, torch.device("cpu"), False)
    idle = _step_args([3, 3], 0.0, 0, logitsprocs=LogitsProcessors([bias]))
    assert fast(sampler, *idle).sampled_token_ids.shape == (2, 4)
    bias.biases = {0: {5: 10.0}}
    biased = _step_args([3, 3], 0.0, 0, logitsprocs=LogitsProcessors([bias]))
    penalised = _step_args([3, 3], 0.0, 0, no_penalties=False)
    logprobs = _step_args([3, 3], 0.0, 0, max_num_logprobs=2)
    for step in (biased, penalised, logprobs):
        assert fast(sampler, *step) == "vllm's own"
    assert seen == [biased[3], penalised[3], logprobs[3]]


@pytest.mark.parametrize(("method", "last_k", "fetches"),
                         [("carryover", 0, 0), ("carryover", 3, 1), ("ngram", 0, 1)])
def test_engine_core_fetches_no_drafts_after_a_step_that_drafted_none(
        smollm2, random_drafter, method, last_k, fetches):
    """Patch 10: after a K = 0 step the drafts are all empty and the scheduler has
    already cleared what it scheduled, so a carryover engine core skips the round trip
    to the worker; steps that drafted, and other methods, still fetch."""
    from types import SimpleNamespace

    from vllm.v1.engine.core import EngineCore

    vllm_carryover.register()
    spec = ({"method": "carryover", "model": str(random_drafter), "num_speculative_tokens": 3}
            if method == "carryover" else
            {"method": "ngram", "num_speculative_tokens": 3})
    config = EngineArgs(model=str(smollm2), dtype="float32", enforce_eager=True,
                        max_model_len=512, kv_cache_memory_bytes=1 << 28,
                        speculative_config=spec).create_engine_config()
    fetched: list[int] = []
    core = object.__new__(EngineCore)
    core.vllm_config, core.batch_queue = config, None
    core.check_for_draft_tokens, core.async_scheduling = True, False
    core.model_executor = SimpleNamespace(take_draft_token_ids=lambda: fetched.append(1))
    core.scheduler = SimpleNamespace(carryover_last_k=last_k)
    EngineCore.post_step(core, model_executed=True)
    assert len(fetched) == fetches
