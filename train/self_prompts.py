"""Prompts the target writes itself (Magpie-style), for the general category.

Given only the start of a user turn in its chat template (system prompt, then
`<|im_start|>user\\n`), a chat model samples the kind of request it was tuned
on. Sampled at temperature 1 (top-p 0.95), seeded by the engine, then kept
if it reads as an English request of reasonable length, not repeating itself,
and not a duplicate. The unit of the split is the request itself.
"""

from __future__ import annotations

import re
from typing import Any

from vllm_carryover.train.prompts import Prompt, split_of, text_key

_MARK = "\x00USER\x00"
_LETTERS = re.compile(r"[A-Za-z]")


def user_turn_prefix(tokenizer: Any) -> list[int]:
    """Token ids of the chat template up to where a user's text begins."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                         add_generation_prompt=False)
    return tokenizer.encode(text.split(_MARK)[0], add_special_tokens=False)


def usable(text: str) -> bool:
    """A plausible English request: 20-500 characters, mostly letters, ASCII, and no
    word run repeated (small models loop)."""
    words = text.split()
    if not 20 <= len(text) <= 500 or len(words) < 4:
        return False
    if sum(c.isascii() for c in text) < 0.97 * len(text):
        return False
    if len(_LETTERS.findall(text)) < 0.6 * len(text):
        return False
    return len(set(words)) >= 0.5 * len(words)


def self_prompts(target: str, count: int, seed: int, *, workers: int = 1,
                 cpus_per_worker: int = 2, ray_address: str | None = None
                 ) -> list[Prompt]:
    """About `count` distinct usable requests written by the target (general category).

    Samples 2x `count` candidates in one engine (usually enough after filtering)."""
    import ray
    from transformers import AutoTokenizer
    from vllm_carryover.train.answerer import Answerer, engine_kwargs
    from vllm_carryover.train.ray_shards import ray_session

    from vllm_carryover.dtype import fastest_dtype

    tok = AutoTokenizer.from_pretrained(target)
    prefix = user_turn_prefix(tok)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    with ray_session(workers, cpus_per_worker, ray_address):
        engine = dict(engine_kwargs(target, 512, 2.0, 256, fastest_dtype()), seed=seed)
        actor = ray.remote(num_cpus=cpus_per_worker)(Answerer).remote(
            engine, 64, temperature=1.0, top_p=0.95, stop_token_ids=[end])
        ray.get(actor.add.remote(0, [prefix] * (2 * count)))
        _, outs, _ = ray.get(actor.next_done.remote())
    out: list[Prompt] = []
    seen: set[str] = set()
    for j, ids in enumerate(outs):
        text = tok.decode([t for t in ids if t != end], skip_special_tokens=True).strip()
        p = Prompt(f"general-self-{seed}-{j}", "", "general", "", [{"role": "user",
                                                                      "content": text}])
        key = text_key(p)
        if usable(text) and key not in seen:
            seen.add(key)
            p.group = f"self-{key[:200]}"
            p.split = split_of(p.group)
            out.append(p)
        if len(out) == count:
            break
    print(f"self-written prompts: {len(out)} kept of {len(outs)} sampled", flush=True)
    return out
