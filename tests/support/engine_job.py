"""Run one offline vLLM generation in a fresh process and reply with its results.

Tests start engines through this script (`engine_runner.run_engine`, over the
package's `EngineProcess`) so that every engine gets a clean process, as vLLM
expects. Its engine core and worker run inside that process (no multiprocessing,
the "uni" executor): an engine starts in half the time (18.6 s against 39.6 on a
2-core CPU, one pinned thread) with the same scheduler, model runner and proposer.
Served engines keep vLLM's processes (test_server, test_ray_executor, the
benchmarks' tests).
Input keys: model, prompts (list of token-id lists), max_tokens, engine (extra
LLM kwargs, e.g. speculative_config), temperature, seed; optional seeds (one per
prompt, replacing seed: repeated prompts then sample independently yet reproducibly).
Output keys: token_ids, logprobs (top-2 per step, greedy runs), spec (vLLM's
spec-decode counters), carryover (our counters), seconds.
"""

from __future__ import annotations

import os
import time

from vllm_carryover.tools.engine_process import child_start
from vllm_carryover.tools.run_settings import KV_CACHE_BYTES


def top2(step: dict) -> list[float]:
    """The two highest logprobs of one decoding step."""
    return sorted((lp.logprob for lp in step.values()), reverse=True)[:2]


def main() -> None:
    job, reply = child_start()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when the engine starts
    from vllm import LLM, SamplingParams

    from vllm_carryover.metrics import read_counters, spec_decode_counters

    engine = dict(dtype="float32", enforce_eager=True, max_model_len=1024,
                  kv_cache_memory_bytes=KV_CACHE_BYTES, disable_log_stats=False,
                  skip_tokenizer_init=True, distributed_executor_backend="uni")
    engine.update(job.get("engine", {}))
    llm = LLM(model=job["model"], **engine)

    def sampling_params(seed: int | None) -> SamplingParams:
        return SamplingParams(temperature=job.get("temperature", 0.0), seed=seed,
                              max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False,
                              logprobs=2 if job.get("temperature", 0.0) == 0 else None)

    params = ([sampling_params(s) for s in job["seeds"]] if "seeds" in job
              else sampling_params(job.get("seed")))
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    result = {
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "logprobs": [[top2(step) for step in (o.outputs[0].logprobs or [])]
                     for o in outputs],
        "spec": spec_decode_counters(llm),
        "carryover": read_counters(),
        "seconds": seconds,
    }
    reply(result)


if __name__ == "__main__":
    main()
