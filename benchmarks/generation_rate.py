"""Output tokens/s of offline greedy generation, as `python -m train data` generates.

One engine, one batch of held-out prompts (`train.prompts`), one warm-up
request first; prints a JSON line. Run it once per setting to see what holds
data generation back on a machine, for example:

    python -m benchmarks.generation_rate --prompts 128 --max-tokens 64 --dtype float32
    VLLM_CPU_OMP_THREADS_BIND=0-1 python -m benchmarks.generation_rate --prompts 128 ...

(vLLM's CPU worker binds one core and leaves the others to its scheduler
unless `VLLM_CPU_OMP_THREADS_BIND` or `VLLM_CPU_NUM_OF_RESERVED_CPU` say otherwise.)
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.generation_rate",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=128, help="batch size (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=0, help="0: vLLM's default")
    p.add_argument("--dtype", default="auto", help="auto: the machine's fastest")
    p.add_argument("--categories", nargs="+", default=["chat", "math"])
    p.add_argument("--pool", type=int, default=100,
                   help="held-out prompts per category to draw the batch from (default: "
                   "%(default)s)")
    a = p.parse_args()

    from vllm import LLM, SamplingParams
    from vllm_carryover.train.prompts import build_prompts, prompt_token_ids

    from vllm_carryover.dtype import resolve_dtype
    from vllm_carryover.testbed import smollm2_path

    target = str(smollm2_path())
    prompts = build_prompts(0, a.pool, 0, tuple(a.categories))[: a.prompts]
    ids = [i for i in prompt_token_ids(target, prompts)
           if len(i) + a.max_tokens <= a.max_model_len]
    extra = {"max_num_seqs": a.max_num_seqs} if a.max_num_seqs else {}
    llm = LLM(model=target, dtype=resolve_dtype(a.dtype), enforce_eager=True,
              max_model_len=a.max_model_len, seed=0,
              kv_cache_memory_bytes=int(a.kv_cache_gib * (1 << 30)), **extra)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    llm.generate([{"prompt_token_ids": ids[0]}], params, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"dtype": resolve_dtype(a.dtype), "prompts": len(ids), "tokens": tokens,
                      "seconds": round(seconds, 1), "output_tok_s": round(tokens / seconds, 1),
                      "prompt_tokens": sum(map(len, ids)),
                      "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")}}))


if __name__ == "__main__":
    main()
