"""`vllm serve` with a carryover drafter: chat completions and /metrics, end to end.

One server for the whole module (an engine start costs ~45 s on CPU), started
and always stopped by the same `VllmServer` helper the demo and benchmarks use. The drafter
is random, so nearly every draft is rejected and carried over: the carryover
counters must move, and greedy output must not depend on streaming.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from vllm_carryover.tools.server_process import VllmServer

NUM_SPECULATIVE_TOKENS = 4
STARTUP_TIMEOUT_S = 240
SPEC_DECODE_DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_ROUNDS = "vllm:carryover_draft_rounds_total"
NONEMPTY_SLOT_ROUNDS = "vllm:carryover_nonempty_slot_rounds_total"
REJECTED_STATES = "vllm:carryover_rejected_states_total"
CARRYOVER_COUNTERS = (DRAFT_ROUNDS, NONEMPTY_SLOT_ROUNDS, REJECTED_STATES)
MESSAGES = [{"role": "user",
             "content": "Name three primary colors and describe each in one sentence."}]


@dataclass(frozen=True)
class Server:
    base_url: str
    model: str
    client: OpenAI
    log: Path


@pytest.fixture(scope="module")
def server(smollm2: Path, random_drafter: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    spec = {"method": "carryover", "model": str(random_drafter),
            "num_speculative_tokens": NUM_SPECULATIVE_TOKENS, "carryover": True}
    log = tmp_path_factory.mktemp("vllm_serve") / "serve.log"
    with VllmServer(smollm2, log, speculative_config=spec, dtype="float32",
                    max_model_len=1024, start_timeout=STARTUP_TIMEOUT_S) as proc:
        client = OpenAI(base_url=f"{proc.url}/v1", api_key="x", timeout=120,
                        max_retries=0, http_client=httpx.Client(trust_env=False))
        yield Server(proc.url, str(smollm2), client, log)


def chat(server: Server, max_tokens: int = 32) -> str:
    response = server.client.chat.completions.create(
        model=server.model, messages=MESSAGES, temperature=0, max_tokens=max_tokens)
    return response.choices[0].message.content or ""


def chat_streamed(server: Server, max_tokens: int = 32) -> str:
    stream = server.client.chat.completions.create(
        model=server.model, messages=MESSAGES, temperature=0, max_tokens=max_tokens,
        stream=True)
    return "".join(chunk.choices[0].delta.content or ""
                   for chunk in stream if chunk.choices)


def scrape(server: Server) -> dict[str, float]:
    """Every sample on /metrics, summed over labels, by sample name."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10, trust_env=False).text
    totals: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] += sample.value
    return dict(totals)


def scrape_until(server: Server, done: Callable[[dict[str, float]], bool],
                 timeout_s: float = 15) -> dict[str, float]:
    """Scrape until `done` holds (vLLM's own stats may land a moment after a reply)."""
    deadline = time.monotonic() + timeout_s
    metrics = scrape(server)
    while not done(metrics) and time.monotonic() < deadline:
        time.sleep(0.5)
        metrics = scrape(server)
    return metrics


def test_chat_completion_returns_text(server):
    assert chat(server).strip()


def test_streamed_chat_equals_non_streamed_under_greedy_sampling(server):
    whole = chat(server)
    streamed = chat_streamed(server)
    assert whole.strip()
    assert streamed == whole


def test_metrics_show_spec_decode_drafts_and_carryover_counters(server):
    chat(server)
    metrics = scrape_until(server, lambda m: m.get(SPEC_DECODE_DRAFTS, 0) > 0)
    missing = [name for name in (SPEC_DECODE_DRAFTS, *CARRYOVER_COUNTERS)
               if name not in metrics]
    assert not missing, f"not on /metrics: {missing}"
    assert metrics[SPEC_DECODE_DRAFTS] > 0
    assert metrics[DRAFT_ROUNDS] > 0
    # A random drafter is almost always wrong: rejected drafts fill the slots.
    assert metrics[REJECTED_STATES] > 0
    assert 0 < metrics[NONEMPTY_SLOT_ROUNDS] <= metrics[DRAFT_ROUNDS]
    assert metrics[REJECTED_STATES] <= NUM_SPECULATIVE_TOKENS * metrics[NONEMPTY_SLOT_ROUNDS]


def test_counters_advance_with_each_request(server):
    counters = (SPEC_DECODE_DRAFTS, DRAFT_ROUNDS, REJECTED_STATES)
    before = scrape(server)
    chat(server)
    after = scrape_until(
        server, lambda m: all(m.get(c, 0) > before.get(c, 0) for c in counters))
    for name in counters:
        assert after.get(name, 0) > before.get(name, 0), name


def test_plain_dflash_checkpoint_loads_with_zero_rejected_embedding_and_says_so(server):
    log = server.log.read_text(errors="replace")
    assert "Carryover drafting: context from rejected states is on." in log
    assert "Drafter checkpoint has no rejected_embedding: it starts at zero" in log


def test_vllm_bench_serve_runs_against_the_carryover_server(server, tmp_path):
    before = scrape(server)
    proc = subprocess.run(
        ["vllm", "bench", "serve", "--base-url", server.base_url, "--model", server.model,
         "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "16",
         "--num-prompts", "4", "--max-concurrency", "2", "--ignore-eos", "--save-result",
         "--result-dir", str(tmp_path), "--result-filename", "bench.json"],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == 4
    assert result["total_output_tokens"] == 4 * 16
    after = scrape_until(server, lambda m: m.get(DRAFT_ROUNDS, 0) > before.get(DRAFT_ROUNDS, 0))
    assert after[DRAFT_ROUNDS] > before.get(DRAFT_ROUNDS, 0)
