"""The soak workload: streamed greedy completions of random length, some hung up.

Chat questions padded with random filler to ~30..300 prompt tokens, 4..32
output tokens, a fifth of the requests hung up by the client after 1..6
stream chunks; driven at a fixed concurrency over aiohttp. Shared by the soak
test (`tests/test_soak.py`) and the server memory benchmark
(`tests/support/memory_growth.py`).
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from support.chat_prompts import QUESTIONS

CONCURRENCY = 32
ABORT_FRACTION = 0.2
MAX_TOKENS = 32
KV_CACHE_BYTES = 128 << 20  # ~2800 fp32 SmolLM2 tokens: 32 requests need ~2x that
MAX_MODEL_LEN = 512


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    abort_after: int | None  # stream chunks to read before hanging up


@dataclass
class Outcome:
    status: int = 0
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    aborted: bool = False
    error: str | None = None


def make_requests(smollm2: Path, n: int, seed: int) -> list[Request]:
    """Chat prompts padded with random filler to random lengths (~30..300 tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    rng = random.Random(seed)
    filler = tok(" ".join(QUESTIONS), add_special_tokens=False).input_ids
    out = []
    for _ in range(n):
        text = tok.apply_chat_template([{"role": "user", "content": rng.choice(QUESTIONS)}],
                                       tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False).input_ids
        start = rng.randrange(len(filler))
        pad = filler[start : start + rng.choice([0, 0, 16, 64, 160])]
        abort = rng.randint(1, 6) if rng.random() < ABORT_FRACTION else None
        out.append(Request(pad + ids, rng.randint(4, MAX_TOKENS), abort))
    return out


async def complete(session: aiohttp.ClientSession, url: str, model: str,
                   req: Request) -> Outcome:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
    out = Outcome()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            out.status = resp.status
            if resp.status != 200:
                out.error = (await resp.text())[:300]
                return out
            chunks = 0
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    out.finished = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = json.dumps(event["error"])[:300]
                    break
                for choice in event.get("choices", []):
                    out.token_ids += choice.get("token_ids") or []
                chunks += 1
                if req.abort_after is not None and chunks >= req.abort_after:
                    out.aborted = True
                    resp.close()  # hang up mid-stream: the server must abort the request
                    break
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        out.error = repr(e)
    return out


async def drive(url: str, model: str, reqs: list[Request]) -> list[Outcome]:
    limit = asyncio.Semaphore(CONCURRENCY)
    timeout = aiohttp.ClientTimeout(total=900)
    connector = aiohttp.TCPConnector(limit=CONCURRENCY * 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                     trust_env=False) as session:
        async def one(r: Request) -> Outcome:
            async with limit:
                return await complete(session, url, model, r)

        return await asyncio.gather(*(one(r) for r in reqs))
