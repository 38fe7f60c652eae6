"""Soak: `vllm serve` with carryover under load, aborts and preemption stays correct.

64 streamed greedy completions at concurrency 32 against one server, with
random prompt and output lengths; 20% are aborted by the client mid-stream
(after a warm-up of 96 requests of the same mix). The
KV cache is small enough that the scheduler must preempt, and the proposer
checks slot ownership every round (`VLLM_CARRYOVER_CHECK_SLOTS=1`: a misplaced
slot would kill the engine). Afterwards: the server is still up, every completed
request equals the target alone (an offline no-speculation run), there were no
errors except the aborts, and resident memory is within a few percent of what it
was after warm-up.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import psutil
import pytest
from support.engine_runner import run_engine
from support.soak_workload import (
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    drive,
    make_requests,
)

from vllm_carryover.slot_table import ENV_CHECK
from vllm_carryover.tools.server_process import VllmServer

NUM_REQUESTS = 64
WARMUP_REQUESTS = 96
NUM_SPECULATIVE_TOKENS = 7
# vLLM's CPU engine itself grows by ~1 MB per request while it meets new prompt
# shapes, with carryover on and off alike, and stays flat when shapes repeat
# (the `benchmarks.memory_offline` probe, in git history; docs/reference.md,
# Reliability). The warm-up runs the soak's own mix; the bound leaves room for that
# engine growth over the soak.
MEMORY_DRIFT = 0.10


def server_rss(server: VllmServer) -> int:
    """Resident bytes of the API server and every engine process under it."""
    assert server.proc is not None
    root = psutil.Process(server.proc.pid)
    total = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def test_soak_with_aborts_and_preemption_keeps_outputs_and_memory(
        smollm2, trained_drafter, tmp_path):
    warmup = make_requests(smollm2, WARMUP_REQUESTS, seed=1)
    soak = make_requests(smollm2, NUM_REQUESTS, seed=2)
    spec = {"method": "carryover", "model": str(trained_drafter),
            "num_speculative_tokens": NUM_SPECULATIVE_TOKENS, "carryover": True}
    log = tmp_path / "serve.log"
    reference_job = {"model": str(smollm2), "prompts": [r.prompt for r in soak],
                     "max_tokens": MAX_TOKENS, "engine": {"max_model_len": MAX_MODEL_LEN}}
    server = VllmServer(smollm2, log, speculative_config=spec, dtype="float32",
                        max_model_len=MAX_MODEL_LEN, kv_cache_bytes=KV_CACHE_BYTES,
                        start_timeout=300, env={ENV_CHECK: "1"})
    with ThreadPoolExecutor(max_workers=1) as pool, server:
        reference_run = pool.submit(run_engine, reference_job, tmp_path, "no-speculation")
        asyncio.run(drive(server.url, str(smollm2), warmup))
        rss_warm = server_rss(server)
        before = server.metrics()
        outcomes = asyncio.run(drive(server.url, str(smollm2), soak))
        rss_end = server_rss(server)
        after = server.metrics()
        health = asyncio.run(_health(server.url))
        alive = server.proc is not None and server.proc.poll() is None

        reference = reference_run.result()["token_ids"]

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    completed = [(i, o) for i, o in enumerate(outcomes) if not o.aborted]
    errors = [(i, o.status, o.error) for i, o in enumerate(outcomes)
              if o.error is not None or (not o.aborted and not o.finished)]
    mismatched = [i for i, o in completed if o.token_ids != reference[i][: soak[i].max_tokens]]
    summary = {
        "requests": len(soak), "completed": len(completed),
        "aborted": sum(o.aborted for o in outcomes), "errors": len(errors),
        "mismatched": len(mismatched),
        "preemptions": delta("vllm:num_preemptions_total"),
        "draft_tokens": delta("vllm:spec_decode_num_draft_tokens_total"),
        "accepted_tokens": delta("vllm:spec_decode_num_accepted_tokens_total"),
        "carried_states": delta("vllm:carryover_rejected_states_total"),
        "rss_warm_mb": rss_warm / 2**20, "rss_end_mb": rss_end / 2**20,
        "rss_drift": rss_end / rss_warm - 1,
    }
    (tmp_path / "soak.json").write_text(json.dumps(summary, indent=1))
    print(f"\nsoak summary: {json.dumps(summary)}")

    assert alive and health == 200, f"server down after the soak:\n{server.tail()}"
    assert not errors, f"errors besides aborts: {errors[:5]}"
    assert summary["aborted"] >= 0.1 * NUM_REQUESTS
    assert not mismatched, (
        f"{len(mismatched)} completed requests differ from the target alone, e.g. "
        f"{mismatched[0]}: {outcomes[mismatched[0]].token_ids} vs "
        f"{reference[mismatched[0]][: soak[mismatched[0]].max_tokens]}")
    assert all(len(o.token_ids) == soak[i].max_tokens for i, o in completed)
    assert summary["preemptions"] > 0, "the KV cache was big enough: nothing preempted"
    assert summary["carried_states"] > 0
    assert "slot ownership is checked every round" in log.read_text()
    assert abs(summary["rss_drift"]) <= MEMORY_DRIFT, summary


async def _health(url: str) -> int:
    async with aiohttp.ClientSession(trust_env=False) as session, \
            session.get(f"{url}/health") as resp:
        return resp.status


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-s"]))
