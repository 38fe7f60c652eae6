"""The lookup beside the drafter, as one object the proposer asks: which requests the
suffix lookup (`lookups.suffix`) drafts for this step and how many drafter tokens the
others keep (`plan`), the lookup's tokens written into the step's drafts (`fill`), and
at the round's end each request's draft length (`take_lengths`). It also keeps what
vLLM hands over between its callbacks for this round only (the sampled tokens, the
drafter rows worth scoring, the draft lengths), and steps the drafter gate
(`control.drafter_gate`) where K by goodput measures whether the drafter drafts beside
the lookup. The suffix lookup learns from every step's batch (`step_begins`), read in
pieces (`lookups.texts.StepTexts`), its answer tree seeded from the drafter folder's
`suffix_seed.npz` where there is one; how proposals become drafts is `lookups.drafts`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.logger import init_logger

from vllm_carryover.control.drafter_gate import DrafterGate
from vllm_carryover.lookups.drafts import (
    draft_lengths,
    drafter_rows_kept,
    lookups_suffice,
    make_lookup_probs_one_hot,
    one_hot_probs,
    write_drafts,
)
from vllm_carryover.lookups.slots import level_vocab, slot_codes
from vllm_carryover.lookups.suffix import SEED_FILE, SuffixLookup, load_seed
from vllm_carryover.lookups.texts import StepTexts
from vllm_carryover.metrics import CarryoverCounters

logger = init_logger(f"vllm.{__name__}")  # under vLLM's configured logger
GATE_LOG_EVERY = 256  # counted cycles between logs of the drafter gate's choices


@dataclass(frozen=True)
class Plan:
    """One step's lookup proposals, and whether and how far the drafter drafts beside them."""

    proposals: list[Sequence[int]]
    drafter_k: int | None  # the drafter's tokens kept where no lookup proposes (None: all K)
    drafter_runs: bool
    slot_codes: torch.Tensor | None = None  # [batch, K] for the drafter's slots instead


class Lookups:
    """The suffix lookup beside the drafter, and its per-round state."""

    def __init__(self, suffix: SuffixLookup, drafter_k: int | None, rows_stay_wide: bool,
                 vocab_size: int, runner: Any, counters: CarryoverCounters,
                 gate: DrafterGate | None, into_slots: bool = False,
                 level_vocab: int | None = None) -> None:
        self.suffix = suffix
        # the proposals go into the drafter's slots (`lookups.slots`), not the drafts,
        # with their confidence levels where the drafter reads them (`level_vocab`)
        self.into_slots = into_slots
        self.level_vocab = level_vocab
        self.drafter_k = drafter_k  # `lookup_drafter_k`
        self.rows_stay_wide = rows_stay_wide  # async scheduling verifies whole K-wide rows
        self.vocab_size = vocab_size
        self.counters = counters
        self.gate = gate
        self._runner = runner  # for the requests' texts and ids
        self.sampled: tuple[torch.Tensor, torch.Tensor] | None = None  # this step's tokens
        self._lengths: dict[str, int] | None = None  # this round's, for `kept_drafts`
        self._scored_rows: int | None = None  # of the drafter's K this round (None: all)
        self._step_texts: StepTexts | None = None  # this step's (`_texts`)

    @classmethod
    def build(cls, settings: Any, vllm_config: Any, model_dir: str, runner: Any,
              counters: CarryoverCounters, slots: dict[str, Any] | None = None
              ) -> Lookups | None:
        """The suffix lookup if `settings` (`CarryoverSettings`) ask for it, or the one
        whose proposals the drafter reads in its slots (`slots`: its config's
        `slot_proposals`), else None."""
        if not settings.suffix_lookup and not slots:
            return None
        rows_stay_wide = bool(vllm_config.scheduler_config.async_scheduling)
        max_model_len = vllm_config.model_config.max_model_len
        if slots:  # asked as the drafter's training asked (train/slot_proposals.py)
            suffix = SuffixLookup(slots["max_tree_depth"], slots["max_cached_requests"],
                                  slots["max_spec_factor"], slots["min_token_prob"],
                                  max_model_len)
        else:
            spec = vllm_config.speculative_config  # vLLM's suffix_decoding_* keys
            suffix = SuffixLookup(spec.suffix_decoding_max_tree_depth,
                                  spec.suffix_decoding_max_cached_requests,
                                  spec.suffix_decoding_max_spec_factor,
                                  spec.suffix_decoding_min_token_prob, max_model_len)
        logger.info("Suffix lookup%s: each request's text and up to %d past answers in "
                    "suffix trees of depth %d (arctic-inference).",
                    " in the drafter's slots" if slots else "",
                    suffix.cache.max_cached_requests, suffix.max_tree_depth)
        path = Path(model_dir) / SEED_FILE
        if path.exists():  # `python -m train suffix-seed`; else the answer tree starts empty
            start = time.perf_counter()
            fed = suffix.seed(load_seed(path))
            logger.info("Suffix lookup: %d past answers from %s in the answer tree "
                        "(%.1f s).", fed, path, time.perf_counter() - start)
        if slots:
            vocab = vllm_config.model_config.get_vocab_size()
            return cls(suffix, None, rows_stay_wide, vocab, runner, counters, None,
                       into_slots=True, level_vocab=level_vocab(slots, vocab))
        # With K by goodput, whether the drafter drafts beside the lookup is measured
        # too. Only synchronous scheduling lets a request verify fewer than K drafts.
        gate = None
        if (settings.goodput_k and settings.drafter_gate and not rows_stay_wide
                and settings.lookup_drafter_k != 0):
            gate = DrafterGate()
            logger.info("Drafter beside the lookups: on or off per batch size by measured "
                        "goodput.")
        return cls(suffix, settings.lookup_drafter_k, rows_stay_wide,
                   vllm_config.model_config.get_vocab_size(), runner, counters, gate)

    def step_begins(self, num_reqs: int) -> None:
        """Bring the suffix trees up to this step's batch (every step, K = 0 ones too,
        so they hold all that the server answered), and tell the gate, if any, that a
        step begins, and what the verification since the last `propose` call emitted."""
        self._step_texts = None
        if self.sampled is not None:
            batch = self._runner.input_batch
            self.suffix.learn(batch.req_ids[:num_reqs], self._texts(num_reqs),
                              batch.num_prompt_tokens[:num_reqs])
        if self.gate is None:
            return
        now, tokens = time.perf_counter(), None
        if self.sampled is not None:
            sampled, discarded = self.sampled
            # one read from the device for both counts
            in_prefill, emitted = torch.stack((discarded[:num_reqs].sum(),
                                               (sampled[:num_reqs] >= 0).sum())).tolist()
            if not in_prefill:  # no request in a prefill chunk
                tokens = emitted
        req_ids = tuple(self._runner.input_batch.req_ids[:num_reqs])
        if self.gate.step(now, req_ids, tokens) and self.gate.counted % GATE_LOG_EVERY == 0:
            logger.info("Drafter beside the lookups, per batch size: %s (choice; tokens/s "
                        "with the drafter, with the lookups alone)", self.gate.summary())

    def plan(self, num_reqs: int, k: int) -> Plan:
        """This step's proposals, and whether the drafter must run for the requests
        without one (then only its rows a request can keep are scored)."""
        req_ids, texts = self._runner.input_batch.req_ids[:num_reqs], self._texts(num_reqs)
        if self.into_slots:  # the drafter reads them and drafts every request's K
            codes = slot_codes(self.suffix.drafts(req_ids, texts, k), k, self.level_vocab)
            self.counters.record_lookup(codes >= 0, drafter_ran=True)
            return Plan([], None, True, codes)
        proposals = self.suffix.propose(req_ids, texts, k)
        drafter_k = self._drafter_k(proposals)
        runs = not lookups_suffice(proposals, k, self.rows_stay_wide, drafter_k)
        if runs:
            self._scored_rows = drafter_rows_kept(k, drafter_k, self.rows_stay_wide)
        return Plan(proposals, drafter_k, runs)

    def fill(self, drafts: torch.Tensor, plan: Plan, draft_probs: torch.Tensor | None) -> None:
        """Put the lookups' proposals into `drafts` [batch, K] (in place), with their
        one-hot distributions where sampling uses the drafter's, and keep each
        request's draft length for `take_lengths`."""
        from_lookup = write_drafts(drafts, plan.proposals)
        if draft_probs is not None:
            make_lookup_probs_one_hot(draft_probs, drafts, from_lookup)
        gated_off = (not plan.drafter_runs and plan.drafter_k == 0
                     and self.drafter_k != 0)  # by the gate
        self.counters.record_lookup(from_lookup, plan.drafter_runs, gated_off)
        lengths = draft_lengths(from_lookup, plan.drafter_k)
        req_ids = self._runner.input_batch.req_ids[: drafts.shape[0]]
        self._lengths = dict(zip(req_ids, lengths, strict=True))

    def one_hot(self, drafts: torch.Tensor) -> torch.Tensor:
        return one_hot_probs(drafts, self.vocab_size)

    def take_scored_rows(self) -> int | None:
        rows, self._scored_rows = self._scored_rows, None  # this round's only
        return rows

    def take_lengths(self) -> dict[str, int] | None:
        lengths, self._lengths = self._lengths, None  # this round's only
        return lengths

    def _texts(self, num_reqs: int) -> StepTexts:
        """Each request's text as this step's drafts continue it, read in pieces
        (`StepTexts`: nothing is copied until the suffix lookup asks), once a step
        (`step_begins` forgets the last step's)."""
        if self._step_texts is None:
            assert self.sampled is not None
            sampled, discarded = self.sampled
            batch = self._runner.input_batch
            self._step_texts = StepTexts(batch.token_ids_cpu, batch.num_tokens_no_spec,
                                         sampled[:num_reqs], discarded)
        return self._step_texts

    def _drafter_k(self, proposals: list[Sequence[int]]) -> int | None:
        """How many of the drafter's tokens the requests without a lookup run draft this
        step: `lookup_drafter_k`, or 0 where the gate measured the lookups alone
        to serve faster at this batch size."""
        if self.gate is None or all(len(p) for p in proposals):
            return self.drafter_k  # not the gate's choice: the drafter would not run anyway
        return self.drafter_k if self.gate.choose() else 0
