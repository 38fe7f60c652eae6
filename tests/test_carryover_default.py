"""Carryover is on by default only for a drafter trained to read carried states.

A checkpoint without `rejected_embedding` (plain DFlash, or the baseline recipe)
never saw rejected keys in training; measured on the shipped baselines its tau
is slightly lower with carryover on (docs/results.md), so the default is off.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.checkpoint_layouts import TARGET_STUB

from vllm_carryover import config as speculative_config
from vllm_carryover.config import translate
from vllm_carryover.drafter.checkpoint import load_drafter_state, save_drafter
from vllm_carryover.drafter.format import REJECTED_EMBEDDING

TARGET = SimpleNamespace(**TARGET_STUB)


@pytest.fixture(scope="module")
def marked_drafter(stub_drafter: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stub drafter with a (nonzero) rejected embedding, as the carryover recipe writes."""
    out = Path(shutil.copytree(stub_drafter, tmp_path_factory.mktemp("marked") / "drafter"))
    cfg, state = load_drafter_state(out)
    state[REJECTED_EMBEDDING] = torch.full((cfg["hidden_size"],), 0.02)
    return save_drafter(out, cfg, state)


@pytest.fixture
def logged(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The plugin's info log lines (recorded directly: once vLLM has configured its
    logger, it no longer propagates to pytest's log capture)."""
    lines: list[str] = []
    monkeypatch.setattr(speculative_config.logger, "info",
                        lambda fmt, *args: lines.append(fmt % args))
    return lines


def spec_for(drafter: Path, **extra: object) -> dict[str, object]:
    return {"method": "carryover", "model": str(drafter), "num_speculative_tokens": 4, **extra}


def test_drafter_without_rejected_embedding_defaults_to_off_and_logs_why(stub_drafter, logged):
    _, settings = translate(spec_for(stub_drafter), TARGET)
    assert settings.enabled is False
    assert len(logged) == 1
    assert logged[0].startswith("Carryover off by default: the drafter has no rejected_embedding")
    assert '"carryover": true' in logged[0]


def test_drafter_with_rejected_embedding_defaults_to_on(marked_drafter, logged):
    _, settings = translate(spec_for(marked_drafter), TARGET)
    assert settings.enabled is True
    assert len(logged) == 1
    assert logged[0].startswith("Carryover on by default: the drafter has a rejected_embedding")


@pytest.mark.parametrize("explicit", [True, False])
def test_explicit_setting_wins_over_the_default(stub_drafter, marked_drafter, explicit, logged):
    for drafter in (stub_drafter, marked_drafter):
        _, settings = translate(spec_for(drafter, carryover=explicit), TARGET)
        assert settings.enabled is explicit
    assert logged == []
