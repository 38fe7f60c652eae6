"""Training and evaluation prompts in four categories, from text available offline.

| category | source | split unit (train and eval never share one) |
| --- | --- | --- |
| chat | Chit Chat Challenge conversations (PyPI `chitchat-dataset`) | conversation |
| math | GSM8K-style problems (`reasoning-gym` `gsm_symbolic`) | generator seed |
| code | functions of the Python standard library | module file |
| translation | KJV / Reina-Valera verses, en->es and es->en (Debian SWORD) | Bible book |

Only the prompts come from these sources: the responses are the target's own
(`train.data.generate`), so the drafter learns the target's distribution.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CATEGORIES = ("chat", "code", "math", "translation")
SPLITS = ("train", "heldout")
# translation: whole books kept for evaluation (small books from both testaments)
EVAL_BOOKS = ("Ruth", "Jonah", "Mark", "Phil", "Jas")
_MATH_SEEDS = {"train": 1001, "heldout": 2002}
_CODE_EVAL_FRACTION = 0.15


@dataclass
class Prompt:
    """One chat request: id, split unit (`group`), category, split, chat messages."""

    id: str
    group: str
    category: str
    split: str
    messages: list[dict[str, str]]


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def chat_prompts(counts: dict[str, int], rnd: random.Random) -> list[Prompt]:
    """First turns (sometimes three turns) of conversations; eval conversations are
    drawn from the end of a seeded shuffle, train ones from its start."""
    import chitchat_dataset

    data = chitchat_dataset.Dataset()
    keys = sorted(data)
    rnd.shuffle(keys)
    order = {"train": keys, "heldout": keys[::-1]}
    out: list[Prompt] = []
    used: set[str] = set()
    for split, n in counts.items():
        got = 0
        for key in order[split]:
            if got == n:
                break
            if key in used:
                continue
            turns = [" ".join(u["text"] for u in m).strip() for m in data[key]["messages"]]
            turns = [t for t in turns if t]
            if not turns or len(turns[0]) > 400:
                continue
            if len(turns) >= 3 and rnd.random() < 0.3 and all(len(t) < 300 for t in turns[:3]):
                msgs = [{"role": r, "content": t}
                        for r, t in zip(("user", "assistant", "user"), turns[:3], strict=True)]
            else:
                msgs = _user(turns[0])
            used.add(key)
            out.append(Prompt(f"chat-{key}", f"chat-{key}", "chat", split, msgs))
            got += 1
    return out


def math_prompts(counts: dict[str, int], rnd: random.Random) -> list[Prompt]:
    """GSM8K-style word problems; train and eval come from different generator seeds."""
    import reasoning_gym

    out: list[Prompt] = []
    for split, n in counts.items():
        if n == 0:  # the generator refuses size 0
            continue
        seed = _MATH_SEEDS[split]
        ds = reasoning_gym.create_dataset("gsm_symbolic", size=n, seed=seed)
        for i, item in enumerate(ds):
            text = item["question"].strip()
            if rnd.random() < 0.5:
                text += " Explain step by step."
            out.append(Prompt(f"math-{seed}-{i}", f"math-seed{seed}", "math", split,
                              _user(text)))
    return out


def _stdlib_functions(path: Path) -> list[tuple[str, str, str]]:
    """(name, source, first docstring line) of documented top-level functions."""
    try:
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        code = ast.get_source_segment(src, node)
        if doc and code and 150 <= len(code) <= 1200:
            out.append((node.name, code, doc.strip().splitlines()[0]))
    return out


def code_prompts(counts: dict[str, int], rnd: random.Random) -> list[Prompt]:
    """"Explain this function" and "write a function that ..." requests over standard
    library functions; a seeded 15% of the module files are eval-only."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py")
                   if not {"test", "tests", "idlelib", "site-packages"} & set(p.parts))
    rnd.shuffle(files)
    n_eval = max(1, int(len(files) * _CODE_EVAL_FRACTION))
    by_split = {"heldout": files[:n_eval], "train": files[n_eval:]}
    out: list[Prompt] = []
    for split, n in counts.items():
        funcs: list[tuple[Path, str, str, str]] = []
        for f in by_split[split]:  # at most 3 per file: many modules, parsed lazily
            found = _stdlib_functions(f)
            funcs += [(f, *fn) for fn in rnd.sample(found, min(3, len(found)))]
            if len(funcs) >= 3 * n:
                break
        rnd.shuffle(funcs)
        for file, name, code, doc in funcs[:n]:
            module = str(file.relative_to(stdlib))
            if rnd.random() < 0.5:
                text = f"Explain what this Python function does:\n\n```python\n{code}\n```"
            else:
                sig = code.split(":\n", 1)[0].removeprefix("def ")
                text = f"Write a Python function `{sig}`. {doc}"
            out.append(Prompt(f"code-{module}-{name}", f"code-{module}", "code", split,
                              _user(text)))
    return out


def translation_prompts(counts: dict[str, int], rnd: random.Random) -> list[Prompt]:
    """Single verses to translate, English to Spanish or back; eval books are
    `EVAL_BOOKS`, never seen in training."""
    from train.sword_bible import verse_pairs

    pairs = [p for p in verse_pairs() if len(p.english) <= 300 and len(p.spanish) <= 300]
    out: list[Prompt] = []
    for split, n in counts.items():
        pool = [p for p in pairs if (p.book in EVAL_BOOKS) == (split == "heldout")]
        for v in rnd.sample(pool, min(n, len(pool))):
            text = (f"Translate to Spanish: {v.english}" if rnd.random() < 0.5
                    else f"Translate to English: {v.spanish}")
            out.append(Prompt(f"translation-{v.testament}-{v.index}",
                              f"translation-{v.book}", "translation", split, _user(text)))
    return out


SOURCES: dict[str, Callable[[dict[str, int], random.Random], list[Prompt]]] = {
    "chat": chat_prompts, "code": code_prompts, "math": math_prompts,
    "translation": translation_prompts}


def build_prompts(num_train: int, num_eval: int, seed: int,
                  categories: tuple[str, ...] = CATEGORIES) -> list[Prompt]:
    """`num_train` + `num_eval` prompts per category, each split from its own units."""
    out: list[Prompt] = []
    for cat in categories:
        out += SOURCES[cat]({"train": num_train, "heldout": num_eval},
                            random.Random(f"{seed}-{cat}"))
    random.Random(seed).shuffle(out)
    return out
