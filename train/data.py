"""Training data: chat-like prompts and the target's own greedy responses.

Prompts come from the Chit Chat Challenge conversations (PyPI `chitchat-dataset`,
MIT) plus small templated math / code / translation / explanation / writing
requests. Every prompt has a `group` (its conversation or template family
instance); the held-out split never shares a group with the training split.
The target answers every prompt greedily in one vLLM batch, so the drafter
learns the target's own distribution.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SAMPLES_FILE = "samples.jsonl"
MANIFEST_FILE = "manifest.json"

_TOPICS = ["photosynthesis", "the water cycle", "gravity", "volcanoes", "the internet",
           "vaccines", "black holes", "democracy", "inflation", "the immune system",
           "machine learning", "climate change", "the French Revolution", "DNA",
           "electricity", "the moon landing", "earthquakes", "rainbows", "recycling",
           "the stock market", "bees", "sleep", "coffee", "the Roman Empire", "tides"]
_LANGS = ["French", "Spanish", "German", "Italian", "Portuguese"]
_SENTENCES = ["Where is the train station?", "I would like a cup of tea, please.",
              "The weather is nice today.", "How much does this cost?",
              "My brother lives in a small town near the sea.",
              "Can you help me find my keys?", "We are going to the cinema tonight.",
              "This book is very interesting.", "I am learning to cook.",
              "The children are playing in the garden.", "What time does the shop open?",
              "I forgot my umbrella at home."]
_CODE = ["reverses a string", "checks whether a number is prime", ("computes the factorial "
         "of n"), "sorts a list of numbers with bubble sort", "counts the vowels in a word",
         "returns the largest element of a list", "computes Fibonacci numbers",
         "checks whether a word is a palindrome", "merges two sorted lists",
         "converts Celsius to Fahrenheit", "removes duplicates from a list",
         "sums the digits of an integer"]
_CODE_LANGS = ["Python", "JavaScript", "C", "Java"]
_WRITING = ["a short poem about {t}", "a short story about a {a} who finds a {o}",
            "an email to my manager asking for a day off", "three tips for {s}",
            "a product description for a {o}", "a haiku about {t}"]
_ANIMALS = ["cat", "dog", "fox", "robot", "dragon", "sailor", "teacher", "rabbit"]
_OBJECTS = ["lamp", "map", "key", "bicycle", "backpack", "watch", "umbrella", "violin"]
_SKILLS = ["studying", "sleeping better", "saving money", "learning a language",
           "staying healthy", "cooking at home", "public speaking", "running"]


@dataclass
class Prompt:
    """One chat request: its id, split group, category and chat messages."""

    id: str
    group: str
    category: str
    messages: list[dict[str, str]]


def chitchat_prompts(n: int, rnd: random.Random) -> list[Prompt]:
    """`n` single-turn (sometimes three-turn) chats from the Chit Chat Challenge data."""
    import chitchat_dataset

    data = chitchat_dataset.Dataset()
    keys = sorted(data)
    rnd.shuffle(keys)
    out: list[Prompt] = []
    for key in keys:
        turns = [" ".join(u["text"] for u in m).strip() for m in data[key]["messages"]]
        turns = [t for t in turns if t]
        if not turns or len(turns[0]) > 400:
            continue
        if len(turns) >= 3 and rnd.random() < 0.3 and all(len(t) < 300 for t in turns[:3]):
            roles = ["user", "assistant", "user"]
            msgs = [{"role": r, "content": t} for r, t in zip(roles, turns[:3], strict=True)]
        else:
            msgs = [{"role": "user", "content": turns[0]}]
        out.append(Prompt(f"chat-{key}", f"chat-{key}", "chat", msgs))
        if len(out) == n:
            break
    return out


def templated_prompts(n: int, rnd: random.Random) -> list[Prompt]:
    """`n` templated math, code, translation, explanation and writing requests."""
    makers = {
        "math": lambda: (f"What is {rnd.randint(2, 99)} {rnd.choice('+-*')} "
                         f"{rnd.randint(2, 99)}? Explain step by step."
                         if rnd.random() < 0.5 else
                         f"A shop sells {rnd.randint(3, 20)} apples for "
                         f"{rnd.randint(2, 9)} dollars. How much do {rnd.randint(21, 60)} "
                         "apples cost?"),
        "code": lambda: (f"Write a {rnd.choice(_CODE_LANGS)} function that "
                         f"{rnd.choice(_CODE)}."),
        "translation": lambda: (f"Translate to {rnd.choice(_LANGS)}: "
                                f"{rnd.choice(_SENTENCES)}"),
        "explain": lambda: rnd.choice(["Explain {t} in simple terms.", "What is {t}?",
                                       "Tell me three facts about {t}.",
                                       "Why is {t} important?"]).format(t=rnd.choice(_TOPICS)),
        "writing": lambda: "Write " + rnd.choice(_WRITING).format(
            t=rnd.choice(_TOPICS), a=rnd.choice(_ANIMALS), o=rnd.choice(_OBJECTS),
            s=rnd.choice(_SKILLS)),
    }
    seen: set[str] = set()
    out: list[Prompt] = []
    cats = sorted(makers)
    for _ in range(n * 20):
        cat = cats[len(out) % len(cats)]
        text = makers[cat]()
        if text in seen:
            continue
        seen.add(text)
        pid = f"{cat}-{len(out)}"
        out.append(Prompt(pid, pid, cat, [{"role": "user", "content": text}]))
        if len(out) == n:
            break
    return out


def build_prompts(num_chat: int, num_templated: int, seed: int) -> list[Prompt]:
    rnd = random.Random(seed)
    prompts = chitchat_prompts(num_chat, rnd) + templated_prompts(num_templated, rnd)
    rnd.shuffle(prompts)
    return prompts


def split_groups(prompts: list[Prompt], heldout_frac: float, seed: int) -> set[str]:
    """The groups held out for evaluation (about `heldout_frac` of the prompts)."""
    groups = sorted({p.group for p in prompts})
    random.Random(seed + 1).shuffle(groups)
    return set(groups[: max(1, round(len(groups) * heldout_frac))])


def generate(target: str, prompts: list[Prompt], max_tokens: int) -> list[dict[str, Any]]:
    """Greedy target responses for all prompts, one vLLM batch; token ids included."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(target)
    prompt_ids = [tok.apply_chat_template(p.messages, add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
                  for p in prompts]
    prompt_ids = [list(ids["input_ids"] if isinstance(ids, dict) else ids)
                  for ids in prompt_ids]
    llm = LLM(model=target, dtype="bfloat16", enforce_eager=True, max_model_len=1024,
              kv_cache_memory_bytes=1 << 30, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    rows = []
    for p, ids, o in zip(prompts, prompt_ids, outs, strict=True):
        resp = list(o.outputs[0].token_ids)
        rows.append(dict(asdict(p), prompt_ids=ids, response_ids=resp,
                         response=o.outputs[0].text))
    return rows


def write_dataset(out: Path, rows: list[dict[str, Any]], heldout: set[str],
                  meta: dict[str, Any]) -> dict[str, Any]:
    """Write `samples.jsonl` (with a `split` per row) and `manifest.json`; return it."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(dict(r, split="heldout" if r["group"] in heldout else "train"))
             for r in rows]
    blob = ("\n".join(lines) + "\n").encode()
    (out / SAMPLES_FILE).write_bytes(blob)
    splits = [json.loads(x)["split"] for x in lines]
    manifest = dict(meta, samples=len(rows), train=splits.count("train"),
                    heldout=splits.count("heldout"),
                    tokens=sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows),
                    response_tokens=sum(len(r["response_ids"]) for r in rows),
                    sha256=hashlib.sha256(blob).hexdigest())
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def load_samples(data: Path, split: str | None = None) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (data / SAMPLES_FILE).read_text().splitlines() if x]
    return [r for r in rows if split is None or r["split"] == split]


def load_manifest(data: Path) -> dict[str, Any]:
    return json.loads((data / MANIFEST_FILE).read_text())
