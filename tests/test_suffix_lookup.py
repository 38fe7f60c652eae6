"""Suffix lookup beside the drafter (`vllm_carryover.lookups.suffix`), without an engine:
each step's batch feeds arctic-inference's trees, which draft from the request's own
text and from the answers of earlier requests (and of the seed file's, fed at startup),
and forget the requests that left."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from vllm_carryover.lookups.suffix import SEED_FILE, SuffixLookup, load_seed, save_seed
from vllm_carryover.lookups.texts import StepTexts, WholeTexts

PROMPT = np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.int32)


def lookup(max_cached_requests: int = 10000, max_model_len: int = 1024) -> SuffixLookup:
    # vLLM's defaults but a probability floor of 0: one sighting of a continuation drafts
    return SuffixLookup(max_tree_depth=24, max_cached_requests=max_cached_requests,
                        max_spec_factor=1.0, min_token_prob=0.0, max_model_len=max_model_len)


def step(suffix: SuffixLookup, batch: dict[str, np.ndarray | None], k: int = 4,
         prompt_len: int = len(PROMPT)) -> list:
    """One step of `batch` (request id -> its text, None in a prefill chunk)."""
    req_ids, texts = list(batch), WholeTexts(list(batch.values()))
    suffix.learn(req_ids, texts, [prompt_len] * len(batch))
    return [list(p) for p in suffix.propose(req_ids, texts, k)]


def test_a_request_drafts_what_followed_its_texts_end_earlier_in_it() -> None:
    suffix = lookup()
    text = np.concatenate((PROMPT, [9, 1, 2, 3]))  # answered 9, then repeats 1 2 3
    assert step(suffix, {"a": text}) == [[4, 5, 6]]  # match of 3 tokens: up to 3 drafted
    assert step(suffix, {"b": np.array([11, 12], dtype=np.int32)}, prompt_len=2) == [[]]


def test_a_request_drafts_an_earlier_requests_answer_after_that_one_finished() -> None:
    suffix = lookup()
    answer = [20, 21, 22, 23, 24, 25, 26]
    step(suffix, {"a": np.concatenate((PROMPT, answer))})
    other = np.array([30, 31, 20, 21, 22], dtype=np.int32)  # a new prompt, same phrase
    assert step(suffix, {"b": other}, prompt_len=5) == [[23, 24, 25]]
    assert list(suffix.cache.active_requests) == ["b"] and "a" in suffix.cache.cached_requests


def test_a_seeded_tree_drafts_a_past_answers_continuation_for_a_new_request() -> None:
    """Seeded answers are in the answer tree as if requests had written them: a fresh
    request ending with an answer's beginning drafts its continuation (an unseeded tree
    has nothing), and live requests' string ids never evict the seed's integer ones."""
    answer = np.array([20, 21, 22, 23, 24, 25, 26], dtype=np.int32)
    other = np.array([30, 31, 20, 21, 22], dtype=np.int32)
    seeded = lookup()
    assert seeded.seed([answer]) == 1
    assert step(seeded, {"0": other}, prompt_len=5) == [[23, 24, 25]]
    assert step(lookup(), {"0": other}, prompt_len=5) == [[]]
    assert set(seeded.cache.cached_requests) == {0, "0"} and not seeded._learned.keys() - {"0"}


def test_a_seed_larger_than_the_answer_tree_feeds_only_its_last_answers() -> None:
    """The tree would evict the first ones while they are fed (oldest first), as live
    requests then evict the seed's; without a tree of past answers
    (`max_cached_requests` 0) nothing is fed."""
    answers = [np.array([i, 40 + i, 50 + i], dtype=np.int32) for i in range(3)]
    suffix = lookup(max_cached_requests=2)
    assert suffix.seed(answers) == 2
    assert list(suffix.cache.cached_requests) == [0, 1]  # answers 1 and 2
    assert step(suffix, {"a": np.array([2, 42], dtype=np.int32)}, prompt_len=2) == [[52]]
    assert list(suffix.cache.cached_requests) == [1, "a"]  # the oldest seed made way
    assert lookup(max_cached_requests=0).seed(answers) == 0


@pytest.mark.parametrize(("top", "stored"), [(49151, np.uint16), (70000, np.int32)])
def test_the_seed_file_round_trips(tmp_path, top: int, stored: type) -> None:
    """Token ids as uint16 where the vocabulary fits, else int32; an empty answer too;
    loaded as the contiguous int32 arrays the cache takes."""
    answers = [[1, 2, top], [], [5]]
    save_seed(tmp_path / SEED_FILE, answers)
    with np.load(tmp_path / SEED_FILE) as z:
        assert z["tokens"].dtype == stored
    loaded = load_seed(tmp_path / SEED_FILE)
    assert [a.tolist() for a in loaded] == answers
    assert all(a.dtype == np.int32 and a.flags["C_CONTIGUOUS"] for a in loaded)


def test_the_lookups_seed_the_answer_tree_from_the_drafter_folder(tmp_path) -> None:
    """`Lookups.build` feeds the drafter folder's seed file in; without one the answer
    tree starts empty."""
    from types import SimpleNamespace

    from vllm_carryover.config import CarryoverSettings
    from vllm_carryover.lookups.beside import Lookups
    from vllm_carryover.metrics import CarryoverCounters

    vllm_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(async_scheduling=False),
        model_config=SimpleNamespace(max_model_len=1024, get_vocab_size=lambda: 64),
        speculative_config=SimpleNamespace(
            suffix_decoding_max_tree_depth=24, suffix_decoding_max_cached_requests=10000,
            suffix_decoding_max_spec_factor=1.0, suffix_decoding_min_token_prob=0.1))

    def answer_tree(folder) -> list:
        lookups = Lookups.build(CarryoverSettings(suffix_lookup=True), vllm_config,
                                str(folder), None, CarryoverCounters(None))
        return list(lookups.suffix.cache.cached_requests)

    assert answer_tree(tmp_path) == []
    save_seed(tmp_path / SEED_FILE, [[1, 2, 3], [4, 5]])
    assert answer_tree(tmp_path) == [0, 1]


def test_tokens_learnt_in_steps_without_drafts_are_not_lost() -> None:
    """A K = 0 step learns too: the answer tree has all that the request wrote."""
    suffix = lookup()
    step(suffix, {"a": PROMPT}, k=0)
    text = np.concatenate((PROMPT, [40, 41, 42, 1, 2, 3]))
    assert step(suffix, {"a": text}) == [[4, 5, 6]]
    assert step(suffix, {"b": np.array([9, 40, 41], dtype=np.int32)}, prompt_len=3) == [[42, 1]]


def test_requests_that_leave_the_batch_lose_their_tree_over_many_requests() -> None:
    """300 requests, 4 running at a time, each for 5 steps: only the running ones keep a
    tree of their own, and the answer tree keeps at most `max_cached_requests`."""
    suffix = lookup(max_cached_requests=16)
    rng = np.random.default_rng(0)
    texts: dict[str, np.ndarray] = {}
    for s in range(300 * 5 // 4):
        running = [f"r{i}" for i in range(s * 4 // 5, s * 4 // 5 + 4)]
        for r in running:
            texts[r] = np.concatenate((texts.get(r, PROMPT), rng.integers(0, 50, 3)))
        step(suffix, {r: texts[r].astype(np.int32) for r in running})
        assert set(suffix.cache.active_requests) == set(running)
        assert set(suffix._learned) == set(running)
        assert len(suffix.cache.cached_requests) <= 16
    step(suffix, {})  # the batch emptied
    assert not suffix.cache.active_requests and not suffix._learned


def test_a_prefill_chunk_waits_and_a_returning_request_starts_from_its_whole_text() -> None:
    suffix = lookup()
    assert step(suffix, {"a": None}) == [[]]  # a prefill chunk that sampled nothing
    assert not suffix.cache.active_requests
    text = np.concatenate((PROMPT, [50, 51, 52, 53, 50, 51]))
    step(suffix, {"a": text})
    step(suffix, {})  # preempted
    assert step(suffix, {"a": np.concatenate((text, [52]))}) == [[53, 50, 51]]


def test_no_draft_reaches_past_the_serving_length() -> None:
    """The bonus token after the drafts needs a position too; and K = 0 drafts nothing
    (the cache would read a limit of 0 as its tree depth)."""
    text = np.concatenate((PROMPT, [1, 2, 3]))
    assert step(lookup(max_model_len=len(text) + 3), {"a": text}) == [[4, 5]]
    assert step(lookup(max_model_len=len(text) + 1), {"a": text}) == [[]]
    assert step(lookup(), {"a": text}, k=0) == [[]]


def test_the_config_names_the_package_and_the_fix_when_arctic_inference_is_missing(
        stub_drafter, monkeypatch) -> None:
    from types import SimpleNamespace

    from support.checkpoint_layouts import TARGET_STUB

    from vllm_carryover.config import translate
    from vllm_carryover.errors import CarryoverConfigError

    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)
    spec = {"method": "carryover", "model": str(stub_drafter), "suffix_lookup": True}
    with pytest.raises(CarryoverConfigError) as info:
        translate(spec, SimpleNamespace(**TARGET_STUB))
    assert "needs the arctic-inference package" in str(info.value)
    assert "run scripts/setup.sh" in str(info.value)


def test_the_lookups_learn_every_step_and_fill_the_drafts_with_the_trees_proposals() -> None:
    """Through `Lookups` as the proposer calls it, over vLLM's input batch: a step drafts
    the trees' proposal and keeps its length; a K = 0 step (only `step_begins`) still
    forgets the request that finished."""
    from types import SimpleNamespace

    import torch

    from vllm_carryover.lookups.beside import Lookups
    from vllm_carryover.metrics import CarryoverCounters

    def batch(req_ids: list[str], rows: list[list[int]]) -> SimpleNamespace:
        table = np.zeros((4, 32), dtype=np.int32)
        for i, row in enumerate(rows):
            table[i, :len(row)] = row
        return SimpleNamespace(req_ids=req_ids, token_ids_cpu=table,
                               num_tokens_no_spec=np.array([len(r) for r in rows]),
                               num_prompt_tokens=np.array([len(PROMPT)] * len(rows)))

    runner = SimpleNamespace(input_batch=batch(["a", "b"], [[*PROMPT, 9, 1], [*PROMPT, 30]]))
    suffix = lookup()
    lookups = Lookups(suffix, 1, False, 64, runner, CarryoverCounters(None), None)
    lookups.sampled = (torch.tensor([[2, -1], [31, -1]]), torch.tensor([False, False]))
    lookups.step_begins(2)
    plan = lookups.plan(2, 4)
    assert [list(p) for p in plan.proposals] == [[3, 4], []] and plan.drafter_runs
    drafts = torch.full((2, 4), 63)
    lookups.fill(drafts, plan, None)
    assert drafts.tolist() == [[3, 4, 63, 63], [63] * 4]
    assert lookups.take_lengths() == {"a": 2, "b": 1}  # b keeps one drafter token

    runner.input_batch = batch(["b"], [[*PROMPT, 30, 31]])  # a finished
    lookups.sampled = (torch.tensor([[32, -1]]), torch.tensor([False]))
    lookups.step_begins(1)  # a K = 0 step: no plan
    assert list(suffix.cache.active_requests) == ["b"]
    assert suffix._learned == {"b": len(PROMPT) + 3}


def test_a_steps_texts_are_the_committed_tokens_then_this_steps_sampled_ones() -> None:
    """`StepTexts` over vLLM's token table and the step's sampled tokens (-1 where
    rejected): any piece of a request's text without building the whole; a prefill
    chunk that sampled nothing has none."""
    table = np.array([[1, 2, 3, 0, 0, 0], [4, 5, 0, 0, 0, 0], [6, 7, 8, 9, 0, 0]],
                     dtype=np.int32)
    sampled = torch.tensor([[10, 11, -1], [12, -1, -1], [99, -1, -1]])
    discarded = torch.tensor([False, False, True, False])  # vLLM's mask is max_num_reqs long
    texts = StepTexts(table, np.array([3, 2, 4]), sampled, discarded)
    assert [texts.length(i) for i in range(3)] == [5, 3, None]
    assert texts.whole(0).tolist() == [1, 2, 3, 10, 11] and texts.whole(2) is None
    assert texts.whole(1).tolist() == [4, 5, 12]
    whole = [1, 2, 3, 10, 11]
    for start in range(6):
        for stop in (None, *range(start, 6)):
            assert texts.piece(0, start, stop).tolist() == whole[start:stop], (start, stop)


def test_learning_and_proposing_from_a_steps_pieces_equal_the_whole_texts() -> None:
    """Over 40 steps of a changing batch (new requests, a prefill chunk that sampled
    nothing, K = 0 steps, a preempted request that returns, finished ones), the trees
    fed through `StepTexts` (only the tokens not yet learned, the last tree-depth tokens
    to match) draft exactly what trees fed the whole texts draft, and hold the same."""
    rng = np.random.default_rng(1)
    by_pieces, by_whole = lookup(max_cached_requests=8), lookup(max_cached_requests=8)
    for suffix in (by_pieces, by_whole):
        suffix.max_tree_depth = 6  # shorter than the texts: only their ends are matched
    texts: dict[str, np.ndarray] = {}
    prompts: dict[str, int] = {}
    proposals = 0
    for s in range(40):
        running = [f"r{i}" for i in range(s // 4, s // 4 + 3) if not (s == 20 and i == 6)]
        for r in running:
            if r not in texts:
                prompts[r] = int(rng.integers(3, 9))
                texts[r] = rng.integers(0, 12, prompts[r]).astype(np.int32)
        # this step's sampled tokens: 0..3 per request (0: rejected all, or a prefill chunk)
        sampled = np.full((len(running), 4), -1, dtype=np.int64)
        chunk = np.array([s % 9 == 0 and i == 0 for i in range(len(running))])
        for i in range(len(running)):
            n = 0 if chunk[i] else int(rng.integers(1, 4))
            sampled[i, :n] = rng.integers(0, 12, n)
        table = np.zeros((len(running), 200), dtype=np.int32)
        for i, r in enumerate(running):
            table[i, :len(texts[r])] = texts[r]
        step_texts = StepTexts(table, np.array([len(texts[r]) for r in running]),
                               torch.from_numpy(sampled), torch.from_numpy(chunk))
        whole = [None if chunk[i] else np.concatenate(
            (texts[r], sampled[i][sampled[i] >= 0].astype(np.int32)))
            for i, r in enumerate(running)]
        prompt_lens = [prompts[r] for r in running]
        by_pieces.learn(running, step_texts, prompt_lens)
        by_whole.learn(running, WholeTexts(whole), prompt_lens)
        k = 0 if s % 5 == 4 else 4  # a K = 0 step learns but drafts nothing
        if k:
            drafted = [list(p) for p in by_pieces.propose(running, step_texts, k)]
            assert drafted == [list(p) for p in by_whole.propose(running, WholeTexts(whole), k)]
            proposals += sum(map(bool, drafted))
        for i, r in enumerate(running):
            if whole[i] is not None:
                texts[r] = whole[i]
        assert by_pieces._learned == by_whole._learned
        assert list(by_pieces.cache.cached_requests) == list(by_whole.cache.cached_requests)
    assert proposals > 30  # most steps' requests drafted something
    # the same trees: every request's own text and the answers draft the same
    probe = [np.array([t], dtype=np.int32) for t in range(12)]
    ids = [f"probe{t}" for t in range(12)]
    for suffix in (by_pieces, by_whole):
        suffix.learn(ids, WholeTexts(probe), [1] * 12)
    assert ([list(p) for p in by_pieces.propose(ids, WholeTexts(probe), 4)]
            == [list(p) for p in by_whole.propose(ids, WholeTexts(probe), 4)])
