"""Acceptance length per prompt category, measured through vLLM.

Every row (a speculative method on a drafter folder, or none) runs in its own
fresh process (`python -m train.vllm_eval JOB.json EVENTS.jsonl`), because vLLM
wants one engine per process and two engines on a small CPU only thrash. That
process builds one `LLM` and generates the held-out prompts of each category in
turn, reading vLLM's cumulative spec-decode counters before and after each one:
the difference is that category's drafts and accepted tokens, and
tau = 1 + accepted / drafts (tokens committed per verify step, bonus included).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from train.data import MANIFEST_FILE, load_samples
from train.paths import CHECKPOINTS, DEFAULT_DATA, REPO, cache_root, data_dir
from train.prompts import serve_max_model_len
from vllm_carryover.server_process import die_with_parent

SMOLLM2 = CHECKPOINTS.relative_to(REPO) / "smollm2-135m-instruct"
DEFAULT_ROWS = [f"baseline=dflash:{SMOLLM2 / 'dflash-baseline'}",
                f"carryover=carryover:{SMOLLM2 / 'carryover'}",
                f"carryover-off=carryover-off:{SMOLLM2 / 'carryover'}",
                f"dspark-baseline=carryover-off:{SMOLLM2 / 'dspark-baseline'}",
                f"dspark-carryover=carryover:{SMOLLM2 / 'dspark-carryover'}"]
# Ratio columns shown whenever both rows exist (and no --ratio is given).
DEFAULT_RATIOS = [("carryover", "baseline"), ("carryover", "carryover-off"),
                  ("dspark-carryover", "dspark-baseline"), ("dspark-baseline", "baseline")]
DRAFTER_KINDS = ("dflash", "carryover", "carryover-off")
NGRAM_LOOKUP = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
KV_CACHE_BYTES = 1 << 30
WARMUP_TOKENS = 8
COUNTERS = ("drafts", "draft_tokens", "accepted")
_NAME = re.compile(r"[A-Za-z0-9_.+-]+")

ROW_HELP = """\
rows: --row NAME=SPEC (repeatable; the table shows them in this order). SPEC is
  none                 no speculation (target alone)
  ngram                vLLM's n-gram prompt lookup (min 2, max 4 tokens), K drafts
  dflash:PATH          vLLM's in-tree DFlash on a drafter folder
  carryover:PATH       method "carryover" on a drafter folder, carryover on
  carryover-off:PATH   the same with "carryover": false (the matched baseline; the
                       only baseline row for a drafter with a Markov head, which
                       in-tree dflash cannot serve)
  {JSON}               any speculative_config; num_speculative_tokens defaults to -k
NAME= may be left out; the row is then named after SPEC's kind (none, ngram, ...).
Relative paths are taken from the current directory, else from the repository.
Default rows:
  """ + "\n  ".join(DEFAULT_ROWS) + """

ratio columns: --ratio NUM/DEN (repeatable) adds tau[NUM] / tau[DEN]; default:
  carryover/baseline, carryover/carryover-off, dspark-carryover/dspark-baseline and
  dspark-baseline/baseline, where both rows exist.
The "average" row is the unweighted mean over categories; the JSON also holds each
row's pooled totals and vLLM's raw counters.

example:
  python -m train eval -k 7 --num-prompts 16 \\
      --row baseline=dflash:train/checkpoints/smollm2-135m-instruct/dflash-baseline \\
      --row carryover=carryover:train/checkpoints/smollm2-135m-instruct/carryover \\
      --row carryover-off=carryover-off:train/checkpoints/smollm2-135m-instruct/carryover
"""


@dataclass
class Row:
    """One table column: a name and the SPEC it was given as (see ROW_HELP)."""

    name: str
    spec: str


@dataclass
class EvalSettings:
    """Everything that is the same for all rows of one evaluation."""

    target: str
    data: Path | None  # None: the caller hands run_eval its prompts
    categories: list[str] | None = None
    num_prompts: int = 16
    max_tokens: int = 128
    k: int = 7
    dtype: str = "bfloat16"
    ratios: list[tuple[str, str]] | None = None
    timeout_s: float | None = None


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
            f"bad row {text!r}: SPEC must be none, ngram, dflash:PATH, carryover:PATH, "
            "carryover-off:PATH or a JSON speculative_config")
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


def resolve_path(path: str) -> Path:
    """A relative path from the current directory if it exists there, else the repo's."""
    here = Path(path).expanduser()
    if here.is_absolute() or here.exists() or not (REPO / here).exists():
        return here.resolve()
    return (REPO / here).resolve()


def speculative_config(spec: str, k: int) -> dict[str, Any] | None:
    """The vLLM `speculative_config` of a row SPEC (None: no speculation)."""
    if spec == "none":
        return None
    if spec == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, **NGRAM_LOOKUP}
    if spec.startswith("{"):
        cfg = dict(json.loads(spec))
        cfg.setdefault("num_speculative_tokens", k)
        if isinstance(cfg.get("model"), str) and cfg["method"] != "ngram":
            cfg["model"] = str(resolve_path(cfg["model"]))
        return cfg
    kind, _, path = spec.partition(":")
    cfg = {"method": "dflash" if kind == "dflash" else "carryover",
           "model": str(resolve_path(path)), "num_speculative_tokens": k}
    if kind == "carryover-off":
        cfg["carryover"] = False
    return cfg


def resolve_data(data: str | Path) -> Path:
    """A dataset folder, or the name of one in the training cache."""
    path = Path(data).expanduser()
    return path.resolve() if (path / MANIFEST_FILE).is_file() else data_dir(str(data))


def heldout_prompts(data: Path, categories: list[str] | None, num_prompts: int,
                    target: str) -> dict[str, list[list[int]]]:
    """The first `num_prompts` held-out prompts of each category (default: all present).

    Without a dataset at `data`, the held-out prompts are built straight from the
    corpora (`train.prompts`, the same split rule), as the benchmarks do."""
    if not (data / MANIFEST_FILE).is_file():
        from train.data import prompt_token_ids
        from train.prompts import CATEGORIES, build_prompts

        print(f"no dataset at {data} (`python -m train data --name {data.name}` builds "
              "one); using held-out prompts built from the corpora", flush=True)
        wanted = tuple(categories or CATEGORIES)
        built = build_prompts(0, num_prompts, 0, wanted)
        return {c: prompt_token_ids(target, [p for p in built if p.category == c])
                for c in wanted}
    rows = load_samples(data, "heldout")
    present = sorted({r["category"] for r in rows})
    wanted_list = categories or present
    missing = [c for c in wanted_list if c not in present]
    if missing or not wanted_list:
        raise SystemExit(f"no held-out prompts for categories {missing or wanted_list} in "
                         f"{data}; present: {', '.join(present) or 'none'}")
    return {c: [r["prompt_ids"] for r in rows if r["category"] == c][:num_prompts]
            for c in wanted_list}


def file_sha256(path: Path) -> str:
    """Recorded per drafter: checkpoint folders get retrained and exported in place."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


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
                and not (Path(model) / "config.json").is_file():
            raise SystemExit(f"row {name}: no drafter folder at {model} (config.json "
                             "missing); train and export it, or pass --row")
    return configs


def _counter_totals(raw: dict[str, Any]) -> dict[str, Any]:
    """vLLM's spec-decode counters under short names (zeros without speculation)."""
    return {"drafts": int(raw.get("spec_decode_num_drafts", 0) or 0),
            "draft_tokens": int(raw.get("spec_decode_num_draft_tokens", 0) or 0),
            "accepted": int(raw.get("spec_decode_num_accepted_tokens", 0) or 0),
            "accepted_per_pos": [int(v) for v in raw.get("accepted_per_pos", [])]}


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What one `generate` call added to vLLM's cumulative counters, with its tau."""
    a, b = _counter_totals(after), _counter_totals(before)
    out: dict[str, Any] = {c: a[c] - b[c] for c in COUNTERS}
    b_pos = b["accepted_per_pos"]
    out["accepted_per_pos"] = [x - (b_pos[i] if i < len(b_pos) else 0)
                               for i, x in enumerate(a["accepted_per_pos"])]
    out["tau"] = round(1 + out["accepted"] / out["drafts"], 4) if out["drafts"] else None
    return out


def _has_tokenizer(target: str) -> bool:
    """False for a local folder without tokenizer files (the tests' tiny target), which
    vLLM can only load with `skip_tokenizer_init`; with a tokenizer, EOS ends answers."""
    path = Path(target)
    return not path.is_dir() or any((path / f).is_file() for f in (
        "tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _child(job_file: Path, events_file: Path) -> None:
    """Inside the row's process: one engine, every category in turn, one event per line.

    The process leads its own process group (see run_row); on SIGTERM (also sent
    when the evaluating process dies) it takes the engine's processes down with it.
    """
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    from vllm import LLM, SamplingParams

    from vllm_carryover.metrics import spec_decode_counters

    job = json.loads(job_file.read_text())

    def emit(event: dict[str, Any]) -> None:
        with events_file.open("a") as f:
            f.write(json.dumps(event) + "\n")

    engine: dict[str, Any] = {"dtype": job["dtype"], "enforce_eager": True,
                              "max_model_len": serve_max_model_len(job["target"]),
                              "kv_cache_memory_bytes": KV_CACHE_BYTES,
                              "disable_log_stats": False, "seed": 0,
                              "skip_tokenizer_init": not _has_tokenizer(job["target"])}
    if job["speculative_config"]:
        engine["speculative_config"] = job["speculative_config"]
    start = time.perf_counter()
    llm = LLM(model=job["target"], **engine)
    emit({"event": "ready", "startup_seconds": round(time.perf_counter() - start, 2)})

    def generate(prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)
        before = spec_decode_counters(llm)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        seconds = time.perf_counter() - start
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"prompts": len(prompts), "output_tokens": n_out,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(n_out / seconds, 2) if seconds > 0 else None,
                **counter_delta(before, spec_decode_counters(llm))}

    first = next(iter(job["prompts"].values()))[:1]
    emit({"event": "warmup", **generate(first, WARMUP_TOKENS)})
    for category, prompts in job["prompts"].items():
        emit({"event": "category", "category": category,
              **generate(prompts, job["max_tokens"])})
    emit({"event": "done", "engine_counters": spec_decode_counters(llm)})


def _progress_line(name: str, event: dict[str, Any]) -> str:
    if event["event"] == "ready":
        return f"[{name}] engine ready in {event['startup_seconds']:.1f} s"
    what = event.get("category", "warmup")
    spec = (f"tau {event['tau']:.3f} ({event['drafts']} drafts, {event['accepted']} "
            "accepted), " if event["drafts"] else "")
    return (f"[{name}] {what}: {spec}{event['output_tokens']} tokens in "
            f"{event['seconds']:.1f} s = {event['tokens_per_s'] or 0:.1f} tok/s")


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the row's process and whatever engine processes it left behind."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_row(name: str, config: dict[str, Any] | None, prompts: dict[str, list[list[int]]],
            s: EvalSettings) -> dict[str, Any]:
    """Run one row in a fresh process, printing a line per category as it finishes."""
    job = {"target": s.target, "speculative_config": config, "prompts": prompts,
           "max_tokens": s.max_tokens, "dtype": s.dtype}
    with tempfile.TemporaryDirectory(prefix="vllm-eval-") as tmp:
        job_file, events_file, log_file = (Path(tmp) / f for f in
                                           ("job.json", "events.jsonl", "engine.log"))
        job_file.write_text(json.dumps(job))
        events_file.touch()
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        started = time.monotonic()
        events: list[dict[str, Any]] = []
        with log_file.open("w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "train.vllm_eval", str(job_file),
                                     str(events_file)], stdout=log, stderr=subprocess.STDOUT,
                                    env=env, cwd=REPO, start_new_session=True,
                                    preexec_fn=die_with_parent)
            try:
                while True:
                    code = proc.poll()
                    text = events_file.read_text()
                    lines = text[:text.rfind("\n") + 1].splitlines()  # whole lines only
                    for line in lines[len(events):]:
                        events.append(json.loads(line))
                        if events[-1]["event"] != "done":
                            print(_progress_line(name, events[-1]), flush=True)
                    if code is not None:
                        break
                    if s.timeout_s and time.monotonic() - started > s.timeout_s:
                        raise TimeoutError(f"row {name} took over {s.timeout_s:.0f} s")
                    time.sleep(1.0)
            finally:
                _kill_group(proc)
        if code != 0 or not events or events[-1]["event"] != "done":
            tail = "\n".join(log_file.read_text().splitlines()[-40:])
            raise RuntimeError(f"row {name} failed (exit code {code}); log tail:\n{tail}")
    by_kind = {e["event"]: e for e in events}
    categories = {e["category"]: {k: v for k, v in e.items() if k not in ("event", "category")}
                  for e in events if e["event"] == "category"}
    warmup = {k: v for k, v in by_kind["warmup"].items() if k != "event"}
    return {"startup_seconds": by_kind["ready"]["startup_seconds"],
            "categories": categories, "warmup": warmup,
            "total": pooled(categories.values()),
            "engine_counters": _counter_totals(by_kind["done"]["engine_counters"])}


def pooled(parts: Any) -> dict[str, Any]:
    """All categories together: summed counters and tokens, tau of the sums."""
    parts = list(parts)
    out: dict[str, Any] = {c: sum(p[c] for p in parts) for c in
                           ("prompts", "output_tokens", *COUNTERS)}
    out["seconds"] = round(sum(p["seconds"] for p in parts), 3)
    out["tokens_per_s"] = round(out["output_tokens"] / out["seconds"], 2) \
        if out["seconds"] > 0 else None
    width = max((len(p["accepted_per_pos"]) for p in parts), default=0)
    out["accepted_per_pos"] = [sum(p["accepted_per_pos"][i] for p in parts
                                   if i < len(p["accepted_per_pos"])) for i in range(width)]
    out["tau"] = round(1 + out["accepted"] / out["drafts"], 4) if out["drafts"] else None
    return out


def mean_tau(row: dict[str, Any]) -> float | None:
    """The table's "average": unweighted mean of the categories' tau."""
    taus = [c["tau"] for c in row["categories"].values() if c["tau"] is not None]
    return sum(taus) / len(taus) if taus else None


def active_ratios(names: list[str],
                  ratios: list[tuple[str, str]] | None) -> list[tuple[str, str]]:
    """The ratio columns: the given ones (checked), or the defaults whose rows exist."""
    if ratios is None:
        return [(a, b) for a, b in DEFAULT_RATIOS if a in names and b in names]
    unknown = sorted({n for pair in ratios for n in pair if n not in names})
    if unknown:
        raise SystemExit(f"--ratio names unknown rows {unknown}; rows: {', '.join(names)}")
    return ratios


def markdown_table(result: dict[str, Any], metric: str = "tau") -> str:
    """Categories + "average" down, rows across, then the ratio columns."""
    rows, ratios = result["rows"], [tuple(r) for r in result["args"]["ratios"]]

    def cell(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    header = ["category", *rows, *(f"{a}/{b}" for a, b in ratios)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for category in result["categories"]:
        values = {n: r["categories"][category][metric] for n, r in rows.items()}
        lines.append("| " + " | ".join([category, *(cell(v) for v in values.values()),
                                        *(cell(ratio(values[a], values[b]))
                                          for a, b in ratios)]) + " |")
    if metric == "tau":
        avg = {n: mean_tau(r) for n, r in rows.items()}
    else:
        avg = {n: sum(r["categories"][c][metric] or 0 for c in result["categories"])
               / len(result["categories"]) for n, r in rows.items()}
    lines.append("| " + " | ".join(["average", *(cell(v) for v in avg.values()),
                                    *(cell(ratio(avg[a], avg[b])) for a, b in ratios)])
                 + " |")
    return "\n".join(lines)


def command_line() -> str:
    """How this process was started, as a user would type it (for result files)."""
    argv = sys.argv
    if Path(argv[0]).name == "__main__.py":
        return shlex.join(["python", "-m", Path(argv[0]).parent.name, *argv[1:]])
    return shlex.join(["python", *argv])


def run_eval(rows: list[Row], s: EvalSettings, out: Path,
             prompts: dict[str, list[list[int]]] | None = None) -> dict[str, Any]:
    """Evaluate every row (one process each, one after another) on `prompts` (default:
    the held-out split of `s.data`); write `out` after each row, so a failure keeps the
    rows already measured."""
    configs = check_rows(rows, s.k)
    ratios = active_ratios([r.name for r in rows], s.ratios)
    if prompts is None:
        assert s.data is not None, "run_eval needs a dataset or prompts"
        prompts = heldout_prompts(s.data, s.categories, s.num_prompts, s.target)
    manifest = s.data / MANIFEST_FILE if s.data is not None else None
    result: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "args": {"target": s.target, "data": str(s.data) if s.data is not None else None,
                 "data_sha256": json.loads(manifest.read_text()).get("sha256")
                 if manifest is not None and manifest.is_file() else None,
                 "rows": {r.name: r.spec for r in rows}, "num_prompts": s.num_prompts,
                 "max_tokens": s.max_tokens, "k": s.k, "dtype": s.dtype,
                 "temperature": 0.0, "max_model_len": serve_max_model_len(s.target),
                 "kv_cache_memory_bytes": KV_CACHE_BYTES, "warmup_tokens": WARMUP_TOKENS,
                 "ratios": [list(r) for r in ratios]},
        "categories": list(prompts),
        "prompts": {c: len(p) for c, p in prompts.items()},
        "rows": {},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    for row in rows:
        config = configs[row.name]
        model = Path((config or {}).get("model", "")) / "model.safetensors"
        res = {"spec": row.spec, "speculative_config": config,
               "drafter_sha256": file_sha256(model) if model.is_file() else None,
               **run_row(row.name, config, prompts, s)}
        result["rows"][row.name] = res
        total = res["total"]
        tau = f"tau {total['tau']:.3f}" if total["tau"] is not None else "no drafts"
        print(f"[{row.name}] done: pooled {tau}, {total['tokens_per_s'] or 0:.1f} tok/s",
              flush=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    result["table"] = markdown_table(result)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _cmd_eval(a: argparse.Namespace) -> None:
    if a.target:
        target = str(Path(a.target).resolve()) if Path(a.target).exists() else a.target
    else:
        from vllm_carryover.testbed import smollm2_path

        target = str(smollm2_path())
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(a.out) if a.out else cache_root() / "eval" / f"{stamp}.json"
    from vllm_carryover.dtype import resolve_dtype

    a.dtype = resolve_dtype(a.dtype)
    settings = EvalSettings(target=target, data=resolve_data(a.data),
                            categories=a.categories, num_prompts=a.num_prompts,
                            max_tokens=a.max_tokens, k=a.k, dtype=a.dtype, ratios=a.ratio)
    rows = a.row or [parse_row(r) for r in DEFAULT_ROWS]
    result = run_eval(rows, settings, out)
    print(f"\ntau per category ({result['args']['k']} drafts/step, greedy, "
          f"{a.max_tokens} tokens, {a.dtype}):\n")
    print(result["table"])
    print(f"\n{out}")


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `eval` subcommand to `python -m train`'s subparsers."""
    p = subparsers.add_parser(
        "eval", help="acceptance length (tau) per prompt category through vLLM",
        description="Acceptance length tau = 1 + accepted / drafts per prompt category of\n"
        "the held-out split, from vLLM's spec-decode counters; greedy decoding. Each row\n"
        "runs in its own process (one engine, categories one after another). Writes a\n"
        "JSON file and prints a markdown table.",
        epilog=ROW_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row", action="append", type=parse_row, metavar="NAME=SPEC",
                   help="a method to measure (repeatable, see below; default: baseline, "
                   "carryover, carryover-off on the shipped SmolLM2 drafters)")
    p.add_argument("--ratio", action="append", type=parse_ratio, metavar="NUM/DEN",
                   help="a tau ratio column (repeatable; default: see below)")
    p.add_argument("--target", metavar="PATH",
                   help="target folder (default: the testbed SmolLM2 folder)")
    p.add_argument("--data", default=DEFAULT_DATA,
                   help="dataset name in the cache, or a dataset folder")
    p.add_argument("--categories", nargs="+", metavar="CAT",
                   help="categories in table order (default: all in the held-out split, "
                   "sorted)")
    p.add_argument("--num-prompts", type=int, default=16, metavar="N",
                   help="held-out prompts per category (the first ones)")
    p.add_argument("--max-tokens", type=int, default=128, metavar="N", help="new tokens per prompt")
    p.add_argument("-k", type=int, default=7, help="drafted tokens per step")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto: bfloat16 on a GPU or a CPU with native bf16 matmuls, else "
                   "float32 (default: %(default)s)")
    p.add_argument("--out", metavar="PATH", help="JSON result file (default: "
                   "$VLLM_CARRYOVER_CACHE/train/eval/DATE.json)")
    p.set_defaults(fn=_cmd_eval)
    return p


if __name__ == "__main__":
    _child(Path(sys.argv[1]), Path(sys.argv[2]))
