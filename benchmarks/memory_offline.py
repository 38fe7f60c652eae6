"""Resident memory of one in-process vLLM engine over repeated batches.

Tells a per-request leak from growth caused by new batch shapes: `--prompts
same` repeats one batch of 24 random prompts (identical shapes every time),
`--prompts fresh` draws new prompts of new lengths each iteration. Run it with
`--carryover on` and `off` to see whether carryover adds anything. Example:

    python -m benchmarks.memory_offline --carryover on --prompts fresh --iterations 8
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DRAFTER = REPO / "train" / "checkpoints" / "smollm2-135m-instruct" / "dflash-baseline"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--carryover", choices=["on", "off"], default="on")
    parser.add_argument("--prompts", choices=["same", "fresh"], default="fresh")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--drafter", type=Path, default=DRAFTER)
    args = parser.parse_args()

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one process: its RSS is the engine
    import psutil
    from vllm import LLM, SamplingParams

    from vllm_carryover.testbed import smollm2_path

    spec = {"method": "carryover", "model": str(args.drafter), "num_speculative_tokens": 7,
            "carryover": args.carryover == "on"}
    llm = LLM(model=str(smollm2_path()), dtype="float32", enforce_eager=True,
              max_model_len=512, kv_cache_memory_bytes=128 << 20, speculative_config=spec,
              skip_tokenizer_init=True, distributed_executor_backend="uni")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, detokenize=False)
    rng = random.Random(0)

    def batch() -> list[dict[str, list[int]]]:
        return [{"prompt_token_ids": [rng.randrange(100, 40000)
                                      for _ in range(rng.randrange(20, 300))]}
                for _ in range(24)]

    prompts = batch()
    me = psutil.Process()
    for it in range(args.iterations):
        if args.prompts == "fresh":
            prompts = batch()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        print(f"carryover={args.carryover} prompts={args.prompts} iteration={it} "
              f"seconds={time.perf_counter() - start:.1f} "
              f"rss_mb={me.memory_info().rss / 2**20:.1f}", flush=True)


if __name__ == "__main__":
    main()
