"""`vllm serve --api-server-count 2`: the carryover counters on /metrics, counted once.

With several API servers vLLM serves /metrics from a Prometheus multiprocess
registry that each API server builds itself, and each API server builds the
engine config again. The counters must still appear on every API server's
/metrics, read from the engine's own counter files, not doubled and not from an
empty folder of the API server's own.
"""

from __future__ import annotations

from pathlib import Path

import httpx
from openai import OpenAI
from test_server import (
    DRAFT_ROUNDS,
    MESSAGES,
    NUM_SPECULATIVE_TOKENS,
    SPEC_DECODE_DRAFTS,
    STARTUP_TIMEOUT_S,
    Server,
    scrape,
    scrape_until,
)

from vllm_carryover.tools.server_process import VllmServer

REQUESTS = 4


def test_counters_on_metrics_are_the_engines_once_with_two_api_servers(
        smollm2: Path, random_drafter: Path, tmp_path: Path) -> None:
    spec = {"method": "carryover", "model": str(random_drafter),
            "num_speculative_tokens": NUM_SPECULATIVE_TOKENS, "carryover": True}
    with VllmServer(smollm2, tmp_path / "serve.log", speculative_config=spec,
                    dtype="float32", max_model_len=1024, start_timeout=STARTUP_TIMEOUT_S,
                    extra_args=["--api-server-count", "2"]) as proc:
        client = OpenAI(base_url=f"{proc.url}/v1", api_key="x", timeout=120, max_retries=0,
                        http_client=httpx.Client(trust_env=False))
        server = Server(proc.url, str(smollm2), client, tmp_path / "serve.log")
        for _ in range(REQUESTS):
            client.chat.completions.create(model=server.model, messages=MESSAGES,
                                           temperature=0, max_tokens=24)
        first = scrape_until(server, lambda m: m.get(SPEC_DECODE_DRAFTS, 0) > 0)
        # New connections go to either API server: several scrapes reach both.
        scrapes = [first, *(scrape(server) for _ in range(6))]
    log = (tmp_path / "serve.log").read_text()
    assert "Started 2 API server processes" in log
    for metrics in scrapes:
        drafts, rounds = metrics[SPEC_DECODE_DRAFTS], metrics.get(DRAFT_ROUNDS, 0)
        # Every verified draft was proposed once; only each request's last proposal
        # may go unverified. Doubled counters (or an empty folder) break this.
        assert drafts <= rounds <= drafts + REQUESTS, (drafts, rounds)
