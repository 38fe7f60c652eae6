"""What verifying K+1 tokens costs on this machine: a linear layer against its row count.

Speculative decoding pays when running the target over 1 + K rows per request
costs little more than over one row (true on GPUs, where a decode step is bound by
reading the weights). On a CPU the matmul may be bound by arithmetic instead; then
every verified row costs about as much as a decoded one, and speculation can only
lose unless tau exceeds that cost ratio. This prints ms per call and the cost
relative to one row for SmolLM2-sized layers (576 -> 1536 and the 49152-word head).

    python -m benchmarks.matmul_rows            # one thread, like vLLM's CPU worker
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {"mlp 576->1536": (576, 1536), "lm_head 576->49152": (576, 49152)}
ROWS = (1, 2, 4, 8, 16, 32)


def ms_per_call(rows: int, n_in: int, n_out: int, dtype: torch.dtype, repeats: int) -> float:
    x = torch.randn(rows, n_in, dtype=dtype)
    w = torch.randn(n_out, n_in, dtype=dtype)
    for _ in range(3):
        torch.nn.functional.linear(x, w)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.nn.functional.linear(x, w)
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.matmul_rows", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s), ms per call "
          "(x cost of 1 row)\n")
    print("| layer | dtype | " + " | ".join(f"{r} rows" for r in ROWS) + " |")
    print("|---|---|" + "---|" * len(ROWS))
    for name, (n_in, n_out) in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float32):
            times = [ms_per_call(r, n_in, n_out, dtype, a.repeats) for r in ROWS]
            cells = [f"{t:.2f} ({t / times[0]:.1f}x)" for t in times]
            print(f"| {name} | {str(dtype).removeprefix('torch.')} | " + " | ".join(cells)
                  + " |")


if __name__ == "__main__":
    main()
