"""`python -m benchmarks serving`: end-to-end throughput and latency of `vllm serve`.

Every row gets its own `vllm serve` on 127.0.0.1 (a free port), on a CPU with vLLM's
worker on every core unless a thread binding was chosen, and numba's own thread pool
for vLLM's n-gram (`serving_env`; `--row-env` sets variables for one row's server).
All servers are started first and stay up; then, for each concurrency, `vllm bench
serve` drives them one at a time in turn on the same held-out prompts (greedy,
completions API), the order reversed on every repeat, so slow drifts of a noisy
machine hit all rows alike. Before the timed repeats at each concurrency every
server gets `--warmup-runs` untimed runs of the same requests: a speculative
server's very first request often waited 0.5-1.8 s for its first token on a 2-core
CPU, against 0.05-0.13 s for the next ones, and would weigh on the first repeat of a
5-request run. (After idling while other rows run, a speculative server's first
request is still slow now and then, 0.4-0.5 s; that cost is measured, as a user
would meet it.) Reported per row and concurrency: output tokens/s, mean TPOT and
mean TTFT (averaged over repeats), their ratios to no speculation measured in the
same run, and tau from the server's own spec-decode counters. Every server started
is stopped on the way out, also when one fails to start.

Writes serving.json, serving.md, serving_throughput.png and the server logs to
--out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import time
from pathlib import Path
from typing import Any

from vllm_carryover.benchmarks.cli import row_benchmark_parser
from vllm_carryover.benchmarks.eval_prompts import chat_texts, heldout_prompts
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

from vllm_carryover.rows import Row, check_rows, parse_row
from vllm_carryover.run_settings import (
    REPO,
    SHIPPED_DRAFTERS,
    SHIPPED_LOOKUPS,
    model_runner_of,
    resolve_target,
    serve_max_model_len,
    serving_env,
)
from vllm_carryover.server_process import VllmServer

SMOLLM2 = SHIPPED_DRAFTERS.relative_to(REPO)

# K per step by measured goodput (vllm_carryover/goodput_k.py), 0 included.
GOODPUT = {"method": "carryover", "model": str(SMOLLM2 / "carryover"),
           "num_speculative_tokens_per_batch_size": "goodput"}
# ... with the shipped lookups beside the drafter
LOOKUP = GOODPUT | SHIPPED_LOOKUPS
DEFAULT_ROWS = ["none", "ngram", f"dflash=dflash:{SMOLLM2 / 'dflash-baseline'}",
                f"carryover-off=carryover-off:{SMOLLM2 / 'carryover'}",
                f"carryover=carryover:{SMOLLM2 / 'carryover'}",
                f"carryover-goodput={json.dumps(GOODPUT)}",
                f"carryover-lookup={json.dumps(LOOKUP)}"]
SIZES: dict[str, dict[str, Any]] = {
    "quick": {"num_prompts": 2, "max_tokens": 32, "concurrency": [1, 4], "repeats": 1,
              "warmup_runs": 0},
    "full": {"num_prompts": 10, "max_tokens": 64, "concurrency": [1, 4, 16], "repeats": 2,
             "warmup_runs": 1}}
WAVES = 3  # requests per run: this many times the concurrency ...
MIN_PER_CATEGORY = 5  # ... and at least this many prompts of each category


def requests_per_run(concurrency: int, num_categories: int, total_prompts: int,
                     requests: int | None = None) -> int:
    """Requests in one `vllm bench serve` run: `requests` where given, else several
    waves at each concurrency, so that a run measures steady serving rather than one
    burst of simultaneous prefills, and at least `MIN_PER_CATEGORY` prompts of each
    category: one prompt per category wrote 213 tokens in all at concurrency 1, and five
    prompts and 25 served 1.55x and 1.73x no speculation on one machine (docs/results.md).
    Each request is a different prompt (a repeated one would hit the
    prefix cache), so never more than there are prompts."""
    return min(total_prompts, requests or max(MIN_PER_CATEGORY * num_categories,
                                              WAVES * concurrency))


METRICS = ("output_throughput", "mean_tpot_ms", "mean_ttft_ms")
KV_CACHE_BYTES = 512 << 20  # per server; the seven default rows share the machine's memory
# Goals of the issue, checked where the rows exist: (row, baseline, concurrency, min ratio).
GOALS = [(row, base, c, goal)
         for row in ("carryover", "carryover-goodput", "carryover-lookup")
         for base, c, goal in (("none", 1, 2.0), ("ngram", 1, 1.5), ("none", 4, 1.3),
                               ("none", 16, 1.0))]


def write_prompts(target: str, num_per_category: int, categories: tuple[str, ...],
                  path: Path) -> int:
    """The held-out prompts, chat-templated, as `vllm bench serve`'s custom JSONL, the
    categories taking turns (a run that uses the first N prompts gets all of them)."""
    texts = chat_texts(target, heldout_prompts(num_per_category, categories))
    lines = [json.dumps({"prompt": texts[c][i]}) for i in range(num_per_category)
             for c in categories]
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def bench_args(server: VllmServer, target: str, prompts: Path, num_prompts: int,
               concurrency: int, max_tokens: int, result_file: Path) -> list[str]:
    """The `vllm bench serve` arguments of one run (greedy, the custom prompt file)."""
    return ["--backend", "vllm", "--base-url", server.url, "--model", target,
            "--tokenizer", target, "--dataset-name", "custom", "--dataset-path", str(prompts),
            "--skip-chat-template", "--disable-shuffle", "--custom-output-len", str(max_tokens),
            "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--temperature", "0", "--seed", "0", "--disable-tqdm",
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
               concurrency: int, max_tokens: int, result_file: Path) -> dict[str, Any]:
    """One `vllm bench serve` run against `server`, with the spec-decode counters it moved."""
    before = server.metrics()
    vllm_bench_serve(bench_args(server, target, prompts, num_prompts, concurrency,
                                max_tokens, result_file),
                     result_file.parent.parent / "logs" / "vllm-bench-serve.log")
    raw = json.loads(result_file.read_text())
    after = server.metrics()

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


def check_goals(table: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The issue's throughput goals for carryover, met or not, where measurable."""
    out = []
    for row, base, c, goal in GOALS:
        key = str(c)
        if row in table and base in table and key in table[row]:
            value = ratio(table[row][key]["output_throughput"],
                          table[base][key]["output_throughput"])
            out.append({"row": row, "baseline": base, "concurrency": c, "goal": goal,
                        "ratio": round(value or 0, 4), "met": bool(value and value >= goal)})
    return out


def summary_markdown(result: dict[str, Any]) -> str:
    table, args = result["table"], result["args"]
    names = list(table)
    base = "none" if "none" in table else None
    head = ["row", "concurrency", "output tok/s", "mean TPOT ms", "mean TTFT ms", "tau"]
    if base:
        head += [f"tok/s vs {base}", f"TPOT vs {base}", f"TTFT vs {base}"]
    # lookups alone drafted some steps (carryover's prompt/corpus lookup)
    skips = any(cell.get("lookup_only_steps") for row in table.values()
                for cell in row.values())
    if skips:
        head += ["lookup-only steps (gated off) / drafts"]
    lines = []
    for c in args["concurrency"]:
        for name in names:
            cell = table[name][str(c)]
            line = [name, str(c), fmt(cell["output_throughput"], 1),
                    fmt(cell["mean_tpot_ms"], 1), fmt(cell["mean_ttft_ms"], 1),
                    fmt(cell["tau"])]
            if base:
                line += [fmt(cell["vs_" + base][m], 2) for m in METRICS]
            if skips:
                line.append(f"{cell['lookup_only_steps']} ({cell['gated_off_steps']}) / "
                            f"{cell['drafts']}" if cell["drafts"] else "-")
            lines.append(line)
    runs = ", ".join(f"{n} at c={c}" for c, n in args["requests_per_run"].items())
    parts = [f"### serving: requests per run {runs} (from {args['num_prompts']} held-out "
             f"prompts), {args['max_tokens']} max tokens, "
             f"K={args['k']}, greedy, {args['dtype']}, mean of {args['repeats']} "
             "interleaved repeat(s)", "", markdown_table(head, lines)]
    if runners := args.get("model_runners"):
        parts += ["", "model runner: " + ", ".join(f"{n} {r}" for n, r in runners.items())]
    if result["goals"]:
        parts += ["", "### goals for carryover (output tok/s ratios)", "", markdown_table(
            ["ratio", "concurrency", "measured", "goal", "met"],
            [[f"{g['row']}/{g['baseline']}", str(g["concurrency"]), fmt(g["ratio"], 2),
              f">= {g['goal']}", "yes" if g["met"] else "no"] for g in result["goals"]])]
    return "\n".join(parts) + "\n"


def plot(result: dict[str, Any], out: Path) -> Path:
    """Output tokens/s against concurrency, and the same as a ratio to no speculation."""
    plt = pyplot()
    table, conc = result["table"], result["args"]["concurrency"]
    panels = 2 if "none" in table else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    for name, row in table.items():
        axes[0][0].plot(conc, [row[str(c)]["output_throughput"] for c in conc],
                        marker="o", label=name)
        if panels == 2:
            axes[0][1].plot(conc, [row[str(c)]["vs_none"]["output_throughput"] for c in conc],
                            marker="o", label=name)
    axes[0][0].set_ylabel("output tokens/s")
    axes[0][0].set_title("Serving throughput")
    if panels == 2:
        axes[0][1].axhline(1.0, color="gray", linewidth=0.8)
        axes[0][1].set_ylabel("output tokens/s / no speculation")
        axes[0][1].set_title("Relative to no speculation")
    for ax in axes[0]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "serving_throughput.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_serving(rows: list[Row], target: str, out: Path, *, num_prompts: int,
                max_tokens: int, concurrency: list[int], repeats: int, warmup_runs: int = 0,
                requests: int | None = None, k: int = 7, dtype: str | None = None,
                categories: tuple[str, ...] = CATEGORIES,
                row_env: dict[str, dict[str, str]] | None = None,
                start_timeout: float = 600.0) -> dict[str, Any]:
    """Start every row's server, bench them interleaved, stop them all, report.
    Every server gets `serving_env()` (vLLM's CPU worker on every core); `row_env` adds
    environment variables to the servers of the rows it names (a thread binding there
    replaces that default)."""
    configs = check_rows(rows, k)
    row_env = row_env or {}
    if unknown := sorted(set(row_env) - {r.name for r in rows}):
        raise ValueError(f"--row-env names no row: {', '.join(unknown)} (rows: "
                         f"{', '.join(r.name for r in rows)})")
    server_env = {r.name: serving_env(row_env.get(r.name)) for r in rows}
    dtype = dtype or default_dtype()
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    total_prompts = write_prompts(target, num_prompts, categories, prompts)
    per_run = {c: requests_per_run(c, len(categories), total_prompts, requests)
               for c in concurrency}
    max_model_len = serve_max_model_len(target)
    result: dict[str, Any] = {
        **header(),
        "args": {"target": target, "rows": {r.name: r.spec for r in rows},
                 "speculative_configs": configs, "num_prompts": total_prompts,
                 "prompts_per_category": num_prompts, "categories": list(categories),
                 "requests_per_run": {str(c): n for c, n in per_run.items()},
                 "max_tokens": max_tokens, "concurrency": concurrency, "repeats": repeats,
                 "warmup_runs": warmup_runs,
                 "k": k, "dtype": dtype, "temperature": 0.0, "max_model_len": max_model_len,
                 "kv_cache_memory_bytes": KV_CACHE_BYTES,
                 # each row's server's environment, beyond this process's
                 "server_env": server_env},
        "runs": []}
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
            try:
                servers[row.name] = stack.enter_context(server)
            except Exception as e:
                raise RuntimeError(f"row {row.name}: vllm serve did not start, so no row "
                                   f"was measured (servers stopped): {e}") from None
            runner = model_runner_of(target, configs[row.name], dtype, max_model_len)
            result["args"].setdefault("model_runners", {})[row.name] = runner
            print(f"[{row.name}] ready in {time.monotonic() - started:.0f} s at {server.url} "
                  f"({runner} model runner)", flush=True)
        for c in concurrency:
            for rep in range(warmup_runs):
                for row in rows:
                    run = bench_once(servers[row.name], target, prompts, per_run[c], c,
                                     max_tokens,
                                     out / "raw" / f"{row.name}-c{c}-warmup{rep}.json")
                    print(f"[{row.name}] c={c} warm-up {rep + 1}/{warmup_runs} (untimed): "
                          f"first TTFT {run['ttfts_ms'][0]:.0f} ms", flush=True)
            for rep in range(repeats):
                order = rows if rep % 2 == 0 else rows[::-1]
                for row in order:
                    run = bench_once(servers[row.name], target, prompts, per_run[c], c,
                                     max_tokens,
                                     out / "raw" / f"{row.name}-c{c}-r{rep}.json")
                    result["runs"].append({"row": row.name, "concurrency": c, "repeat": rep,
                                           **run})
                    tau = f", tau {run['tau']:.3f}" if run["tau"] else ""
                    print(f"[{row.name}] c={c} repeat {rep + 1}/{repeats}: "
                          f"{run['output_throughput']:.1f} tok/s, TPOT "
                          f"{run['mean_tpot_ms']:.1f} ms, TTFT {run['mean_ttft_ms']:.0f} ms"
                          f"{tau}", flush=True)
                    write_json(out / "serving.json", result)
    table = {r.name: {str(c): aggregate([x for x in result["runs"]
                                         if x["row"] == r.name and x["concurrency"] == c])
                      for c in concurrency} for r in rows}
    add_ratios(table)
    result["table"] = table
    result["goals"] = check_goals(table)
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
        num_prompts=a.num_prompts or size["num_prompts"],
        max_tokens=a.max_tokens or size["max_tokens"],
        concurrency=a.concurrency or size["concurrency"],
        repeats=a.repeats or size["repeats"],
        warmup_runs=size["warmup_runs"] if a.warmup_runs is None else a.warmup_runs,
        requests=a.requests, k=a.k, dtype=a.dtype or default_dtype(),
        categories=tuple(a.categories or CATEGORIES), row_env=row_env)
    print("\n" + result["summary"])
    print(f"{out}/serving.json\n{out}/{result['plots'][0]}")


def add_cli(subparsers: Any) -> None:
    """The `serving` subcommand of `python -m benchmarks`."""
    p = row_benchmark_parser(
        subparsers, "serving", "vllm serve throughput, TPOT and TTFT at several "
        "concurrencies", __doc__, DEFAULT_ROWS, SIZES)
    p.add_argument("--concurrency", type=_concurrency, metavar="C,C,...",
                   help="requests in flight (default: by size)")
    p.add_argument("--repeats", type=int, metavar="N",
                   help="interleaved passes over the rows per concurrency (default: by size)")
    p.add_argument("--requests", type=int, metavar="N",
                   help="requests per run at every concurrency, each a different prompt "
                   f"(default: {WAVES} per request in flight, at least {MIN_PER_CATEGORY} per "
                   "category; at most the number of prompts)")
    p.add_argument("--warmup-runs", type=int, metavar="N",
                   help="untimed runs per server before the timed ones at each concurrency "
                   "(default: by size)")
    p.add_argument("--row-env", action="append", type=_row_env, metavar="NAME:KEY=VALUE",
                   help="an environment variable for row NAME's server only (repeatable), "
                   "e.g. to compare vLLM's CPU thread binding: "
                   "none-vllm:VLLM_CPU_OMP_THREADS_BIND=auto")
    p.set_defaults(fn=_cmd_serving)
