"""`python -m benchmarks serving`: end-to-end throughput and latency of `vllm serve`.

Every row gets its own `vllm serve` on 127.0.0.1 (a free port), on a CPU with vLLM's
worker on every core unless a thread binding was chosen, and numba's own thread pool
for vLLM's n-gram (`serving_env`; `--row-env` sets variables for one row's server).
All servers are started first and stay up; then, for each prompt set and concurrency,
`vllm bench serve` drives them one at a time in turn (greedy, completions API), the
order reversed on every repeat, so slow drifts of a noisy machine hit all rows alike.

No server is ever timed on a prompt it has answered before: vLLM's suffix decoding
keeps a global tree of past answers (and a prefix cache keeps past prompts), so a
repeated prompt measures a cache, not a speculator. Each measurement (one repeat at
one concurrency) and each untimed warm-up run gets its own slice of the prompt set,
the slices in a fixed order and disjoint (`plan_slices`); every row gets the same
slices. The prompt sets (`--prompt-set`): `outside`, public benchmarks' prompts that
no one here wrote (`outside_prompts`: HumanEval, MT-Bench, IFBench; 538 prompts), and
`heldout`, the training corpora's held-out split (`eval_prompts`), both chat-templated.

Before the timed repeats at each concurrency every server gets `--warmup-runs`
untimed runs of one wave each (as many requests as the concurrency): a speculative
server's very first request often waited 0.5-1.8 s for its first token on a 2-core
CPU, against 0.05-0.13 s for the next ones. (After idling while other rows run, a
speculative server's first request is still slow now and then, 0.4-0.5 s; that cost
is measured, as a user would meet it.) Reported per prompt set, row and concurrency:
output tokens/s, mean TPOT and mean TTFT (averaged over repeats), their ratios to no
speculation measured in the same run, and tau from the server's own spec-decode
counters. The results record each row's server: its `vllm serve` command line and the
environment variables that steer vLLM, OpenMP, numba and arctic-inference. Every
server started is stopped on the way out, also when one fails to start.

The default rows are what a user could run instead (no speculation, vLLM's n-gram and
suffix decoding), the drafter alone (`drafter`: the slot-proposal drafter, whose slots
read the suffix trees' proposals) and the shipped configuration (`carryover-lookup`).
vLLM's in-tree DFlash (`--row dflash:PATH`) is not among them: on the 2-core CPU it
served 0.99x / 0.77x no speculation at concurrency 1 / 4 and about 2 tok/s at 16, where
a run of 32 requests did not end in 10 minutes (`benchmarks/results/serving/must-show/`).

Writes serving.json, serving.md, serving_throughput.png, the prompt slices and the
server logs to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_carryover.benchmarks.cli import SUFFIX_ROW, row_benchmark_parser
from vllm_carryover.benchmarks.eval_prompts import chat_texts, heldout_prompts
from vllm_carryover.benchmarks.outside_prompts import describe as describe_outside
from vllm_carryover.benchmarks.outside_prompts import outside_prompts
from vllm_carryover.benchmarks.report import (
    default_dtype,
    default_out_dir,
    fmt,
    header,
    markdown_table,
    pyplot,
    ratio,
    write_json,
)
from vllm_carryover.train.prompts import CATEGORIES

from vllm_carryover.tools.rows import Row, check_rows, parse_row
from vllm_carryover.tools.run_settings import (
    MAIN_DRAFTER,
    REPO,
    SHIPPED_DRAFTERS,
    model_runner_of,
    resolve_target,
    serve_max_model_len,
    serving_env,
)
from vllm_carryover.tools.server_process import VllmServer

SMOLLM2 = SHIPPED_DRAFTERS.relative_to(REPO)

# The shipped configuration, the suffix lookup beside the drafter, is the last row
# (`tools.rows`).
DEFAULT_ROWS = ["none", "ngram", SUFFIX_ROW,
                f"drafter=carryover:{SMOLLM2 / 'carryover'}",
                f"carryover-lookup:{SMOLLM2 / MAIN_DRAFTER}"]
PROMPT_SETS = ("outside", "heldout")
SIZES: dict[str, dict[str, Any]] = {
    "quick": {"requests": 5, "max_tokens": 32, "concurrency": [1, 4], "repeats": 1,
              "warmup_runs": 0, "prompt_sets": ["outside"]},
    "full": {"requests": None, "max_tokens": 64, "concurrency": [1, 4, 16, 32], "repeats": 3,
             "warmup_runs": 1, "prompt_sets": list(PROMPT_SETS)}}
WAVES = 2  # requests per timed run: this many times the concurrency ...
MIN_REQUESTS = 25  # ... and at least this many


def requests_per_run(concurrency: int, requests: int | None = None) -> int:
    """Requests in one timed `vllm bench serve` run: `requests` where given, else two
    waves at the concurrency, so that a run measures steady serving rather than one
    burst of simultaneous prefills, and at least `MIN_REQUESTS`: one prompt per category
    wrote 213 tokens in all at concurrency 1, and five prompts and 25 served 1.55x and
    1.73x no speculation on one machine (docs/results.md). Each is a prompt the server
    has not seen (`plan_slices`); with two waves, three repeats at concurrency 1, 4, 16
    and 32 and their warm-ups take 491 of the outside set's 538 prompts."""
    return requests or max(MIN_REQUESTS, WAVES * concurrency)


@dataclass(frozen=True)
class Slice:
    """The prompts of one `vllm bench serve` run: positions start..stop of a prompt set."""

    kind: str  # "warmup" (untimed) or "repeat" (timed)
    concurrency: int
    index: int  # which warm-up or repeat at this concurrency
    start: int
    stop: int

    @property
    def name(self) -> str:
        return f"c{self.concurrency}-{'warmup' if self.kind == 'warmup' else 'r'}{self.index}"

    @property
    def size(self) -> int:
        return self.stop - self.start


def plan_slices(concurrency: list[int], repeats: int, warmup_runs: int,
                requests: int | None = None) -> list[Slice]:
    """Every run of a prompt set in the order they run (per concurrency: the warm-ups,
    then the repeats), each on the next prompts of the set: no two runs share a prompt,
    so no server answers one twice, and every row runs the same slices. A timed run has
    `requests_per_run` prompts, a warm-up one wave (the concurrency, at most that)."""
    out: list[Slice] = []
    at = 0
    for c in concurrency:
        timed = requests_per_run(c, requests)
        for kind, count, size in (("warmup", warmup_runs, min(c, timed)),
                                  ("repeat", repeats, timed)):
            for i in range(count):
                out.append(Slice(kind, c, i, at, at + size))
                at += size
    return out


def prompts_needed(plan: list[Slice]) -> int:
    return plan[-1].stop if plan else 0


def interleave(groups: dict[str, list[Any]]) -> list[tuple[str, Any]]:
    """(group, item) pairs, the groups taking turns (a group that runs out drops out)."""
    out = []
    for i in range(max((len(v) for v in groups.values()), default=0)):
        out += [(g, items[i]) for g, items in groups.items() if i < len(items)]
    return out


def prompt_set(name: str, target: str, needed: int, categories: tuple[str, ...],
               num_per_category: int | None = None) -> tuple[list[str], list[str], dict]:
    """The first `needed` prompts of a prompt set, chat-templated as the text a
    completions request sends, with each prompt's category and what the results
    record about the set. `heldout`: the categories taking turns, `num_per_category`
    of each (default: as many as the runs need); `outside`: `outside_prompts`' order."""
    if name == "heldout":
        per_cat = num_per_category or math.ceil(needed / len(categories))
        pairs = interleave(chat_texts(target, heldout_prompts(per_cat, categories)))
        info: dict[str, Any] = {"source": "held-out split of train.prompts' corpora",
                                "categories": list(categories),
                                "prompts_per_category": per_cat}
    elif name == "outside":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(target)
        pairs = [(p.source, tok.apply_chat_template(p.messages, add_generation_prompt=True,
                                                    tokenize=False))
                 for p in outside_prompts()]
        info = {"source": "public benchmarks' prompts (benchmarks/outside_prompts.py)",
                "sources": describe_outside()}
    else:
        raise ValueError(f"unknown prompt set {name!r}: {', '.join(PROMPT_SETS)}")
    if len(pairs) < needed:
        raise SystemExit(
            f"prompt set {name}: {len(pairs)} prompts, but the runs need {needed} (each run "
            "its own prompts); lower --requests, --repeats, --warmup-runs or --concurrency"
            + (", or raise --num-prompts" if name == "heldout" else ""))
    info |= {"prompts_available": len(pairs), "prompts_used": needed}
    pairs = pairs[:needed]
    return [t for _, t in pairs], [c for c, _ in pairs], info


def write_slices(texts: list[str], plan: list[Slice], folder: Path) -> dict[str, Path]:
    """Each slice's prompts as `vllm bench serve`'s custom JSONL, by slice name."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for sl in plan:
        files[sl.name] = folder / f"{sl.name}.jsonl"
        files[sl.name].write_text("".join(json.dumps({"prompt": t}) + "\n"
                                          for t in texts[sl.start:sl.stop]))
    return files


METRICS = ("output_throughput", "mean_tpot_ms", "mean_ttft_ms")
KV_CACHE_BYTES = 512 << 20  # per server; up to eight rows share the machine's memory
# vLLM's own model-free methods: the faster of them at each concurrency is the bar.
PEERS = ("ngram", "suffix")
# The issues' throughput goals, checked where the rows exist: (row, baseline, concurrency,
# least ratio of output tok/s); a baseline of PEERS is the faster of those rows.
GOALS = [*(("carryover-lookup", base, c, goal)
           for base, c, goal in (("none", 1, 2.5), (PEERS, 1, 1.3), ("none", 4, 1.6),
                                 (PEERS, 4, 1.1), ("none", 16, 1.05), ("none", 32, 1.05))),
         # the drafter alone
         ("drafter", "none", 1, 2.0), ("drafter", "ngram", 1, 1.2)]
# Environment variables that steer a server's threads and kernels, recorded per row.
ENV_PREFIXES = ("VLLM_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "NUMBA_", "ARCTIC_",
                "TORCH", "PYTORCH_", "CUDA_VISIBLE_DEVICES", "LD_PRELOAD", "MALLOC_")
_SECRET = re.compile(r"TOKEN|KEY|SECRET|PASS", re.IGNORECASE)


def recorded_env(extra: dict[str, str], environ: dict[str, str] | None = None
                 ) -> dict[str, str]:
    """The variables of ENV_PREFIXES a server started with `extra` gets (this process's
    environment as `VllmServer` passes it on, then `extra`), none that looks secret."""
    environ = dict(os.environ if environ is None else environ)
    environ.pop("VLLM_CARRYOVER_METRICS_DIR", None)  # VllmServer drops it
    env = environ | extra
    return {k: env[k] for k in sorted(env)
            if k.startswith(ENV_PREFIXES) and not _SECRET.search(k)}


def server_command(server: VllmServer) -> str:
    """The server's exact command line, its own variables (`extra_env`) in front."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(server.extra_env.items()))
    return (env + " " if env else "") + shlex.join(server.cmd)


def omp_lines(log: Path, limit: int = 8) -> list[str]:
    """What vLLM's CPU worker logged about its OpenMP threads (their binding to cores)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [line.strip() for line in text.splitlines() if "OMP" in line][:limit]


def bench_args(server: VllmServer, target: str, prompts: Path, num_prompts: int,
               concurrency: int, max_tokens: int, result_file: Path) -> list[str]:
    """The `vllm bench serve` arguments of one run (greedy, the slice's prompt file, no
    ready-check request: that would send the slice's first prompt twice)."""
    return ["--backend", "vllm", "--base-url", server.url, "--model", target,
            "--tokenizer", target, "--dataset-name", "custom", "--dataset-path", str(prompts),
            "--skip-chat-template", "--disable-shuffle", "--custom-output-len", str(max_tokens),
            "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--temperature", "0", "--seed", "0", "--disable-tqdm",
            "--ready-check-timeout-sec", "0", "--num-warmups", "0",
            "--save-result", "--save-detailed", "--result-dir", str(result_file.parent),
            "--result-filename", result_file.name]


def vllm_bench_serve(args: list[str], log: Path) -> None:
    """`vllm bench serve ARGS`, run in this process (the CLI's own parser and entry point,
    without importing vLLM again for every run); its printout goes to `log`."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    parsed = parser.parse_args(args)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f, contextlib.redirect_stdout(f):
        print("$ vllm bench serve " + shlex.join(args), flush=True)
        try:
            main(parsed)
        except Exception as e:
            raise RuntimeError(f"vllm bench serve failed: {e!r}; see {log}") from e


def bench_once(server: VllmServer, target: str, prompts: Path, num_prompts: int,
               concurrency: int, max_tokens: int, result_file: Path,
               log: Path) -> dict[str, Any]:
    """One `vllm bench serve` run against `server`, with the spec-decode counters it moved."""
    before = server.metrics()
    vllm_bench_serve(bench_args(server, target, prompts, num_prompts, concurrency,
                                max_tokens, result_file), log)
    raw = json.loads(result_file.read_text())
    after = server.metrics()
    if raw["completed"] + raw.get("failed", 0) != num_prompts:
        raise RuntimeError(f"{result_file}: {raw['completed']} requests completed, "
                           f"{raw.get('failed', 0)} failed, of {num_prompts} sent")

    def moved(counter: str) -> int:
        return int(after.get(counter, 0.0) - before.get(counter, 0.0))

    drafts = moved("vllm:spec_decode_num_drafts_total")
    accepted = moved("vllm:spec_decode_num_accepted_tokens_total")
    return {**{m: raw[m] for m in METRICS}, "completed": raw["completed"],
            "failed": raw.get("failed", 0), "output_tokens": raw["total_output_tokens"],
            "duration_s": round(raw["duration"], 3), "drafts": drafts,
            "accepted": accepted,
            # steps whose drafts all came from lookups, so the drafter did not run
            "lookup_only_steps": moved("vllm:carryover_lookup_only_steps_total"),
            # ... of which some request had no lookup run but the drafter gate said off
            "gated_off_steps": moved("vllm:carryover_drafter_gated_off_steps_total"),
            "tau": round(1 + accepted / drafts, 4) if drafts else None,
            # per request, in the order sent: a burst's first tokens can be told apart
            "ttfts_ms": [round(t * 1000, 1) for t in raw["ttfts"]]}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean of each metric over the repeats; counters summed; tau of the sums."""
    out: dict[str, Any] = {m: round(sum(r[m] for r in runs) / len(runs), 3) for m in METRICS}
    for key in ("completed", "failed", "output_tokens", "drafts", "accepted",
                "lookup_only_steps", "gated_off_steps"):
        out[key] = sum(r[key] for r in runs)
    out["tau"] = round(1 + out["accepted"] / out["drafts"], 4) if out["drafts"] else None
    out["repeats"] = len(runs)
    return out


def add_ratios(table: dict[str, dict[str, dict[str, Any]]], baseline: str = "none") -> None:
    """Each metric as a ratio to the baseline row at the same concurrency, in place."""
    if baseline not in table:
        return
    for row in table.values():
        for c, cell in row.items():
            base = table[baseline][c]
            cell["vs_" + baseline] = {m: round(ratio(cell[m], base[m]) or 0, 4) for m in METRICS}


def check_goals(table: dict[str, dict[str, dict[str, Any]]],
                prompt_set_name: str | None = None) -> list[dict[str, Any]]:
    """The issues' throughput goals for carryover, met or not, where measurable."""
    out = []
    for row, base, c, goal in GOALS:
        key = str(c)
        peers = [b for b in ((base,) if isinstance(base, str) else base)
                 if key in table.get(b, {})]
        if row not in table or key not in table[row] or not peers:
            continue
        best = max(peers, key=lambda b: table[b][key]["output_throughput"] or 0)
        value = ratio(table[row][key]["output_throughput"], table[best][key]["output_throughput"])
        out.append({**({"prompt_set": prompt_set_name} if prompt_set_name else {}),
                    "row": row, "baseline": best, "concurrency": c, "goal": goal,
                    "ratio": round(value or 0, 4), "met": bool(value and value >= goal)})
    return out


def set_markdown(name: str, table: dict[str, dict[str, dict[str, Any]]],
                 args: dict[str, Any]) -> list[str]:
    """One prompt set's table of rows by concurrency."""
    names = list(table)
    base = "none" if "none" in table else None
    head = ["row", "concurrency", "output tok/s", "mean TPOT ms", "mean TTFT ms", "tau"]
    if base:
        head += [f"tok/s vs {base}", f"TPOT vs {base}", f"TTFT vs {base}"]
    # the lookup alone drafted some steps (carryover's suffix lookup)
    skips = any(cell.get("lookup_only_steps") for row in table.values()
                for cell in row.values())
    if skips:
        head += ["lookup-only steps (gated off) / drafts"]
    lines = []
    for c in args["concurrency"]:
        for row in names:
            cell = table[row][str(c)]
            line = [row, str(c), fmt(cell["output_throughput"], 1),
                    fmt(cell["mean_tpot_ms"], 1), fmt(cell["mean_ttft_ms"], 1),
                    fmt(cell["tau"])]
            if base:
                line += [fmt(cell["vs_" + base][m], 2) for m in METRICS]
            if skips:
                line.append(f"{cell['lookup_only_steps']} ({cell['gated_off_steps']}) / "
                            f"{cell['drafts']}" if cell["drafts"] else "-")
            lines.append(line)
    info = args["prompt_sets"][name]
    runs = ", ".join(f"{n} at c={c}" for c, n in args["requests_per_run"].items())
    return [f"### serving, {name} prompts: requests per run {runs}, each run on prompts no "
            f"server saw before ({info['prompts_used']} of the set), {args['max_tokens']} "
            f"max tokens, K={args['k']}, greedy, {args['dtype']}, mean of {args['repeats']} "
            "interleaved repeat(s)", "", markdown_table(head, lines)]


def summary_markdown(result: dict[str, Any]) -> str:
    args = result["args"]
    parts: list[str] = []
    for name, table in result["table"].items():
        parts += [*(["", ""] if parts else []), *set_markdown(name, table, args)]
    if runners := args.get("model_runners"):
        parts += ["", "model runner: " + ", ".join(f"{n} {r}" for n, r in runners.items())]
    if result["goals"]:
        parts += ["", "### goals for carryover (output tok/s ratios)", "", markdown_table(
            ["prompts", "ratio", "concurrency", "measured", "goal", "met"],
            [[g["prompt_set"], f"{g['row']}/{g['baseline']}", str(g["concurrency"]),
              fmt(g["ratio"], 2), f">= {g['goal']}", "yes" if g["met"] else "no"]
             for g in result["goals"]])]
    return "\n".join(parts) + "\n"


def plot(result: dict[str, Any], out: Path) -> Path:
    """Output tokens/s against concurrency, and the same as a ratio to no speculation,
    one line of panels per prompt set."""
    plt = pyplot()
    tables, conc = result["table"], result["args"]["concurrency"]
    panels = 2 if all("none" in t for t in tables.values()) else 1
    fig, axes = plt.subplots(len(tables), panels, figsize=(5.5 * panels, 4 * len(tables)),
                             squeeze=False)
    for line, (set_name, table) in enumerate(tables.items()):
        for name, row in table.items():
            axes[line][0].plot(conc, [row[str(c)]["output_throughput"] for c in conc],
                               marker="o", label=name)
            if panels == 2:
                axes[line][1].plot(conc, [row[str(c)]["vs_none"]["output_throughput"]
                                          for c in conc], marker="o", label=name)
        axes[line][0].set_ylabel("output tokens/s")
        axes[line][0].set_title(f"Serving throughput, {set_name} prompts")
        if panels == 2:
            axes[line][1].axhline(1.0, color="gray", linewidth=0.8)
            axes[line][1].set_ylabel("output tokens/s / no speculation")
            axes[line][1].set_title(f"Relative to no speculation, {set_name} prompts")
        for ax in axes[line]:
            ax.set_xscale("log", base=2)
            ax.set_xticks(conc, [str(c) for c in conc])
            ax.set_xlabel("concurrency (requests in flight)")
            ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "serving_throughput.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_serving(rows: list[Row], target: str, out: Path, *, max_tokens: int,
                concurrency: list[int], repeats: int, warmup_runs: int = 0,
                requests: int | None = None, prompt_sets: tuple[str, ...] = PROMPT_SETS,
                num_prompts: int | None = None, k: int = 7, dtype: str | None = None,
                categories: tuple[str, ...] = CATEGORIES,
                row_env: dict[str, dict[str, str]] | None = None,
                start_timeout: float = 600.0) -> dict[str, Any]:
    """Start every row's server, bench them interleaved on fresh prompt slices, stop
    them all, report. Every server gets `serving_env()` (vLLM's CPU worker on every
    core); `row_env` adds environment variables to the servers of the rows it names (a
    thread binding there replaces that default). `num_prompts`: held-out prompts per
    category (default: as many as the slices need)."""
    configs = check_rows(rows, k)
    row_env = row_env or {}
    if unknown := sorted(set(row_env) - {r.name for r in rows}):
        raise ValueError(f"--row-env names no row: {', '.join(unknown)} (rows: "
                         f"{', '.join(r.name for r in rows)})")
    server_env = {r.name: serving_env(row_env.get(r.name)) for r in rows}
    dtype = dtype or default_dtype()
    plan = plan_slices(concurrency, repeats, warmup_runs, requests)
    needed = prompts_needed(plan)
    out.mkdir(parents=True, exist_ok=True)
    slice_files: dict[str, dict[str, Path]] = {}
    set_info: dict[str, dict[str, Any]] = {}
    for name in prompt_sets:
        texts, labels, set_info[name] = prompt_set(name, target, needed, categories,
                                                   num_prompts)
        slice_files[name] = write_slices(texts, plan, out / "prompts" / name)
        # which categories each slice holds, so a reader can see its mix
        set_info[name]["slice_categories"] = {
            sl.name: sorted(set(labels[sl.start:sl.stop])) for sl in plan}
    max_model_len = serve_max_model_len(target)
    result: dict[str, Any] = {
        **header(),
        "args": {"target": target, "rows": {r.name: r.spec for r in rows},
                 "speculative_configs": configs, "prompt_sets": set_info,
                 "categories": list(categories),
                 "requests_per_run": {str(c): requests_per_run(c, requests)
                                      for c in concurrency},
                 "slices": [{"kind": sl.kind, "concurrency": sl.concurrency,
                             "index": sl.index, "prompts": [sl.start, sl.stop]}
                            for sl in plan],
                 "max_tokens": max_tokens, "concurrency": concurrency, "repeats": repeats,
                 "warmup_runs": warmup_runs,
                 "k": k, "dtype": dtype, "temperature": 0.0, "max_model_len": max_model_len,
                 "kv_cache_memory_bytes": KV_CACHE_BYTES,
                 # each row's server's environment, beyond this process's
                 "server_env": server_env,
                 # ... and as the server got it: its command line, the variables that
                 # steer threads and kernels, and what vLLM logged of its OpenMP threads
                 "servers": {}},
        "runs": []}
    bench_log = out / "logs" / "vllm-bench-serve.log"
    with contextlib.ExitStack() as stack:
        servers: dict[str, VllmServer] = {}
        for row in rows:
            print(f"[{row.name}] starting vllm serve ...", flush=True)
            started = time.monotonic()
            server = VllmServer(target, out / "logs" / f"{row.name}.log",
                                speculative_config=configs[row.name], dtype=dtype,
                                max_model_len=max_model_len, kv_cache_bytes=KV_CACHE_BYTES,
                                start_timeout=start_timeout,
                                env=server_env[row.name])
            # as `VllmServer` hands it on at start-up (vLLM sets some variables in this
            # process when it is imported)
            env = recorded_env(server_env[row.name])
            try:
                servers[row.name] = stack.enter_context(server)
            except Exception as e:
                raise RuntimeError(f"row {row.name}: vllm serve did not start, so no row "
                                   f"was measured (servers stopped): {e}") from None
            runner = model_runner_of(target, configs[row.name], dtype, max_model_len)
            result["args"].setdefault("model_runners", {})[row.name] = runner
            result["args"]["servers"][row.name] = {
                "command": server_command(server),
                "env": env,
                "omp_log": omp_lines(server.log_file)}
            print(f"[{row.name}] ready in {time.monotonic() - started:.0f} s at {server.url} "
                  f"({runner} model runner)", flush=True)
        for pset in prompt_sets:
            for sl in plan:
                c, files = sl.concurrency, slice_files[pset]
                if sl.kind == "warmup":
                    for row in rows:
                        run = bench_once(servers[row.name], target, files[sl.name], sl.size, c,
                                         max_tokens,
                                         out / "raw" / pset / f"{row.name}-{sl.name}.json",
                                         bench_log)
                        print(f"[{row.name}] {pset} c={c} warm-up {sl.index + 1}/{warmup_runs} "
                              f"(untimed): first TTFT {run['ttfts_ms'][0]:.0f} ms", flush=True)
                    continue
                order = rows if sl.index % 2 == 0 else rows[::-1]
                for row in order:
                    run = bench_once(servers[row.name], target, files[sl.name], sl.size, c,
                                     max_tokens,
                                     out / "raw" / pset / f"{row.name}-{sl.name}.json",
                                     bench_log)
                    result["runs"].append({"prompt_set": pset, "row": row.name,
                                           "concurrency": c, "repeat": sl.index,
                                           "prompts": [sl.start, sl.stop], **run})
                    tau = f", tau {run['tau']:.3f}" if run["tau"] else ""
                    print(f"[{row.name}] {pset} c={c} repeat {sl.index + 1}/{repeats}: "
                          f"{run['output_throughput']:.1f} tok/s, TPOT "
                          f"{run['mean_tpot_ms']:.1f} ms, TTFT {run['mean_ttft_ms']:.0f} ms"
                          f"{tau}", flush=True)
                    write_json(out / "serving.json", result)
    result["table"] = {}
    result["goals"] = []
    for pset in prompt_sets:
        table = {r.name: {str(c): aggregate([x for x in result["runs"]
                                             if x["prompt_set"] == pset
                                             and x["row"] == r.name and x["concurrency"] == c])
                          for c in concurrency} for r in rows}
        add_ratios(table)
        result["table"][pset] = table
        result["goals"] += check_goals(table, pset)
    result["summary"] = summary_markdown(result)
    result["plots"] = [plot(result, out).name]
    write_json(out / "serving.json", result)
    (out / "serving.md").write_text(result["summary"])
    return result


def _concurrency(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"bad --concurrency {text!r}: e.g. 1,4,16")
    return values


def _prompt_sets(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values or set(values) - set(PROMPT_SETS) or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(
            f"bad --prompt-set {text!r}: one or both of {', '.join(PROMPT_SETS)}, "
            "comma-separated")
    return values


def _row_env(text: str) -> tuple[str, str, str]:
    name, sep, assignment = text.partition(":")
    key, eq, value = assignment.partition("=")
    if not (sep and eq and name and key):
        raise argparse.ArgumentTypeError(
            f"bad --row-env {text!r}: NAME:KEY=VALUE, e.g. none:VLLM_CPU_OMP_THREADS_BIND=auto")
    return name, key, value


def _cmd_serving(a: argparse.Namespace) -> None:
    size = SIZES["quick" if a.quick else "full"]
    row_env: dict[str, dict[str, str]] = {}
    for name, key, value in a.row_env or []:
        row_env.setdefault(name, {})[key] = value
    target = resolve_target(a.target)
    out = Path(a.out) if a.out else default_out_dir("serving")
    result = run_serving(
        a.row or [parse_row(r) for r in DEFAULT_ROWS], target, out,
        max_tokens=a.max_tokens or size["max_tokens"],
        concurrency=a.concurrency or size["concurrency"],
        repeats=a.repeats or size["repeats"],
        warmup_runs=size["warmup_runs"] if a.warmup_runs is None else a.warmup_runs,
        requests=a.requests or size["requests"],
        prompt_sets=tuple(a.prompt_set or size["prompt_sets"]),
        num_prompts=a.num_prompts, k=a.k, dtype=a.dtype or default_dtype(),
        categories=tuple(a.categories or CATEGORIES), row_env=row_env)
    print("\n" + result["summary"])
    print(f"{out}/serving.json\n{out}/{result['plots'][0]}")


def add_cli(subparsers: Any) -> None:
    """The `serving` subcommand of `python -m benchmarks`."""
    p = row_benchmark_parser(
        subparsers, "serving", "vllm serve throughput, TPOT and TTFT at several "
        "concurrencies", __doc__, DEFAULT_ROWS, SIZES,
        num_prompts_help="held-out prompts per category (default: as many as the runs "
        "need, each run on prompts of its own)")
    p.add_argument("--prompt-set", type=_prompt_sets, metavar="SET,SET",
                   help=f"which prompts, each set measured in turn: {' or '.join(PROMPT_SETS)} "
                   "or both (default: by size; --categories applies to heldout)")
    p.add_argument("--concurrency", type=_concurrency, metavar="C,C,...",
                   help="requests in flight (default: by size)")
    p.add_argument("--repeats", type=int, metavar="N",
                   help="interleaved passes over the rows per concurrency, each on prompts "
                   "of its own (default: by size)")
    p.add_argument("--requests", type=int, metavar="N",
                   help="requests per timed run at every concurrency, each a prompt no "
                   f"server saw before (default: {WAVES} per request in flight, at least "
                   f"{MIN_REQUESTS})")
    p.add_argument("--warmup-runs", type=int, metavar="N",
                   help="untimed runs per server before the timed ones at each concurrency, "
                   "one wave each on prompts of their own (default: by size)")
    p.add_argument("--row-env", action="append", type=_row_env, metavar="NAME:KEY=VALUE",
                   help="an environment variable for row NAME's server only (repeatable), "
                   "e.g. to compare vLLM's CPU thread binding: "
                   "none-vllm:VLLM_CPU_OMP_THREADS_BIND=auto")
    p.set_defaults(fn=_cmd_serving)
