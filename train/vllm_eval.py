"""Acceptance length of a drafter folder in vLLM on held-out prompts.

Each method runs in a fresh process (`python -m train.vllm_eval JOB.json OUT.json`)
as vLLM expects. tau = 1 + accepted / drafts from vLLM's spec-decode counters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from train.data import load_samples
from train.paths import data_dir


def heldout_prompts(data: str, num: int, category: str = "chat") -> list[list[int]]:
    rows = load_samples(data_dir(data), "heldout")
    rows = [r for r in rows if category == "all" or r["category"] == category]
    return [r["prompt_ids"] for r in rows[:num]]


def evaluate(target: str, drafter: str, data: str, methods: list[str], num_prompts: int,
             max_tokens: int, k: int, category: str = "chat") -> dict[str, Any]:
    """{method: {tau, drafts, accepted, output_tokens, seconds, tokens_per_s}}."""
    prompts = heldout_prompts(data, num_prompts, category)
    results: dict[str, Any] = {"prompts": len(prompts)}
    for method in methods:
        spec = None if method == "none" else {
            "method": method, "model": str(Path(drafter).resolve()),
            "num_speculative_tokens": k}
        job = {"target": target, "prompts": prompts, "max_tokens": max_tokens, "spec": spec}
        with tempfile.TemporaryDirectory() as tmp:
            inp, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
            inp.write_text(json.dumps(job))
            proc = subprocess.run([sys.executable, "-m", "train.vllm_eval", str(inp),
                                   str(out)], check=False, capture_output=True, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "2"})
            if proc.returncode != 0:
                raise RuntimeError(f"{method} failed:\n{proc.stderr[-4000:]}")
            results[method] = json.loads(out.read_text())
    return results


def _run_job(inp: Path, out: Path) -> None:
    from vllm import LLM, SamplingParams

    from vllm_carryover.metrics import acceptance_length, spec_decode_counters

    job = json.loads(inp.read_text())
    engine: dict[str, Any] = {"dtype": "bfloat16", "enforce_eager": True, "max_model_len": 1024,
                                  "kv_cache_memory_bytes": 1 << 30, "disable_log_stats": False}
    if job["spec"]:
        engine["speculative_config"] = job["spec"]
    llm = LLM(model=job["target"], **engine)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params,
                        use_tqdm=False)
    seconds = time.perf_counter() - start
    counters = spec_decode_counters(llm)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res: dict[str, Any] = {"output_tokens": n_out, "seconds": round(seconds, 2),
                           "tokens_per_s": round(n_out / seconds, 1), "counters": counters}
    tau = acceptance_length(counters)
    if tau is not None:
        res["tau"] = round(tau, 4)
    out.write_text(json.dumps(res))


if __name__ == "__main__":
    _run_job(Path(sys.argv[1]), Path(sys.argv[2]))
