"""`python -m benchmarks acceptance|serving` at a very small size on SmolLM2.

The results must be well formed (the schema the README's tables and plots are
made from), and `serving` must leave no server behind, also when a row's server
fails to start after another row's server came up.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import psutil
import pytest
from vllm_carryover.benchmarks.main import main as benchmarks_main

from vllm_carryover.run_settings import (
    CPU_BINDING_VARS,
    NUMBA_LAYER_VAR,
    SHIPPED_DRAFTERS,
    serving_env,
)

CARRYOVER = f"carryover=carryover:{SHIPPED_DRAFTERS / 'carryover'}"
K = 7
MAX_TOKENS = 16
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
    benchmarks_main(["serving", "--quick", "--row", "none", "--row", CARRYOVER,
                     "--num-prompts", "1", "--max-tokens", str(MAX_TOKENS),
                     "--concurrency", "1,4", "--repeats", "2", "--warmup-runs", "1",
                     "--row-env", "none:VLLM_CPU_OMP_THREADS_BIND=auto",
                     "-k", str(K), "--out", str(tmp_path)])
    result = json.loads((tmp_path / "serving.json").read_text())

    assert not vllm_serve_pids(server_tag)
    # vLLM's own binding for the row that asked for it, every core for the other one
    numba_pool = {NUMBA_LAYER_VAR: "workqueue"}
    assert result["args"]["server_env"] == {
        "none": numba_pool | {"VLLM_CPU_OMP_THREADS_BIND": "auto"},
        "carryover": numba_pool | {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}}
    assert "reserve_cpu_num=0" not in (tmp_path / "logs/none.log").read_text()
    assert "reserve_cpu_num=0" in (tmp_path / "logs/carryover.log").read_text()
    assert {"date", "command", "machine", "args", "runs", "table", "goals", "summary",
            "plots"} <= set(result)
    assert result["args"]["num_prompts"] == len(CATEGORIES)
    assert result["args"]["model_runners"] == {"none": "V1", "carryover": "V1"}
    assert "model runner: none V1, carryover V1" in result["summary"]
    # every row at every concurrency, each repeat, the second repeat in reverse order;
    # the untimed warm-up runs before them are not among the runs
    assert result["args"]["warmup_runs"] == 1
    assert sorted(p.name for p in (tmp_path / "raw").glob("*warmup*")) == [
        f"{row}-c{c}-warmup0.json" for row in ("carryover", "none") for c in (1, 4)]
    order = [(r["concurrency"], r["repeat"], r["row"]) for r in result["runs"]]
    assert order == [(1, 0, "none"), (1, 0, "carryover"), (1, 1, "carryover"),
                     (1, 1, "none"), (4, 0, "none"), (4, 0, "carryover"),
                     (4, 1, "carryover"), (4, 1, "none")]
    for run in result["runs"]:
        assert run["completed"] == len(CATEGORIES) and run["failed"] == 0
        assert run["output_throughput"] > 0 and run["mean_ttft_ms"] > 0
        assert len(run["ttfts_ms"]) == run["completed"]
        assert sum(run["ttfts_ms"]) / len(run["ttfts_ms"]) == pytest.approx(
            run["mean_ttft_ms"], abs=0.1)
        assert (run["drafts"] > 0) == (run["row"] == "carryover")
        assert 0 <= run["gated_off_steps"] <= run["lookup_only_steps"] <= run["drafts"]
    for c in ("1", "4"):
        assert result["table"]["none"][c]["vs_none"]["output_throughput"] == 1.0
        cell = result["table"]["carryover"][c]
        assert cell["repeats"] == 2 and cell["tau"] >= 1
        assert cell["vs_none"]["output_throughput"] == pytest.approx(
            cell["output_throughput"] / result["table"]["none"][c]["output_throughput"],
            rel=1e-3)
    assert [(g["row"], g["baseline"], g["concurrency"]) for g in result["goals"]] == \
        [("carryover", "none", 1), ("carryover", "none", 4)]
    assert (tmp_path / "serving_throughput.png").stat().st_size > 0
    assert (tmp_path / "serving.md").read_text() == result["summary"]


def test_serving_stops_every_server_when_a_later_one_fails_to_start(
        tmp_path: Path, smollm2: Path, server_tag: str) -> None:
    broken = tmp_path / "broken-drafter"
    shutil.copytree(SHIPPED_DRAFTERS / "carryover", broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated: refused at startup
    with pytest.raises(RuntimeError, match="row broken: vllm serve did not start"):
        benchmarks_main(["serving", "--quick", "--row", "none",
                         "--row", f"broken=carryover:{broken}", "--num-prompts", "1",
                         "--out", str(tmp_path / "out")])
    assert not vllm_serve_pids(server_tag)
    assert "Application startup complete" in (tmp_path / "out/logs/none.log").read_text()


def test_serving_runs_three_waves_and_five_prompts_per_category_unless_told() -> None:
    from vllm_carryover.benchmarks.serving import requests_per_run

    assert requests_per_run(1, num_categories=5, total_prompts=50) == 25
    assert requests_per_run(4, num_categories=5, total_prompts=50) == 25
    assert requests_per_run(16, num_categories=5, total_prompts=50) == 48
    assert requests_per_run(16, num_categories=1, total_prompts=10) == 10
    assert requests_per_run(1, 5, 50, requests=25) == 25
    assert requests_per_run(16, 5, 50, requests=80) == 50  # never a prompt twice


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
