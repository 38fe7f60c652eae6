"""The engine process of `python -m benchmarks draft-step`: one vLLM engine, one
reply per command.

`draft_step` starts one of these per row (`EngineProcess`, this module as its
entry) and keeps it alive the whole run. The protocol: the job names the target,
speculative config and dtype; the process replies `{"event": "ready"}` once the
engine is loaded; then each command `{"prompts": [token ids, ...], "max_tokens":
N}` is generated greedily (`ignore_eos`, all at once) and answered with
`{"event": "done", ...}` holding the step records the worker wrote meanwhile
(`vllm_carryover.control.step_timer`).
"""

from __future__ import annotations

import os
import time

from vllm_carryover.control.step_timer import ENV, read_steps
from vllm_carryover.tools.engine_process import child_commands, child_start
from vllm_carryover.tools.run_settings import KV_CACHE_BYTES, serve_max_model_len


def main() -> None:
    """Serve the commands of one row (see the module docstring)."""
    job, reply = child_start()
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=job["target"], speculative_config=job["speculative_config"],
              dtype=job["dtype"], enforce_eager=True,
              max_model_len=serve_max_model_len(job["target"]),
              kv_cache_memory_bytes=KV_CACHE_BYTES, seed=0)
    reply({"event": "ready", "startup_seconds": round(time.perf_counter() - start, 2)})
    steps_dir, offsets = os.environ[ENV], {}
    for cmd in child_commands():
        params = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"],
                                ignore_eos=True, detokenize=False)
        prompts = [{"prompt_token_ids": p} for p in cmd["prompts"]]
        read_steps(steps_dir, offsets)  # skip anything recorded before this command
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        reply({"event": "done", "seconds": round(time.perf_counter() - start, 3),
               "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
               "steps": read_steps(steps_dir, offsets)})


if __name__ == "__main__":
    main()
