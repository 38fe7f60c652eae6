"""The benchmarks' prompts: held-out prompts of the five training categories.

Built straight from the offline corpora by `train.prompts` (its held-out split:
units no training prompt of the dataset `smollm2-mix-v2` shares), so a fresh
machine needs no generated dataset. Every row of a benchmark gets exactly the
same prompts. The drafters shipped before that dataset were trained on prompts
drawn by an earlier rule: the math seed and the Bible books were held out then
too, but some held-out chat conversations and code modules may have been in
their training data.
"""

from __future__ import annotations

from vllm_carryover.train.prompts import CATEGORIES, Prompt, build_prompts, prompt_token_ids


def heldout_prompts(num_per_category: int, categories: tuple[str, ...] = CATEGORIES,
                    seed: int = 0) -> dict[str, list[Prompt]]:
    """The first `num_per_category` held-out prompts of each category, in category order."""
    prompts = build_prompts(0, num_per_category, seed, tuple(categories))
    return {c: [p for p in prompts if p.category == c] for c in categories}


def chat_texts(target: str, prompts: dict[str, list[Prompt]]) -> dict[str, list[str]]:
    """Each prompt rendered with the target's chat template (generation prompt added),
    as the text a completions request sends."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    return {c: [tok.apply_chat_template(p.messages, add_generation_prompt=True,
                                        tokenize=False) for p in ps]
            for c, ps in prompts.items()}


def chat_token_ids(target: str, prompts: dict[str, list[Prompt]]) -> dict[str, list[list[int]]]:
    """Each prompt as chat-templated token ids (what an offline `generate` gets)."""
    return {c: prompt_token_ids(target, ps) for c, ps in prompts.items()}
