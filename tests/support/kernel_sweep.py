"""Seeded sweep: each kernel behind the dispatcher against its PyTorch reference.

Run by `test_kernels_match_reference.py` in a fresh process with
`TRITON_INTERPRET=1` and `VLLM_CARRYOVER_KERNELS=triton`, because Triton decides
to interpret a kernel when its module is imported: a pytest process that
imported a kernel module earlier would keep compiling for a GPU it lacks.

    python tests/support/kernel_sweep.py projection|attention [--cases N] [--seed S] [--dtypes ...]

Prints one line per case and exits 1 if any case differs from the reference.
On GPU (no TRITON_INTERPRET) the same sweep runs compiled kernels, and
`--dtypes float32,float16,bfloat16` adds bf16, which the interpreter (numpy) lacks.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from functools import partial

import torch
from vllm_carryover.kernels.testing import (
    TOLERANCE,
    random_paged_batch,
    random_projection_weights,
    random_verify_rows,
)

from vllm_carryover import kernels


def _close(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> str | None:
    """None if equal within tolerance, else what differs."""
    try:
        torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype],
                                   rtol=TOLERANCE[dtype])
    except AssertionError as e:
        return f"{name}: {e}"
    return None


def projection_case(rng: random.Random, i: int, device: str,
                    dtype: torch.dtype) -> tuple[str, list[str]]:
    """One random shape of the projection; every other case also into a paged cache."""
    from vllm_carryover.kernels.carryover_projection_triton import (
        project_context_kv_into_cache_triton,
        project_context_kv_triton,
    )

    batch = (1, 64)[i] if i < 2 else rng.randint(1, 64)
    rows = rng.randint(4, 16)  # drafter block size: K + 1 verify rows per request
    head_dim = 96 if i % 10 == 9 else (64, 128)[(i // 2) % 2]  # 96: padded tiles
    rotary = rng.choice((head_dim, head_dim // 2))
    hidden = rng.choice((32, 32, 96))  # small: the interpreter is slow; 96 crosses tiles
    layers, kv_heads = rng.randint(1, 2), rng.randint(1, 2)
    empty, plain = i % 5 == 3, i % 7 == 4  # all slots empty / no rejected mask at all
    neox, bias = rng.random() < 0.7, rng.random() < 0.5
    gen = torch.Generator(device=device).manual_seed(1000 + i)
    w = random_projection_weights(gen, hidden=hidden, num_layers=layers,
                                  num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                                  rotary_dim=rotary, is_neox=neox, bias=bias,
                                  cos_sin_dtype=rng.choice((torch.float32, dtype)))
    r = random_verify_rows(gen, batch=batch, rows_per_request=rows, hidden=hidden, dtype=dtype,
                           empty_slots=empty)
    rejected = None if plain else r.rejected_rows
    name = (f"projection {str(dtype)[6:]} batch={batch} rows/req={rows} rejected="
            f"{int(r.rejected_rows.sum()) if rejected is not None else None} hd={head_dim} "
            f"rot={rotary} neox={neox} bias={bias} layers={layers} kv_heads={kv_heads} "
            f"hidden={hidden}")
    # The dispatcher's default path (fused GEMM); cases 4-7, 12-15, ...: gemm="cublas".
    cublas = (i // 4) % 2 == 1
    name += " gemm=cublas" if cublas else " gemm=fused"
    project = (partial(project_context_kv_triton, gemm="cublas") if cublas
               else kernels.project_context_kv)
    project_into_cache = (partial(project_context_kv_into_cache_triton, gemm="cublas") if cublas
                          else kernels.project_context_kv_into_cache)
    k_ref, v_ref = kernels.project_context_kv_reference(r.states, r.positions, rejected, w)
    k, v = project(r.states, r.positions, rejected, w)
    errors = [_close("K", k, k_ref, dtype), _close("V", v, v_ref, dtype)]
    if i % 4 not in (1, 2):
        return name, [e for e in errors if e]

    # Into a paged cache of page size 4..16; every 5th row is padding (slot -1).
    page = rng.randint(4, 16)
    n = r.states.shape[0]
    slots = torch.randperm(n + 2 * page, generator=gen, device=device)[:n]
    slots[::5] = -1
    shape = (layers, -(-(n + 2 * page) // page), page, kv_heads, head_dim)
    caches = [torch.randn(shape, generator=gen, device=device).to(dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    kernels.project_context_kv_into_cache_reference(r.states, r.positions, rejected, w, slots,
                                                    *ref_caches)
    project_into_cache(r.states, r.positions, rejected, w, slots, *caches)
    errors += [_close("K cache", caches[0], ref_caches[0], dtype),
               _close("V cache", caches[1], ref_caches[1], dtype)]
    return f"{name} page={page}", [e for e in errors if e]


def attention_case(rng: random.Random, i: int, device: str,
                   dtype: torch.dtype) -> tuple[str, list[str]]:
    """One random batch of draft blocks over context + slot in paged K/V."""
    causal = (i // 2) % 2 == 1
    # Batches 1 and 64 first, then mostly small ones: the interpreter pays per program.
    batch = (1, 64)[i // 4] if i < 8 else rng.choice((rng.randint(1, 16), rng.randint(1, 64)))
    block = rng.randint(4, 16)  # drafter block size K + 1 = query tokens per request
    head_dim = 96 if i % 10 == 9 else rng.choice((64, 128))  # 96: padded tiles
    group = {0: 1, 1: 8, 2: 8, 3: 1}.get(i, rng.randint(1, 8))  # GQA ratio
    kv_heads = rng.randint(1, 2)
    page = rng.randint(4, 16)
    empty = i % 6 == 5  # every slot empty: plain DFlash drafting
    contexts = [rng.choice((0, 1, rng.randint(1, 40), rng.randint(50, 90))) for _ in range(batch)]
    slots = [0 if empty or rng.random() < 0.25 else rng.randint(1, block - 1)
             for _ in range(batch)]
    gen = torch.Generator(device=device).manual_seed(2000 + i)
    pb = random_paged_batch(gen, context_lens=contexts, slot_lens=slots,
                            query_lens=[block] * batch, num_heads=kv_heads * group,
                            num_kv_heads=kv_heads, head_dim=head_dim, page_size=page, dtype=dtype)
    name = (f"attention {str(dtype)[6:]} causal={causal} batch={batch} block={block} "
            f"slot_total={sum(slots)} hd={head_dim} gqa={group} kv_heads={kv_heads} "
            f"page={page} max_context={max(contexts)}")
    want = kernels.carryover_attention_reference(*pb.args(), causal=causal)
    got = kernels.carryover_attention(*pb.args(), causal=causal, max_query_len=pb.max_query_len)
    return name, [e for e in [_close("out", got, want, dtype)] if e]


Case = Callable[[random.Random, int, str, torch.dtype], tuple[str, list[str]]]
CASES: dict[str, tuple[Case, int]] = {
    "projection": (projection_case, 20),
    "attention": (attention_case, 20),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(CASES))
    parser.add_argument("--cases", type=int, help="number of cases (default per kind)")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--dtypes", default="float32,float16",
                        help="comma-separated dtypes, cycled over the cases")
    args = parser.parse_args()
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    if kernels.backend() != "triton":
        print(f"dispatcher chose {kernels.backend()!r}; set VLLM_CARRYOVER_KERNELS=triton")
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case, default_cases = CASES[args.kind]
    rng = random.Random(args.seed)
    failed = 0
    for i in range(args.cases or default_cases):
        start = time.perf_counter()
        name, errors = case(rng, i, device, dtypes[i % len(dtypes)])
        status = "ok" if not errors else "FAIL"
        print(f"{status:4} {time.perf_counter() - start:5.2f}s {name}", flush=True)
        for e in errors:
            print("     " + e.replace("\n", "\n     "))
        failed += bool(errors)
    print(f"{failed} of {args.cases or default_cases} {args.kind} cases differ from the reference")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
