"""Malformed API requests with carryover on get vLLM's normal 4xx answers, and the
server keeps serving.

Carryover changes only the engine's drafting, so request validation must stay
vLLM's: every bad request is refused with an OpenAI-style error body before it
reaches the engine, and a valid request afterwards still completes and still
drives the carryover drafter (its counters move). One server for the module.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from vllm_carryover.tools.server_process import VllmServer

STARTUP_TIMEOUT_S = 300
MAX_MODEL_LEN = 1024
DRAFT_ROUNDS = "vllm:carryover_draft_rounds_total"
MESSAGES = [{"role": "user", "content": "Name three primary colors."}]


@dataclass(frozen=True)
class BadRequest:
    """A malformed request: where it goes, its raw body, and vLLM's status for it."""

    path: str
    body: dict[str, Any] | list[Any] | bytes
    status: int


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "The capital of France is", "max_tokens": 8, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, "max_tokens": 8, **fields}


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
TOO_LONG = "hello " * (2 * MAX_MODEL_LEN)

# "model" is filled in with the served model unless the case sets it.
BAD_REQUESTS: dict[str, BadRequest] = {
    "completion_invalid_json": BadRequest(COMPLETIONS, b'{"prompt": "Hi", "max_tokens": ', 400),
    "completion_body_not_object": BadRequest(COMPLETIONS, ["The capital of France is"], 400),
    "completion_missing_prompt": BadRequest(COMPLETIONS, {"max_tokens": 8}, 400),
    "completion_max_tokens_not_int": BadRequest(COMPLETIONS, completion(max_tokens="x"), 400),
    "completion_negative_max_tokens": BadRequest(COMPLETIONS, completion(max_tokens=-1), 400),
    "completion_negative_temperature": BadRequest(COMPLETIONS, completion(temperature=-1),
                                                  400),
    "completion_prompt_beyond_max_model_len": BadRequest(COMPLETIONS,
                                                         completion(prompt=TOO_LONG), 400),
    "completion_unknown_model": BadRequest(COMPLETIONS, completion(model="no-such-model"),
                                           404),
    "completion_n_zero": BadRequest(COMPLETIONS, completion(n=0), 400),
    "completion_logprobs_beyond_max": BadRequest(COMPLETIONS, completion(logprobs=100), 400),
    "completion_stream_negative_temperature": BadRequest(
        COMPLETIONS, completion(stream=True, temperature=-1), 400),
    "chat_invalid_json": BadRequest(CHAT, b'{"messages": [', 400),
    "chat_missing_messages": BadRequest(CHAT, {"max_tokens": 8}, 400),
    "chat_messages_not_list": BadRequest(CHAT, chat(messages="hello"), 400),
    "chat_message_without_role": BadRequest(CHAT, chat(messages=[{"content": "hi"}]), 400),
    "chat_message_content_not_text": BadRequest(CHAT, chat(messages=[{"role": "user",
                                                                      "content": 5}]), 400),
    "chat_max_tokens_not_int": BadRequest(CHAT, chat(max_tokens="x"), 400),
    "chat_negative_temperature": BadRequest(CHAT, chat(temperature=-1), 400),
    "chat_unknown_model": BadRequest(CHAT, chat(model="no-such-model"), 404),
    "chat_n_zero": BadRequest(CHAT, chat(n=0), 400),
    "chat_top_logprobs_without_logprobs": BadRequest(CHAT, chat(top_logprobs=5), 400),
    "chat_top_logprobs_beyond_max": BadRequest(CHAT, chat(logprobs=True, top_logprobs=100),
                                               400),
}


@dataclass(frozen=True)
class Answers:
    """The server, and its answer to every bad request (sent once, in order)."""

    server: VllmServer
    model: str
    draft_rounds_before: float
    responses: dict[str, httpx.Response]


def encode(body: dict[str, Any] | list[Any] | bytes, model: str) -> bytes:
    if isinstance(body, bytes):
        return body
    if isinstance(body, dict):
        body = {"model": model, **body}
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
def answers(smollm2: Path, random_drafter: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Answers]:
    spec = {"method": "carryover", "model": str(random_drafter), "num_speculative_tokens": 4,
            "carryover": True}
    log = tmp_path_factory.mktemp("bad_requests") / "serve.log"
    with VllmServer(smollm2, log, speculative_config=spec, dtype="float32",
                    max_model_len=MAX_MODEL_LEN, start_timeout=STARTUP_TIMEOUT_S) as server, \
            httpx.Client(base_url=server.url, timeout=60, trust_env=False) as client:
        before = server.metrics().get(DRAFT_ROUNDS, 0.0)
        responses = {
            name: client.post(bad.path, content=encode(bad.body, str(smollm2)),
                              headers={"Content-Type": "application/json"})
            for name, bad in BAD_REQUESTS.items()
        }
        yield Answers(server, str(smollm2), before, responses)


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_malformed_request_gets_a_4xx_with_an_error_body(answers, case):
    response = answers.responses[case]
    assert response.status_code == BAD_REQUESTS[case].status, response.text
    error = response.json()["error"]
    assert error["message"], response.text
    assert error["code"] == response.status_code


def test_server_still_serves_and_drafts_after_malformed_requests(answers):
    server = answers.server
    with httpx.Client(base_url=server.url, timeout=120, trust_env=False) as client:
        response = client.post(COMPLETIONS, json=completion(model=answers.model, temperature=0,
                                                            max_tokens=16))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"].strip()
    assert server.proc is not None and server.proc.poll() is None
    assert server.metrics().get(DRAFT_ROUNDS, 0.0) > answers.draft_rounds_before
