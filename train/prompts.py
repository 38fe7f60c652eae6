"""Training and evaluation prompts in five categories, from text available offline.

- chat: Chit Chat Challenge conversations (PyPI `chitchat-dataset`), first turn
  or three turns; unit: conversation.
- code: documented functions of the standard library and the installed
  packages, to explain, write, test, review or document; unit: module file.
- math: `reasoning-gym` word problems (`gsm_symbolic`, half) and arithmetic
  generators; unit: generator + seed.
- translation: Bible verses en<->es (Debian SWORD, unit: book), software
  messages en<->es/fr/de/it/pt (gettext catalogs, unit: catalog), chat lines
  (unit: conversation) and docstrings (unit: module file) into es/fr/de.
- general: summaries of and questions about long passages (Bible passages,
  package READMEs; 1-2k tokens), writing tasks, `reasoning-gym` logic and
  string puzzles; units: book, package, generator + seed.

Prompts the target writes itself (Magpie-style, `train.self_prompts`) join the
general category in `python -m train data`.

Train and held-out prompts never share a unit: `split_of` decides from a hash of
the unit alone (whole Bible books for the Bible, `EVAL_BOOKS`), so the same unit
lands in the same split in every category, on every machine, for every count.
Only the prompts come from these sources: the responses are the target's own
(`train.data`), so the drafter learns the target's distribution.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

CATEGORIES = ("chat", "code", "math", "translation", "general")
# translation and passages: whole books kept for evaluation (both testaments)
EVAL_BOOKS = ("Ruth", "Jonah", "Mark", "Phil", "Jas")
HELDOUT_FRACTION = 0.12
# Long-passage prompts run to ~2.2k SmolLM2 tokens; the dataset drops longer ones
# (`python -m train data --max-prompt-tokens`), and every engine that serves the
# held-out prompts (train eval, the benchmarks: `run_settings.SERVE_MAX_MODEL_LEN`)
# fits any of them plus a response.
MAX_PROMPT_TOKENS = 2304
_SEEDS = {"train": 1001, "heldout": 2002}
_MATH_GENERATORS = ("gsm_symbolic", "basic_arithmetic", "chain_sum", "leg_counting",
                    "decimal_arithmetic", "fraction_simplification", "gcd", "lcm",
                    "prime_factorization", "calendar_arithmetic", "time_intervals", "products")
_REASONING_GENERATORS = ("syllogism", "knights_knaves", "aiw", "letter_counting",
                         "number_sorting", "word_sorting", "spell_backward", "caesar_cipher",
                         "sentence_reordering", "propositional_logic", "base_conversion",
                         "word_sequence_reversal")


@dataclass
class Prompt:
    """One chat request: id, split unit (`group`), category, split, chat messages."""

    id: str
    group: str
    category: str
    split: str
    messages: list[dict[str, str]]


def split_of(unit: str) -> str:
    """The split of a unit: held out for a fixed hash-chosen `HELDOUT_FRACTION` of units."""
    h = int.from_bytes(hashlib.sha256(unit.encode()).digest()[:8], "big")
    return "heldout" if h / 2**64 < HELDOUT_FRACTION else "train"


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


class _Quota:
    """Collects distinct prompts per split until each has its `counts[split]`."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.left = dict(counts)
        self.out: list[Prompt] = []
        self.seen: set[str] = set()

    def full(self, split: str | None = None) -> bool:
        return (self.left.get(split, 0) <= 0 if split else
                all(v <= 0 for v in self.left.values()))

    def add(self, p: Prompt) -> None:
        key = text_key(p)
        if not self.full(p.split) and key not in self.seen:
            self.seen.add(key)
            self.out.append(p)
            self.left[p.split] -= 1


def _round_robin(*streams: Iterator[Prompt]) -> Iterator[Prompt]:
    """Interleave several prompt streams until all are exhausted (a mix of sources)."""
    live = list(streams)
    while live:
        for s in list(live):
            try:
                yield next(s)
            except StopIteration:
                live.remove(s)


def _fill(counts: dict[str, int], streams: list[Iterator[Prompt]]) -> list[Prompt]:
    q = _Quota(counts)
    for p in _round_robin(*streams):
        q.add(p)
        if q.full():
            break
    return q.out


# ---- chat -------------------------------------------------------------------------------


def _conversations(rnd: random.Random) -> list[tuple[str, list[str]]]:
    import chitchat_dataset

    data = chitchat_dataset.Dataset()
    keys = sorted(data)
    rnd.shuffle(keys)
    out = []
    for key in keys:
        turns = [" ".join(u["text"] for u in m).strip() for m in data[key]["messages"]]
        turns = [t for t in turns if t]
        if turns and len(turns[0]) <= 400:
            out.append((f"chat-{key}", turns))
    return out


def chat_prompts(counts: dict[str, int], rnd: random.Random) -> list[Prompt]:
    """First turns, or three turns (multi-turn chat), of whole conversations."""
    def stream() -> Iterator[Prompt]:
        for unit, turns in _conversations(rnd):
            if len(turns) >= 3 and rnd.random() < 0.35 and all(len(t) < 300 for t in turns[:3]):
                msgs = [{"role": r, "content": t}
                        for r, t in zip(("user", "assistant", "user"), turns[:3], strict=True)]
            else:
                msgs = _user(turns[0])
            yield Prompt(unit, unit, "chat", split_of(unit), msgs)
    return _fill(counts, [stream()])


# ---- code -------------------------------------------------------------------------------

_CODE_TASKS: tuple[Callable[[str, str, str], str], ...] = (
    lambda code, sig, doc: f"Explain what this Python function does:\n\n```python\n{code}\n```",
    lambda code, sig, doc: f"Write a Python function `{sig}`. {doc}",
    lambda code, sig, doc: ("Write pytest unit tests for this function:\n\n"
                            f"```python\n{code}\n```"),
    lambda code, sig, doc: ("Review this Python code: point out bugs, edge cases and possible "
                            f"improvements.\n\n```python\n{code}\n```"),
    lambda code, sig, doc: ("Add type hints and a clear docstring to this function:\n\n"
                            f"```python\n{code}\n```"),
    lambda code, sig, doc: f"How would I implement `{sig}` in Python? It should: {doc}",
)


def code_prompts(counts: dict[str, int], rnd: random.Random) -> list[Prompt]:
    """Requests about documented functions of the standard library and installed
    packages, at most 3 functions per module file, files in seeded order."""
    from vllm_carryover.train.text_sources import documented_functions, python_files

    files = python_files()
    rnd.shuffle(files)

    def stream() -> Iterator[Prompt]:
        for unit, path in files:
            for fn in documented_functions(unit, path):
                sig = fn.source.split(":\n", 1)[0].removeprefix("def ")
                text = rnd.choice(_CODE_TASKS)(fn.source, sig, " ".join(fn.doc.split()))
                group = f"code-{unit}"
                yield Prompt(f"{group}-{fn.name}", group, "code", split_of(group), _user(text))
    return _fill(counts, [stream()])


# ---- math and reasoning puzzles -----------------------------------------------------------


def _gym_stream(name: str, category: str, split: str, rnd: random.Random, size: int,
                suffix: tuple[str, ...]) -> Iterator[Prompt]:
    """Questions of one reasoning-gym generator; the seed is the split's."""
    import reasoning_gym

    seed = _SEEDS[split]
    try:
        items = reasoning_gym.create_dataset(name, size=size, seed=seed)
    except (KeyError, ValueError):  # a generator this reasoning-gym does not have
        return
    unit = f"{category}-{name}-seed{seed}"
    for i, item in enumerate(items):
        yield Prompt(f"{unit}-{i}", unit, category, split,
                     _user(item["question"].strip() + rnd.choice(suffix)))


def _gym(counts: dict[str, int], rnd: random.Random, names: tuple[str, ...], category: str,
         suffix: tuple[str, ...], first_share: float = 0.0) -> list[Prompt]:
    """A mix of generators; the first one gets `first_share` of the prompts if set."""
    out: list[Prompt] = []
    for split, n in counts.items():
        if n <= 0:  # generators refuse size 0
            continue
        weights = [1] * len(names)
        if first_share:
            weights[0] = max(1, round(first_share * (len(names) - 1) / (1 - first_share)))
        per = n * max(weights) // sum(weights) + 2
        streams = [_gym_stream(name, category, split, rnd, per, suffix) for name in names]
        out += _fill({split: n}, [s for s, w in zip(streams, weights, strict=True)
                                  for _ in range(w)])
    return out


def math_prompts(counts: dict[str, int], rnd: random.Random) -> list[Prompt]:
    """Word problems (half `gsm_symbolic`) and arithmetic; the split is the generator seed."""
    return _gym(counts, rnd, _MATH_GENERATORS, "math",
                ("", " Explain step by step.", " Show your work."), first_share=0.5)


# ---- translation --------------------------------------------------------------------------


def translation_prompts(counts: dict[str, int], rnd: random.Random) -> list[Prompt]:
    """Bible verses en<->es, software messages en<->five languages, chat lines and
    docstrings into Spanish, French or German, interleaved."""
    from vllm_carryover.train.sword_bible import verse_pairs
    from vllm_carryover.train.text_sources import LANGUAGES, message_catalogs

    verses = [p for p in verse_pairs() if len(p.english) <= 300 and len(p.spanish) <= 300]
    rnd.shuffle(verses)
    messages = message_catalogs()
    rnd.shuffle(messages)

    def bible() -> Iterator[Prompt]:
        for v in verses:
            text = (f"Translate to Spanish: {v.english}" if rnd.random() < 0.5
                    else f"Translate to English: {v.spanish}")
            split = "heldout" if v.book in EVAL_BOOKS else "train"
            yield Prompt(f"translation-{v.testament}-{v.index}", f"translation-{v.book}",
                         "translation", split, _user(text))

    def software() -> Iterator[Prompt]:
        seen: set[str] = set()
        for domain, lang, en, tr in messages:
            if en in seen:
                continue
            seen.add(en)
            text = (f"Translate this software message to {LANGUAGES[lang]}: {en}"
                    if rnd.random() < 0.6 else f"Translate to English: {tr}")
            unit = f"translation-catalog-{domain}"
            yield Prompt(f"{unit}-{lang}-{len(seen)}", unit, "translation", split_of(unit),
                         _user(text))

    def chat_lines() -> Iterator[Prompt]:
        for unit, turns in _conversations(random.Random(rnd.random())):
            line = max(turns[:4], key=len)
            if 30 <= len(line) <= 300:
                lang = rnd.choice(("Spanish", "French", "German"))
                yield Prompt(f"translation-{unit}", unit, "translation", split_of(unit),
                             _user(f"Translate to {lang}: {line}"))

    def docstrings() -> Iterator[Prompt]:
        from vllm_carryover.train.text_sources import documented_functions, python_files

        files = python_files()
        rnd.shuffle(files)
        for unit, path in files:
            for fn in documented_functions(unit, path, limit=1):
                doc = " ".join(fn.doc.split())
                if 40 <= len(doc) <= 400:
                    lang = rnd.choice(("Spanish", "French", "German"))
                    yield Prompt(f"translation-doc-{unit}-{fn.name}", f"code-{unit}",
                                 "translation", split_of(f"code-{unit}"),
                                 _user(f"Translate this documentation to {lang}: {doc}"))

    return _fill(counts, [bible(), bible(), software(), software(), chat_lines(),
                          docstrings()])


# ---- general ------------------------------------------------------------------------------

_PASSAGE_TASKS = ("Summarize the following passage in a few sentences.",
                  "What are the main points of this text?",
                  "Read the text below and list the people, places or things it mentions.",
                  "Write three questions a reader could answer from this text, with answers.",
                  "Explain this text to a ten-year-old.")
_README_TASKS = ("Summarize what this software package does, based on its description.",
                 "Based on this README, how do I install and start using the package?",
                 "What problems does this package solve? Answer from the description below.",
                 "Write a short announcement post for this package from its README.")
_WRITING_TASKS = ("Write a short story inspired by this line: {x}",
                  "Write a poem about this: {x}",
                  "Write an email to a friend about this: {x}",
                  "Give me five ideas for a blog post related to: {x}",
                  "Write a product description for a tool that does this: {x}",
                  "Argue for and against this statement: {x}")


def _passages(max_chars: int = 6000, min_chars: int = 3000) -> Iterator[tuple[str, str, str]]:
    """(unit, id, text) of Bible passages: runs of consecutive verses of one book."""
    from vllm_carryover.train.sword_bible import verse_pairs

    book, buf, start = "", [], 0
    for v in verse_pairs():
        if v.book != book or sum(len(x) + 1 for x in buf) + len(v.english) > max_chars:
            if book and sum(len(x) for x in buf) >= min_chars:
                yield f"translation-{book}", f"{book}-{start}", " ".join(buf)
            book, buf, start = v.book, [], v.index
        buf.append(v.english)


def general_prompts(counts: dict[str, int], rnd: random.Random) -> list[Prompt]:
    """Long-passage summaries and questions, writing tasks and logic puzzles."""
    from vllm_carryover.train.text_sources import package_readmes

    passages = list(_passages())
    rnd.shuffle(passages)
    readmes = package_readmes()
    rnd.shuffle(readmes)

    def on_passages() -> Iterator[Prompt]:
        for unit, pid, text in passages:
            split = "heldout" if unit.removeprefix("translation-") in EVAL_BOOKS else "train"
            yield Prompt(f"general-passage-{pid}", unit, "general", split,
                         _user(f"{rnd.choice(_PASSAGE_TASKS)}\n\n{text}"))

    def on_readmes() -> Iterator[Prompt]:
        for name, _, body in readmes:
            unit = f"package-{name}"
            yield Prompt(f"general-readme-{name}", unit, "general", split_of(unit),
                         _user(f"{rnd.choice(_README_TASKS)}\n\n{body[:6000]}"))

    def writing() -> Iterator[Prompt]:
        for unit, turns in _conversations(random.Random(rnd.random())):
            if 40 <= len(turns[0]) <= 200:
                yield Prompt(f"general-writing-{unit}", unit, "general", split_of(unit),
                             _user(rnd.choice(_WRITING_TASKS).format(x=turns[0])))
        for name, summary, _ in readmes:
            if 20 <= len(summary) <= 200:
                unit = f"package-{name}"
                yield Prompt(f"general-writing-{name}", unit, "general", split_of(unit),
                             _user(rnd.choice(_WRITING_TASKS).format(x=summary)))

    out: list[Prompt] = []
    for split, n in counts.items():
        n_gym = n // 3
        puzzles = _gym({split: n_gym}, rnd, _REASONING_GENERATORS, "general",
                       ("", " Think it through step by step."))
        rest = _fill({split: n - len(puzzles)}, [on_passages(), on_readmes(), writing(),
                                                 writing()])
        out += puzzles + rest
    return out


SOURCES: dict[str, Callable[[dict[str, int], random.Random], list[Prompt]]] = {
    "chat": chat_prompts, "code": code_prompts, "math": math_prompts,
    "translation": translation_prompts, "general": general_prompts}


def build_prompts(num_train: int, num_eval: int, seed: int,
                  categories: tuple[str, ...] = CATEGORIES) -> list[Prompt]:
    """Up to `num_train` + `num_eval` prompts per category (fewer where a source runs
    out), each split from its own units, duplicates removed, in seeded order."""
    out: list[Prompt] = []
    for cat in categories:
        out += SOURCES[cat]({"train": num_train, "heldout": num_eval},
                            random.Random(f"{seed}-{cat}"))
    random.Random(seed).shuffle(out)
    return dedupe(out)


def text_key(p: Prompt) -> str:
    """What makes two prompts the same: their messages, case and whitespace ignored."""
    return " ".join("\n".join(m["content"] for m in p.messages).lower().split())


def dedupe(prompts: list[Prompt]) -> list[Prompt]:
    """The first prompt of each distinct text."""
    seen: set[str] = set()
    out = []
    for p in prompts:
        key = text_key(p)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def prompt_token_ids(target: str, prompts: list[Prompt]) -> list[list[int]]:
    """Chat-templated prompt token ids (generation prompt added)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    out = []
    for p in prompts:
        ids = tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out
