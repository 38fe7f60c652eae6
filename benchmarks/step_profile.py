"""Where one decode step's time goes, with carryover: target, drafter, sampling, the rest.

One offline engine in this process (no engine-core process, no worker process,
so the parts can be timed from here), one batch of held-out prompts, greedy,
`ignore_eos`. Wall time is summed per part over the full-batch decode steps
(the draining tail left out) and printed per step; the steps until every request
has its first token (prefill, all requests arriving at once as at the start of a
concurrency-16 run) are summed apart and printed as totals:

  engine step       `LLMEngine.step`: everything one step costs
  scheduler         `Scheduler.schedule` and `update_from_output`
  target forward    the target model over the verified rows (1 + K per request)
  sampling          the rejection sampler (or plain sampler)
  drafter propose   the proposer's whole `propose` call, of which
    lookups         with --lookups: the suffix lookup learning and proposing
    context proj.   projecting the verified (and rejected) target states to K/V
    drafter fwd     the drafter layers over the query block
    LM head         the drafter's logits over its (draft) vocabulary
  other             engine step minus scheduler, target, sampling and propose:
                    input preparation, output processing, Python glue

On a CPU there is nothing asynchronous to wait for, so these are the real costs.
Multiprocess IPC is absent here by construction (served engines pay it on top).
Torch runs on every core this process may use (`--threads`), as a served worker
does with `VLLM_CPU_NUM_OF_RESERVED_CPU=0` (the benchmarks' default).

    python -m benchmarks.step_profile --batch 1
    python -m benchmarks.step_profile --batch 16 --drafter DIR --dtype bfloat16
    python -m benchmarks.step_profile --batch 1 --lookups    # the shipped lookup too
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_carryover.tools.run_settings import KV_CACHE_BYTES

PARTS = ("engine step", "scheduler", "target forward", "sampling", "drafter propose",
         "lookups", "context proj.", "drafter fwd", "LM head")
TOP_LEVEL = ("scheduler", "target forward", "sampling", "drafter propose")


class PartTimer:
    """Sums wall time per phase ("prefill", "decode") and named part, counting
    engine steps per phase; nothing is summed while `phase` is None."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.steps: dict[str, int] = defaultdict(int)
        self.phase: str | None = None

    def wrap(self, owner: Any, attr: str, part: str) -> None:
        inner: Callable[..., Any] = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.phase is not None:
                    self.seconds[self.phase, part] += time.perf_counter() - start

        setattr(owner, attr, timed)

    def ms(self, phase: str, per_step: bool) -> dict[str, float]:
        """Milliseconds per part of `phase`, per step or in total, with "other"."""
        steps = max(self.steps[phase], 1) if per_step else 1
        out = {p: round(self.seconds[phase, p] / steps * 1e3, 2) for p in PARTS}
        out["other"] = round(out["engine step"] - sum(out[p] for p in TOP_LEVEL), 2)
        return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1, help="concurrent requests")
    p.add_argument("--drafter", help="carryover drafter folder (default: the shipped one); "
                   "'none' profiles the target without speculation")
    p.add_argument("-k", type=int, default=7,
                   help="drafted tokens per step; 0: none, through vLLM's batch-size schedule "
                   "(the drafter still keeps its context, as K by goodput does at K=0)")
    p.add_argument("--lookups", action="store_true",
                   help="the shipped lookup beside the drafter (the suffix lookup, else "
                   "the drafter's first token), at a fixed K")
    p.add_argument("--dtype", default="auto", help="auto: the machine's fastest")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="torch threads for the engine (default: every core this process "
                   "may use, as a served worker with VLLM_CPU_NUM_OF_RESERVED_CPU=0 has)")
    p.add_argument("--out", help="also write the result as JSON here")
    p.add_argument("--torch-profile", type=int, default=0, metavar="N",
                   help="also print the N operators with the most self CPU time inside "
                   "the drafter's propose calls (torch.profiler, measured steps only)")
    a = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    # in-process vLLM cuts torch to one thread unless OMP_NUM_THREADS was set outside it
    os.environ["OMP_NUM_THREADS"] = str(a.threads)

    from vllm import LLM, SamplingParams
    from vllm_carryover.benchmarks.eval_prompts import chat_token_ids, heldout_prompts

    from vllm_carryover.dtype import resolve_dtype
    from vllm_carryover.tools.run_settings import (
        MAIN_DRAFTER,
        SHIPPED_DRAFTERS,
        SHIPPED_LOOKUPS,
        resolve_target,
    )

    target = resolve_target(None)
    drafter = a.drafter or str(SHIPPED_DRAFTERS / MAIN_DRAFTER)
    spec = None if drafter == "none" else {
        "method": "carryover", "model": drafter, "num_speculative_tokens": a.k or 7,
        "carryover": True}
    if spec is not None and a.k == 0:  # what K by goodput does when drafting does not pay
        spec["num_speculative_tokens_per_batch_size"] = [[1, 1 << 20, 0]]
    if spec is not None and a.lookups:
        spec |= SHIPPED_LOOKUPS
    per_category = chat_token_ids(target, heldout_prompts(max(1, a.batch // 5 + 1)))
    mixed = [q for group in zip(*per_category.values(), strict=True) for q in group]
    prompts = [{"prompt_token_ids": mixed[i % len(mixed)]} for i in range(a.batch)]
    llm = LLM(model=target, dtype=resolve_dtype(a.dtype), enforce_eager=True,
              max_model_len=4096, kv_cache_memory_bytes=KV_CACHE_BYTES, seed=0,
              speculative_config=spec, distributed_executor_backend="uni")
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    timer = PartTimer()
    timer.wrap(core.scheduler, "schedule", "scheduler")
    timer.wrap(core.scheduler, "update_from_output", "scheduler")
    timer.wrap(runner.model, "forward", "target forward")
    timer.wrap(runner, "_sample", "sampling")
    if spec is not None:
        drafter_model = runner.drafter.model
        timer.wrap(runner.drafter, "propose", "drafter propose")
        if runner.drafter.lookups is not None:
            timer.wrap(runner.drafter.lookups, "_texts", "lookups")
            timer.wrap(runner.drafter.lookups.suffix, "learn", "lookups")
            timer.wrap(runner.drafter.lookups.suffix, "propose", "lookups")
        timer.wrap(drafter_model, "precompute_and_store_context_kv", "context proj.")
        timer.wrap(drafter_model, "forward", "drafter fwd")
        # the draft-vocabulary path calls the processor itself (proposer._greedy_sample)
        timer.wrap(drafter_model.logits_processor, "forward", "LM head")
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True,
                            detokenize=False)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)

    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    op_self_us: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    if a.torch_profile and spec is not None:
        from torch.profiler import ProfilerActivity, profile

        propose = runner.drafter.propose

        def profiled(*args: Any, **kwargs: Any) -> Any:
            if timer.phase != "decode":
                return propose(*args, **kwargs)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = propose(*args, **kwargs)
            for event in prof.key_averages():
                op_self_us[event.key][0] += event.self_cpu_time_total
                op_self_us[event.key][1] += event.count
            return out

        runner.drafter.propose = profiled
    answered: set[str] = set()  # requests with a first token: their prefill is done
    while engine.has_unfinished_requests():
        full = len(core.scheduler.running) == a.batch and not core.scheduler.waiting
        timer.phase = ("prefill" if len(answered) < a.batch
                       else "decode" if full else None)
        start = time.perf_counter()
        outs = engine.step()
        if timer.phase is not None:
            timer.seconds[timer.phase, "engine step"] += time.perf_counter() - start
            timer.steps[timer.phase] += 1
        answered.update(o.request_id for o in outs if o.outputs and o.outputs[0].token_ids)
    decode_steps = max(timer.steps["decode"], 1)
    if op_self_us:
        top = sorted(op_self_us.items(), key=lambda kv: -kv[1][0])[: a.torch_profile]
        print("drafter propose, self CPU ms per step by operator (profiled, so slower):")
        for name, (us, calls) in top:
            print(f"  {us / 1e3 / decode_steps:8.3f}  {calls / decode_steps:5.1f} calls  {name}")
    result = {"batch": a.batch, "k": a.k if spec else 0, "lookups": a.lookups,
              "threads": a.threads,
              "dtype": resolve_dtype(a.dtype),
              "drafter": drafter, "steps": timer.steps["decode"],
              "ms_per_step": timer.ms("decode", per_step=True),
              "prefill_steps": timer.steps["prefill"],
              "prefill_ms": timer.ms("prefill", per_step=False)}
    width = max(map(len, result["ms_per_step"]))
    print(f"batch {a.batch}, K={result['k']}, {result['dtype']}, {a.threads} thread(s): "
          f"ms per full-batch decode step ({result['steps']} steps), and in all over the "
          f"{result['prefill_steps']} prefill step(s):")
    for part, ms in result["ms_per_step"].items():
        print(f"  {part:<{width}} {ms:8.2f}  {result['prefill_ms'][part]:9.2f}")
    print(json.dumps(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
