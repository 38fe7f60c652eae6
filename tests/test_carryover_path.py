"""The carryover path inside vLLM equals an explicit computation, and is isolated.

An engine run with `VLLM_CARRYOVER_TRACE` dumps every drafting round; each round
is replayed through the plain PyTorch drafter with the request's own committed
context and its own carried-over states as explicit concatenated K/V.
"""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from support.engine_runner import run_engine
from support.tiny_models import make_tiny_drafter, make_tiny_target, torch_drafter_for
from torch.nn import functional as F

from vllm_carryover.draft_trace import ENV, load_rounds
from vllm_carryover.drafter.init_drafter import init_drafter
from vllm_carryover.drafter.markov_head import MarkovHead, draft_left_to_right
from vllm_carryover.drafter.torch_model import TorchDrafter

K = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    target = make_tiny_target(root / "target")
    return target, make_tiny_drafter(target, root / "drafter", block_size=K + 1)


def replay(rounds: list[dict], drafter: TorchDrafter,
           shared_prefix: bool = False) -> list[dict]:
    """Recompute every traced draft; one entry per (round, request).

    With `shared_prefix`, a request whose first rows start past position 0 had
    a prefix-cache hit: its cached context is taken from the earlier request
    that computed those positions (the prompts share that prefix).
    """
    committed: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    results = []
    for rec in rounds:
        qsl, pos, states = rec["query_start_loc"], rec["positions"], rec["states"]
        for i, req in enumerate(rec["req_ids"]):
            start, end = int(qsl[i]), int(qsl[i + 1])
            if shared_prefix and req not in committed:
                earlier = [c for c in committed.values() if c]
                first = int(pos[start])
                committed[req] = {p: st for p, st in earlier[-1].items() if p < first} \
                    if earlier and first > 0 else {}
            rejected = int(rec["num_rejected"][i])
            carried = rejected if bool(rec["carryover"]) and rejected <= K else 0
            for row in range(start, end - rejected):
                committed[req][int(pos[row])] = states[row]
            if "logits" not in rec:  # a step that drafted nothing: context alone
                continue
            block_start = int(rec["query_positions"][i * (K + 1)])
            # Positions at or past the block start are stale (a preempted request's old rows).
            ctx_pos = sorted(p for p in committed[req] if p < block_start)
            ctx = torch.stack([committed[req][p] for p in ctx_pos])
            slot = states[end - carried:end]
            slot_pos = pos[end - carried:end]
            args = (ctx, torch.tensor(ctx_pos), int(rec["next_token_ids"][i]), block_start, K)
            query_ids = rec["query_ids"][i * (K + 1):(i + 1) * (K + 1)]
            assert int(query_ids[0]) == args[2]  # each block opens with its bonus token
            with torch.no_grad():
                expected = drafter.draft_logits(*args, slot, slot_pos, query_ids[1:])
                without_slot = drafter.draft_logits(*args, slot_ids=query_ids[1:])
            results.append(dict(req=req, carried=carried, first_position=int(pos[start]),
                                expected=expected, without_slot=without_slot, slot=slot,
                                slot_pos=slot_pos, args=args, query_ids=query_ids,
                                got=rec["logits"][i * K:(i + 1) * K],
                                drafts=rec["drafts"][i] if "drafts" in rec else None))
    return results


def traced_run(tiny: tuple[Path, Path], tmp: Path, prompts: list[list[int]],
               carryover: bool = True, shared_prefix: bool = False,
               k_schedule: list[list[int]] | None = None, outputs: list | None = None,
               **engine) -> list[dict]:
    """Replayed rounds of an engine run; the generated token ids go to `outputs`."""
    target, drafter_dir = tiny
    spec = {"method": "carryover", "model": str(drafter_dir), "num_speculative_tokens": K,
            "carryover": carryover}
    if k_schedule is not None:
        spec["num_speculative_tokens_per_batch_size"] = k_schedule
    job = {"model": str(target), "prompts": prompts, "max_tokens": 24,
           "engine": {"speculative_config": spec, "max_num_batched_tokens": 48, **engine}}
    out = run_engine(job, tmp, "trace", env={ENV: str(tmp / "trace")})
    if outputs is not None:
        outputs.extend(out["token_ids"])
    return replay(load_rounds(tmp / "trace"), torch_drafter_for(drafter_dir, target),
                  shared_prefix)


def random_prompts(n: int, seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(3, 500) for _ in range(rnd.randrange(4, 90))] for _ in range(n)]


@pytest.fixture(scope="module")
def traced_batch(tiny, tmp_path_factory) -> list[dict]:
    """Six requests of mixed lengths drafted together, chunked prefill forced."""
    return traced_run(tiny, tmp_path_factory.mktemp("batch"), random_prompts(6, seed=1))


def test_vllm_draft_logits_equal_explicit_attention_over_context_and_slot(traced_batch):
    results = traced_batch
    assert len(results) > 50
    for r in results:
        torch.testing.assert_close(r["got"], r["expected"], atol=2e-4, rtol=2e-4)
    with_slot = [r for r in results if r["carried"] > 0]
    assert len(with_slot) > 20, "a random drafter should leave most slots full"
    # The carried states really change the draft (else the check above is vacuous) ...
    for r in with_slot:
        assert (r["got"] - r["without_slot"]).abs().max() > 1e-3
    # ... and an empty slot is exactly the plain DFlash computation.
    for r in results:
        if r["carried"] == 0:
            torch.testing.assert_close(r["got"], r["without_slot"], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("levels", [0, 9], ids=["token-ids", "confidence-levels"])
def test_slot_proposal_drafter_reads_its_requests_suffix_tree_in_its_query_block(
        tiny, tmp_path, levels):
    """A drafter trained on the suffix lookup's proposals (`slot_proposals` in its
    config.json): every query block holds, after the bonus token, what a suffix tree of
    the request's text so far proposes (one request and no seed: its own tree is the
    only one; with confidence levels, as slot codes), mask tokens past it, and the draft
    logits are the drafter's over exactly those codes."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from vllm_carryover.lookups.slots import slot_codes
    from vllm_carryover.lookups.suffix import SuffixLookup
    from vllm_carryover.lookups.texts import WholeTexts

    target, drafter_dir = tiny
    slots = {"source": "suffix", "max_tree_depth": 24, "max_cached_requests": 10000,
             "min_token_prob": 0.0, "max_spec_factor": 8.0}
    drafter = Path(shutil.copytree(drafter_dir, tmp_path / "slot-drafter"))
    cfg = json.loads((drafter / "config.json").read_text())
    if levels:  # a random level embedding, so that the levels move the logits
        slots["confidence_levels"] = levels
        weights = load_file(str(drafter / "model.safetensors"))
        weights["slot_confidence"] = torch.randn(levels, cfg["hidden_size"])
        save_file(weights, str(drafter / "model.safetensors"))
    (drafter / "config.json").write_text(json.dumps(cfg | {"slot_proposals": slots}))
    prompt = [7, 8, 9, 10, 11, 12] * 4 + [7, 8]  # a repeating prompt: its tree proposes
    outputs: list[list[int]] = []
    results = traced_run((target, drafter), tmp_path, [prompt], carryover=False,
                         outputs=outputs)
    text = prompt + outputs[0]
    filled = 0
    for r in results:
        torch.testing.assert_close(r["got"], r["expected"], atol=2e-4, rtol=2e-4)
        block_start = r["args"][3]
        lookup = SuffixLookup(24, 10000, 8.0, 0.0, max_model_len=1 << 20)
        seen = WholeTexts([torch.tensor(text[:block_start + 1]).numpy()])
        lookup.learn(["req"], seen, [len(prompt)])
        want = slot_codes(lookup.drafts(["req"], seen, K), K,
                          cfg["vocab_size"] if levels else None)[0]
        mask = cfg["dflash_config"]["mask_token_id"]
        assert r["query_ids"][1:].tolist() == [c if c >= 0 else mask for c in want.tolist()]
        filled += int((want >= 0).sum())
        if levels:
            assert bool((want[want >= 0] >= cfg["vocab_size"]).all())
    assert filled > 2 * len(results)


def test_markov_drafter_drafts_left_to_right_through_its_head_over_the_same_backbone(
        tiny, tmp_path):
    """The semi-autoregressive variant in vLLM: the backbone (with the carryover slot)
    equals the explicit computation, and each slot's token is the argmax of its logits
    plus the Markov bias of the token drafted before it (the bonus token for slot 1)."""
    target, _ = tiny
    drafter = make_tiny_drafter(target, tmp_path / "markov", block_size=K + 1, markov_rank=8)
    results = traced_run((target, drafter), tmp_path, random_prompts(4, seed=3))
    head = torch_drafter_for(drafter, target).markov_head
    assert len(results) > 30 and sum(r["carried"] > 0 for r in results) > 10
    steered = 0
    for r in results:
        torch.testing.assert_close(r["got"], r["expected"], atol=2e-4, rtol=2e-4)
        prev = torch.cat([torch.tensor([r["args"][2]]), r["drafts"][:-1]])
        with torch.no_grad():
            want = (r["got"] + head.bias(prev)).argmax(-1)
        assert torch.equal(r["drafts"], want)
        steered += not torch.equal(want, r["got"].argmax(-1))
    assert steered > len(results) // 4, "the head should change many drafts"


def test_markov_drafter_samples_each_slot_from_its_biased_distribution():
    """Sampled drafting hands rejection sampling the distribution each token was drawn
    from: slot i's softmax includes the bias of the token drawn for slot i - 1."""
    torch.manual_seed(0)
    head = MarkovHead(vocab_size=50, rank=4)
    base, bonus = torch.randn(3, 5, 50), torch.tensor([1, 2, 3])

    def sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1)[:, 0], probs

    with torch.no_grad():
        tokens, probs = draft_left_to_right(base, bonus, head, sample)
        prev = torch.cat([bonus[:, None], tokens[:, :-1]], dim=1)
        torch.testing.assert_close(probs, F.softmax(base + head.bias(prev), dim=-1))
    assert probs.shape == (3, 5, 50) and tokens.shape == (3, 5)


def test_carryover_off_drafts_like_plain_dflash(tiny, tmp_path):
    results = traced_run(tiny, tmp_path, random_prompts(3, seed=2), carryover=False)
    assert all(r["carried"] == 0 for r in results)
    for r in results:
        torch.testing.assert_close(r["got"], r["without_slot"], atol=2e-4, rtol=2e-4)


def test_one_requests_carried_states_never_reach_another(tiny, tmp_path):
    results = traced_run(tiny, tmp_path, random_prompts(2, seed=3))
    by_req: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by_req[r["req"]].append(r)
    assert len(by_req) == 2
    drafter = torch_drafter_for(tiny[1], tiny[0])
    (_a, ra), (_b, rb) = by_req.items()
    checked = 0
    for mine, theirs in zip(ra, rb, strict=False):
        if mine["carried"] == 0 or theirs["carried"] == 0:
            continue
        # Each draft equals the computation over its own states only ...
        torch.testing.assert_close(mine["got"], mine["expected"], atol=2e-4, rtol=2e-4)
        # ... and would differ if the other request's slot had leaked in.
        with torch.no_grad():
            leaked = drafter.draft_logits(
                *mine["args"], torch.cat([mine["slot"], theirs["slot"]]),
                torch.cat([mine["slot_pos"], theirs["slot_pos"]]))
        assert (leaked - mine["got"]).abs().max() > 1e-3
        checked += 1
    assert checked > 5


def test_checkpoint_without_carryover_weights_serves_in_vllm_in_tree_dflash(tiny, tmp_path):
    target, _ = tiny
    plain = init_drafter(target, tmp_path / "plain", block_size=K + 1, seed=4)
    prompts = random_prompts(4, seed=5)
    job = {"model": str(target), "prompts": prompts, "max_tokens": 16}
    ref = run_engine(job, tmp_path, "none")
    job["engine"] = {"speculative_config": {"method": "dflash", "model": str(plain),
                                            "num_speculative_tokens": K}}
    out = run_engine(job, tmp_path, "dflash")
    assert out["token_ids"] == ref["token_ids"]
    assert out["spec"]["spec_decode_num_drafts"] > 0
    assert out["carryover"]["carryover_draft_rounds"] == 0


def test_prefix_cache_hits_draft_from_the_cached_context(tiny, tmp_path):
    """A request that hits the prefix cache drafts exactly as if it had computed
    its prefix itself: the drafter's context K/V in shared blocks are intact,
    and no carried-over or query-block K/V ever lands in a shared block. Every
    hit keeps its last block (vLLM's EAGLE drop is off for carryover), the exact
    resend of a prompt included."""
    first = random_prompts(1, seed=6)[0] + random_prompts(1, seed=7)[0]
    rnd = random.Random(8)
    prompts = [first, first, first[:70] + [rnd.randrange(3, 500) for _ in range(20)],
               first[:48] + [rnd.randrange(3, 500) for _ in range(9)]]
    results = traced_run(tiny, tmp_path, prompts, shared_prefix=True, max_num_seqs=1,
                         block_size=32, enable_prefix_caching=True)
    first_position = {}
    for r in results:
        first_position.setdefault(r["req"], r["first_position"])
    # the longest block-aligned prefix each prompt shares with an earlier one
    assert list(first_position.values()) == [0, (len(first) - 1) // 32 * 32, 64, 32]
    for r in results:
        torch.testing.assert_close(r["got"], r["expected"], atol=2e-4, rtol=2e-4)


def test_preempted_request_resumes_with_an_empty_slot(tiny, tmp_path):
    """A KV cache too small for the batch forces recompute preemption; the
    re-prefilled request drafts with an empty slot, then carries over again."""
    results = traced_run(tiny, tmp_path, random_prompts(6, seed=9), max_model_len=256,
                         kv_cache_memory_bytes=900_000, block_size=32)
    resumed = []
    last_position: dict[str, int] = {}
    for r in results:
        if r["first_position"] == 0 and last_position.get(r["req"], 0) > 0:
            resumed.append(r)
        last_position[r["req"]] = r["args"][3]
    assert resumed, "the small KV cache did not preempt any request"
    assert all(r["carried"] == 0 for r in resumed)
    for r in results:
        torch.testing.assert_close(r["got"], r["expected"], atol=2e-4, rtol=2e-4)


def test_context_of_steps_that_draft_nothing_is_written_late_and_read_by_later_drafts(
        tiny, tmp_path):
    """K = 0 while three or more requests run, K = 4 below: the K = 0 steps only keep
    their target states (`deferred_context`), and the first draft after them must
    attend to every one of those rows in its right place, here while a small KV cache
    also preempts requests, so that kept rows point at blocks that changed hands."""
    results = traced_run(tiny, tmp_path, random_prompts(6, seed=10), max_model_len=256,
                         kv_cache_memory_bytes=900_000, block_size=32,
                         k_schedule=[[1, 2, K], [3, 1024, 0]])
    rounds = load_rounds(tmp_path / "trace")
    context_only = [i for i, rec in enumerate(rounds) if "logits" not in rec]
    assert len(context_only) > 20, "the schedule should have run many K = 0 steps"
    assert any(i > context_only[0] for i, rec in enumerate(rounds) if "logits" in rec)
    for r in results:
        torch.testing.assert_close(r["got"], r["expected"], atol=2e-4, rtol=2e-4)
