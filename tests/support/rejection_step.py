"""One speculative step's arguments for vLLM's `RejectionSampler.forward`, built as
vLLM's runner builds them: what tests/test_plugin.py checks patch 9
(`patches.cpu_fixes.fast_rejection_forward`) against. (The timing probe that once
used it, `benchmarks/rejection_sampler.py`, is in git history.)
"""

from __future__ import annotations

from typing import Any

import torch


def verify_step(counts: list[int], vocab: int, temperature: float, seed: int,
                dtype: torch.dtype = torch.bfloat16, ties: bool = False,
                **sampling: Any) -> tuple[Any, None, torch.Tensor, Any]:
    """`RejectionSampler.forward`'s arguments for one step as vLLM's runner builds
    them: request i verifies `counts[i]` drafts, so it owns counts[i] target rows and
    then its bonus row; about half the drafts are the target's argmax. `ties` draws
    the logits from four values (many tied maxima); `sampling` overrides fields of
    the SamplingMetadata (greedy at temperature 0, else seeded per request)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    gen = torch.Generator().manual_seed(seed)
    batch, rows = len(counts), sum(counts) + len(counts)
    logits = (torch.randint(0, 4, (rows, vocab), generator=gen).float() if ties
              else torch.randn(rows, vocab, generator=gen)).to(dtype)
    sampled = torch.tensor([k + 1 for k in counts], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    bonus = sampled - 1
    target = torch.tensor([r for i, k in enumerate(counts) for r in range(bonus[i] - k, bonus[i])],
                          dtype=torch.int32)
    drafts = torch.randint(0, vocab, (len(target),), generator=gen, dtype=torch.int32)
    drafts[::2] = logits[target.long()][::2].float().max(-1).indices.int()
    greedy = temperature == 0.0
    fields = dict(
        temperature=None if greedy else torch.full((batch,), temperature),
        all_greedy=greedy, all_random=not greedy, top_p=None, top_k=None,
        generators={i: torch.Generator().manual_seed(seed + i) for i in range(batch)},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
        spec_token_ids=[[] for _ in range(batch)])
    metadata = SpecDecodeMetadata(
        draft_token_ids=drafts, num_draft_tokens=list(counts),
        cu_num_draft_tokens=torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32),
        cu_num_sampled_tokens=sampled, target_logits_indices=target,
        bonus_logits_indices=bonus, logits_indices=torch.arange(rows, dtype=torch.int32))
    return metadata, None, logits, SamplingMetadata(**(fields | sampling))
