"""The rows of a comparison: a method to measure, named, as `NAME=SPEC`.

`train eval` and the benchmarks compare speculative methods side by side; a row
names one (no speculation, vLLM's n-gram, in-tree DFlash or carryover on a
drafter folder, or any speculative config) and becomes vLLM's speculative
config here, checked before any engine starts.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_carryover.drafter.source import is_hub_id
from vllm_carryover.tools.run_settings import REPO, SHIPPED_LOOKUPS

# The served configuration with the lookup beside the drafter: K by goodput and the
# lookup's keys, carryover as the drafter's default.
LOOKUP_KINDS = {"carryover-lookup": SHIPPED_LOOKUPS}
DRAFTER_KINDS = ("dflash", "carryover", "carryover-off", *LOOKUP_KINDS)
# vLLM's n-gram matcher over the request's text, 2 to 4 tokens (vLLM's default is 5)
NGRAM_LOOKUP = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}
_NAME = re.compile(r"[A-Za-z0-9_.+-]+")

ROW_GRAMMAR = """\
rows: --row NAME=SPEC (repeatable; the table shows them in this order). SPEC is
  none                 no speculation (target alone)
  ngram                vLLM's n-gram prompt lookup (min 2, max 4 tokens), K drafts
  dflash:PATH          vLLM's in-tree DFlash on a drafter folder
  carryover:PATH       method "carryover" on a drafter folder, "carryover": true
  carryover-off:PATH   the same with "carryover": false (the matched baseline; the
                       only baseline row for a drafter with a Markov head, which
                       in-tree dflash cannot serve)
  carryover-lookup:PATH
                       the shipped configuration on a drafter folder: K by goodput,
                       the suffix lookup (arctic-inference's trees of the request's
                       text and of past answers), else one drafter token
  {JSON}               any speculative_config; num_speculative_tokens defaults to -k
NAME= may be left out; the row is then named after SPEC's kind (none, ngram, ...).
Relative paths are taken from the current directory, else from the repository.
"""


def rows_help(default_rows: list[str]) -> str:
    """ROW_GRAMMAR and a tool's default rows, for its `--help`."""
    return ROW_GRAMMAR + "Default rows:\n  " + "\n  ".join(default_rows) + "\n"


@dataclass
class Row:
    """One table column: a name and the SPEC it was given as (see ROW_HELP)."""

    name: str
    spec: str


def parse_row(text: str) -> Row:
    """`NAME=SPEC` or a bare SPEC (named after its kind); syntax only, paths later."""
    name, sep, spec = text.partition("=")
    if not sep or "{" in name or ":" in name:
        name, spec = "", text
    spec = spec.strip()
    kind = spec.split(":", 1)[0]
    if not (spec in ("none", "ngram") or spec.startswith("{")
            or (kind in DRAFTER_KINDS and spec[len(kind) + 1:])):
        raise argparse.ArgumentTypeError(
            f"bad row {text!r}: SPEC must be none, ngram, "
            f"{', '.join(k + ':PATH' for k in DRAFTER_KINDS)} or a JSON speculative_config")
    if spec.startswith("{"):
        try:
            cfg = json.loads(spec)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"bad JSON in row {text!r}: {e}") from None
        if not isinstance(cfg, dict) or "method" not in cfg:
            raise argparse.ArgumentTypeError(f"row {text!r}: JSON needs a \"method\"")
        kind = str(cfg["method"])
    name = name or kind
    if not _NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(f"bad row name {name!r}: use letters, digits, ._+-")
    return Row(name, spec)


def parse_ratio(text: str) -> tuple[str, str]:
    num, sep, den = text.partition("/")
    if not sep or not num or not den:
        raise argparse.ArgumentTypeError(f"bad ratio {text!r}: expected NUM/DEN row names")
    return num, den


def resolve_path(path: str) -> Path | str:
    """A relative path from the current directory if it exists there, else the repo's;
    a Hugging Face hub id (`owner/name`, no such path) as it is."""
    if is_hub_id(path) and not (REPO / path).exists():
        return path
    here = Path(path).expanduser()
    if here.is_absolute() or here.exists() or not (REPO / here).exists():
        return here.resolve()
    return (REPO / here).resolve()


def speculative_config(spec: str, k: int) -> dict[str, Any] | None:
    """The vLLM `speculative_config` of a row SPEC (None: no speculation)."""
    if spec == "none":
        return None
    if spec == "ngram":
        return {**NGRAM_LOOKUP, "num_speculative_tokens": k}
    if spec.startswith("{"):
        cfg = dict(json.loads(spec))
        cfg.setdefault("num_speculative_tokens", k)
        if isinstance(cfg.get("model"), str) and cfg["method"] != "ngram":
            cfg["model"] = str(resolve_path(cfg["model"]))
        return cfg
    kind, _, path = spec.partition(":")
    cfg = {"method": "dflash" if kind == "dflash" else "carryover",
           "model": str(resolve_path(path)), "num_speculative_tokens": k}
    if kind in LOOKUP_KINDS:
        return cfg | {"num_speculative_tokens_per_batch_size": "goodput", **LOOKUP_KINDS[kind]}
    if kind != "dflash":
        cfg["carryover"] = kind == "carryover"
    return cfg


def check_rows(rows: list[Row], k: int) -> dict[str, dict[str, Any] | None]:
    """Every row's speculative config; fails before any engine starts on a missing
    drafter folder or a duplicate name, so a long run does not die half-way."""
    names = [r.name for r in rows]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SystemExit(f"duplicate row names {dupes}: give each row its own NAME=")
    configs = {r.name: speculative_config(r.spec, k) for r in rows}
    for name, cfg in configs.items():
        model = (cfg or {}).get("model")
        if cfg and cfg["method"] != "ngram" and isinstance(model, str) \
                and not is_hub_id(model) and not (Path(model) / "config.json").is_file():
            raise SystemExit(f"row {name}: no drafter folder at {model} (config.json "
                             "missing); train and export it, or pass --row")
    return configs

