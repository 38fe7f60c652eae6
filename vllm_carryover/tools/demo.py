"""The main job: serve SmolLM2 with carryover, chat with it, show acceptance and speed.

Starts `vllm serve` twice on 127.0.0.1 (no speculation, then carryover), sends
the same OpenAI chat requests to both, prints the carryover answers (and how
many equal the plain server's), the acceptance length from vLLM's spec-decode
counters, the carryover counters, and output tokens/s against the plain server.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from vllm_carryover.tools.run_settings import (
    DRAFTERS_VAR,
    MAIN_DRAFTER,
    SHIPPED_LOOKUPS,
    drafters_folder,
    serving_env,
)
from vllm_carryover.tools.server_process import VllmServer

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Translate to Spanish: Good morning, how are you?",
    "Sam has 3 boxes with 4 pencils each. How many pencils does he have?",
]


def default_drafter(target: Path, workdir: Path) -> Path:
    """The shipped drafter of the README's main job (one layer, beside the suffix
    lookup), else a random one.

    The shipped drafters are the checkout's train/checkpoints/smollm2-135m-instruct, or
    the folder $VLLM_CARRYOVER_DRAFTERS names (an installed package has no checkout)."""
    folder = drafters_folder()
    if (folder / MAIN_DRAFTER / "model.safetensors").is_file():
        return folder / MAIN_DRAFTER
    from vllm_carryover.drafter.init_drafter import init_drafter

    print("demo: no trained drafter shipped yet; using a RANDOM drafter (it will be "
          "rejected almost always, so expect no speed-up); to use the trained ones, set "
          f"{DRAFTERS_VAR} to a folder holding {MAIN_DRAFTER}/ (a clone's "
          f"train/checkpoints/smollm2-135m-instruct), or pass --drafter; looked in {folder}",
          file=sys.stderr)
    return init_drafter(target, workdir / "random-drafter", block_size=8)


def chat_all(url: str, model: str, max_tokens: int, questions: list[str] = QUESTIONS
             ) -> tuple[list[str], int, float]:
    """Answers, output tokens and seconds for `questions`, one request at a time."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused")
    answers, tokens, start = [], 0, time.perf_counter()
    for q in questions:
        r = client.chat.completions.create(model=model, temperature=0, max_tokens=max_tokens,
                                           messages=[{"role": "user", "content": q}])
        answers.append(r.choices[0].message.content or "")
        tokens += r.usage.completion_tokens
    return answers, tokens, time.perf_counter() - start


def warm_up(url: str, model: str) -> None:
    """One untimed request: a fresh server's first one is slow (0.5-1.8 s to its first
    token on a 2-core CPU, speculative servers most; docs/results.md)."""
    chat_all(url, model, 16, ["Hello!"])


def main(argv: list[str] | None = None, prog: str = "python -m vllm_carryover.tools.demo") -> None:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Serve SmolLM2-135M-Instruct with carryover speculative decoding on "
        "127.0.0.1, ask it a few questions through the OpenAI API, and compare with the "
        "same server without speculation.")
    p.add_argument("--drafter", type=Path, help="drafter folder (default: the shipped one)")
    p.add_argument("--k", type=int, default=7, help="num_speculative_tokens")
    p.add_argument("--no-lookup", dest="lookup", action="store_false",
                   help="draft with the drafter alone (default: the suffix lookup where its "
                   "trees of the request's text and of past answers continue the text, "
                   "else the drafter's first token; with K by goodput this is the shipped "
                   "configuration measured in docs/results.md)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bfloat16 on a GPU or a CPU with native bf16 matmuls, else "
                   "float32 (default: %(default)s)")
    p.add_argument("--logs", type=Path, help="folder for the server logs (default: temp)")
    a = p.parse_args(argv)

    from vllm_carryover.dtype import resolve_dtype
    from vllm_carryover.tools.testbed import smollm2_path

    target = smollm2_path()
    a.dtype = resolve_dtype(a.dtype)
    logs = a.logs or Path(tempfile.mkdtemp(prefix="carryover-demo-"))
    drafter = a.drafter or default_drafter(target, logs)
    spec = {"method": "carryover", "model": str(drafter), "num_speculative_tokens": a.k}
    if a.lookup:
        spec |= SHIPPED_LOOKUPS
    env = serving_env()  # both servers alike
    print(f"target : {target}\ndrafter: {drafter}\ndtype  : {a.dtype}\nlogs   : {logs}")
    print(f"env    : {' '.join(f'{k}={v}' for k, v in env.items()) or '(as set)'}\n")

    print("starting vllm serve without speculation ...", flush=True)
    with VllmServer(target, logs / "plain.log", dtype=a.dtype, env=env) as plain:
        warm_up(plain.url, str(target))
        plain_answers, plain_tokens, plain_s = chat_all(plain.url, str(target), a.max_tokens)
    print("starting vllm serve with carryover ...", flush=True)
    with VllmServer(target, logs / "carryover.log", speculative_config=spec,
                    dtype=a.dtype, env=env) as server:
        warm_up(server.url, str(target))
        before = server.metrics()
        answers, tokens, seconds = chat_all(server.url, str(target), a.max_tokens)
        after = server.metrics()

    for q, ans in zip(QUESTIONS, answers, strict=True):
        print(f"\nQ: {q}\nA: {ans.strip()}")
    same = sum(x == y for x, y in zip(answers, plain_answers, strict=True))
    print(f"\n{same} of {len(QUESTIONS)} answers are token for token the plain server's", end="")
    print("." if same == len(QUESTIONS) or a.dtype == "float32" else
          f" ({a.dtype} rounds the {1 + a.k} rows of a verification differently from "
          "one-row decoding, so a near-tie can flip; float32 is identical: --dtype float32).")
    print()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafts = delta.get("vllm:spec_decode_num_drafts_total", 0.0)
    accepted = delta.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    tau = 1 + accepted / drafts if drafts else float("nan")
    print(f"acceptance length tau = 1 + accepted/drafts = 1 + {accepted:.0f}/{drafts:.0f} "
          f"= {tau:.2f}  (K={a.k})")
    print("carryover: {:.0f} rejected states carried over, {:.0f} of {:.0f} rounds with a "
          "non-empty slot".format(delta.get("vllm:carryover_rejected_states_total", 0),
                                  delta.get("vllm:carryover_nonempty_slot_rounds_total", 0),
                                  delta.get("vllm:carryover_draft_rounds_total", 0)))
    if a.lookup:
        print("suffix lookup: {:.0f} of those rounds drafted repeated text or past "
              "answers' phrases; {:.0f} steps drafted from it alone and skipped "
              "the drafter".format(delta.get("vllm:carryover_lookup_rounds_total", 0),
                                   delta.get("vllm:carryover_lookup_only_steps_total", 0)))
    plain_tps, tps = plain_tokens / plain_s, tokens / seconds
    print(f"output speed, one request at a time: {tps:.1f} tok/s with carryover vs "
          f"{plain_tps:.1f} tok/s without speculation = {tps / plain_tps:.2f}x")


if __name__ == "__main__":
    main()
