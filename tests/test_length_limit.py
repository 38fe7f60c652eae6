"""Near the drafter's length limit each request is judged on its own (`length_limit`).

vLLM stops drafting for a whole batch once its longest request is within K + 1
tokens of the drafter's limit, and then verifies K dummy tokens per request.
Here the requests that fit keep drafting (and get drafts accepted), the others
get 0 drafts, none are verified for them, and greedy output stays identical (with
the slot-ownership checks on: the others' slots stay where the rule puts them).
"""

from __future__ import annotations

import json
import shutil
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.chat_prompts import QUESTIONS
from support.engine_runner import run_engine

from vllm_carryover.draft_trace import ENV, load_rounds
from vllm_carryover.length_limit import PAD_SLOT, LengthLimit, row_mask
from vllm_carryover.slot_table import ENV_CHECK as CHECK_SLOTS

K = 7
LIMIT = 160  # the drafter's max_position_embeddings in the engine test
SHORT = (1, 3, 13)  # chat prompts of 44-54 tokens: they fit to the end (+64 new tokens)
CROSSING = 15  # 109 tokens: over the limit after about 43 new tokens
LONG = 11  # 208 tokens: over the limit from the start
MAX_TOKENS = 64


def cad(seq_lens: list[int]) -> SimpleNamespace:
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return SimpleNamespace(max_seq_len=max(seq_lens), seq_lens=lens,
                           seq_lens_cpu_upper_bound=lens, batch_size=lambda: len(seq_lens))


def test_requests_are_judged_one_by_one_and_the_drafter_runs_while_any_fits() -> None:
    limit = LengthLimit(num_query=K + 1)
    assert limit.plan(cad([100, 152]), LIMIT, ["a", "b"]) is True
    assert limit.over is None and not limit.over_req_ids  # vLLM's rule holds for the batch
    assert limit.plan(cad([100, 153, 300]), LIMIT, ["a", "b", "c"]) is True
    assert limit.over.tolist() == [False, True, True] and limit.over_req_ids == {"b", "c"}
    assert limit.drop_drafts(["a", "b", "c"], [[1] * K, [2] * K, [3] * K]) == [[1] * K, [], []]
    assert limit.plan(cad([153, 300]), LIMIT, ["b", "c"]) is False  # none fits: no drafter
    assert limit.over is None and limit.over_req_ids == {"b", "c"}
    assert limit.drop_drafts(["b", "c"], [[0] * K, [0] * K]) == [[], []]
    assert limit.plan(None, LIMIT, []) is False  # vLLM: no metadata, no drafting


def test_requests_over_the_limit_write_nothing_and_read_only_their_first_keys() -> None:
    limit = LengthLimit(num_query=3)
    limit.plan(cad([10, 200]), 100, ["a", "b"])
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)  # verify rows: 2 of a, 3 of b, 1 padding
    assert row_mask(limit.over, qsl, 6).tolist() == [False, False, True, True, True, False]
    positions = torch.tensor([8, 9, 197, 198, 199, 0])
    assert limit.clamp_positions(positions, qsl).tolist() == [8, 9, 0, 0, 0, 0]
    context_slots, query_slots = torch.arange(6), torch.arange(100, 106)
    seq_lens = limit.disable(context_slots, query_slots, qsl, torch.tensor([13, 203]))
    assert context_slots.tolist() == [0, 1, PAD_SLOT, PAD_SLOT, PAD_SLOT, 5]
    assert query_slots.tolist() == [100, 101, 102] + [PAD_SLOT] * 3
    assert seq_lens.tolist() == [13, 3]


@pytest.fixture(scope="module")
def prompts(smollm2: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    ids = []
    for i in (*SHORT, CROSSING, LONG):
        text = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i]}],
                                       tokenize=False, add_generation_prompt=True)
        ids.append(tok(text, add_special_tokens=False).input_ids)
    lens = [len(p) for p in ids]
    assert all(n + MAX_TOKENS + K + 1 <= LIMIT for n in lens[:3]), lens
    assert lens[3] + K + 1 <= LIMIT < lens[3] + MAX_TOKENS and lens[4] > LIMIT, lens
    return ids


def short_drafter(trained: Path, folder: Path) -> Path:
    """The shipped trained drafter with a length limit below the serving max_model_len."""
    shutil.copytree(trained, folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = LIMIT
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def run(smollm2: Path, prompts: list[list[int]], workdir: Path, name: str,
        drafter: Path | None = None, env: dict[str, str] | None = None) -> dict:
    engine: dict = {}
    if drafter is not None:
        engine["speculative_config"] = {"method": "carryover", "model": str(drafter),
                                        "num_speculative_tokens": K, "carryover": True}
    return run_engine({"model": str(smollm2), "prompts": prompts, "max_tokens": MAX_TOKENS,
                       "engine": engine}, workdir, name, env=env)


def test_a_long_request_leaves_the_others_drafting_and_verifies_no_dummy_tokens(
        smollm2, prompts, trained_drafter, tmp_path):
    drafter = short_drafter(trained_drafter, tmp_path / "drafter")
    trace = tmp_path / "trace"
    out = run(smollm2, prompts, tmp_path, "carryover", drafter,
              env={ENV: str(trace), CHECK_SLOTS: "1"})
    reference = run(smollm2, prompts, tmp_path, "none")
    assert out["token_ids"] == reference["token_ids"]

    # Per request, the verify rows of each traced round: (length, sequence length).
    rounds: list[dict[str, tuple[int, int]]] = []
    for rec in load_rounds(trace):
        qsl, pos = rec["query_start_loc"], rec["positions"]
        rounds.append({req: (int(qsl[i + 1] - qsl[i]), int(pos[qsl[i + 1] - 1]) + 1)
                       for i, req in enumerate(rec["req_ids"])})
    assert rounds, "the drafter never ran"
    first_seen = sorted({r for rnd in rounds for r in rnd},
                        key=lambda r: next(i for i, rnd in enumerate(rounds) if r in rnd))
    length = {r: next(rnd[r][1] for rnd in rounds if r in rnd) for r in first_seen}
    by_prompt = {len(p): r for r in first_seen for p in prompts if len(p) == length[r]}
    crossing, long = by_prompt[len(prompts[3])], by_prompt[len(prompts[4])]

    verified_drafts = 0
    drafted = {r: 0 for r in first_seen}
    for now, after in pairwise(rounds):
        for req, (_, seq_len) in now.items():
            if req not in after:
                continue
            next_rows = after[req][0]
            verified_drafts += next_rows - 1
            drafted[req] += next_rows > 1
            over = seq_len + K + 1 > LIMIT
            assert (next_rows == 1) == over, (req, seq_len, next_rows)
    assert drafted[long] == 0  # never a draft, so never a dummy token verified
    assert 0 < drafted[crossing] < MAX_TOKENS  # drafted until it reached the limit
    assert all(drafted[r] > 0 for r in first_seen if r not in (crossing, long))
    # The spec counters see no draft tokens beyond the traced rounds' (none verified while
    # no request fitted) and accepted drafts for the requests that kept drafting.
    assert out["spec"]["spec_decode_num_draft_tokens"] == verified_drafts
    assert out["spec"]["spec_decode_num_accepted_tokens"] > 0
