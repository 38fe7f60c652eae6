"""`python -m train headroom` on a tiny Llama: its "target" column equals a brute-force
recount (one plain causal target forward per rejection), the table adds up, and it
computes the held-out states itself (no cache of the whole dataset's states)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.tiny_models import make_tiny_drafter, make_tiny_target
from vllm_carryover.train.data import write_dataset
from vllm_carryover.train.main import main
from vllm_carryover.train.paths import data_dir

VOCAB = 16  # small, so that some rejected rows' argmax hits the true token
DATA = "tiny-headroom"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("headroom")
    target = make_tiny_target(tmp / "target", vocab=VOCAB)
    drafter = make_tiny_drafter(target, tmp / "drafter", block_size=4)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(8):
        toks = torch.randint(1, VOCAB, (30,), generator=gen).tolist()
        rows.append({"id": f"r{i}", "group": f"g{i}", "category": ("chat", "code")[i % 2],
                     "messages": [], "prompt_ids": toks[:6], "response_ids": toks[6:],
                     "response": "", "split": "heldout"})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CARRYOVER_CACHE", str(tmp / "cache"))
        write_dataset(data_dir(DATA), rows, {"target": str(target)})
    return {"target": target, "drafter": drafter, "cache": tmp / "cache"}


def brute_force_target_hits(setup: dict[str, Path]) -> tuple[int, int, float]:
    """(rejections, target argmax right, the target's summed probability of the rejected
    drafts) with plain forwards per rejection."""
    from transformers import AutoModelForCausalLM
    from vllm_carryover.train.dflash_loss import sample_anchors
    from vllm_carryover.train.draft_verify_draft import draft_verify_draft
    from vllm_carryover.train.headroom import heldout_sequences, load_drafter

    drafter, _ = load_drafter(str(setup["target"]), str(setup["drafter"]), DATA)
    full = AutoModelForCausalLM.from_pretrained(setup["target"], dtype=torch.float32).eval()
    seqs = heldout_sequences(str(setup["target"]), DATA, list(drafter.config.target_layer_ids))
    gen = torch.Generator().manual_seed(1234)
    n = hits = 0
    p_rejected = 0.0
    with torch.no_grad():
        for seq in seqs:
            anchors = sample_anchors(seq.response_start, seq.tokens.shape[0] - 1, 16, gen)
            r = draft_verify_draft(drafter, full.model, seq.tokens, seq.aux, anchors,
                                   first_loss=False)
            for p, drafts, a, keep in zip(anchors.tolist(), r.drafts, r.accepted.tolist(),
                                          r.keep.tolist(), strict=True):
                if not keep or a == drafts.shape[0]:
                    continue
                ids = torch.cat([seq.tokens[: p + a + 1], drafts[a : a + 1]])
                guess = int(full(input_ids=ids[None]).logits[0, -1].argmax())
                n += 1
                hits += guess == int(seq.tokens[p + a + 2])
                before = full(input_ids=seq.tokens[None, : p + a + 1]).logits[0, -1]
                p_rejected += float(before.softmax(-1)[drafts[a]])
    return n, hits, p_rejected


def test_headroom_target_column_matches_brute_force_and_rows_add_up(
        setup: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("VLLM_CARRYOVER_CACHE", str(setup["cache"]))
    out = tmp_path / "headroom.json"
    main(["headroom", "--target", str(setup["target"]), "--init", str(setup["drafter"]),
          "--data", DATA, "--threads", "1", "--out", str(out)])
    table = json.loads(out.read_text())
    assert "| all |" in capsys.readouterr().out
    assert not (setup["cache"] / "states").exists()  # no whole-dataset state cache filled
    assert set(table) == {"all", "chat", "code"}
    assert table["all"]["rejections"] == table["chat"]["rejections"] + table["code"]["rejections"]
    for row in table.values():
        assert max(row["target"], row["drafter"]) <= row["either"]
        assert 1.0 <= row["walked_tau"] <= 4  # block 4: at most 3 drafts and the bonus
        assert row["either"] <= row["target"] + row["drafter"] + 1e-9

        # the near-miss split adds up to the whole
        near = row["near"]
        assert near * row["target_near"] + (1 - near) * row["target_far"] == pytest.approx(
            row["target"], abs=1e-3)

    n, hits, p_rejected = brute_force_target_hits(setup)
    assert n == table["all"]["rejections"] > 0 and hits > 0
    assert hits / n == pytest.approx(table["all"]["target"], abs=1e-4)
    assert p_rejected / n == pytest.approx(table["all"]["p_rejected"], abs=1e-3)
