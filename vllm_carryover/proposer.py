"""CarryoverProposer: vLLM's DFlash proposer that keeps rejected target states.

After each verify step vLLM hands the proposer the target's hidden states of
every verified row, rejected drafts included. DFlash projects them all and then
lets the next query block overwrite the rejected ones. This proposer marks the
rejected rows (the drafter adds its rejected embedding to them) and moves the
query block past them, so the next draft attends to them (see `slot`).
A drafter with a Markov head (the semi-autoregressive variant) then picks its
block left to right instead of in one parallel sample (`markov_head`). Near the
drafter's length limit, requests that still fit keep drafting (`length_limit`).
With `"prompt_lookup": true`, requests whose text repeats take the n-gram
matcher's draft instead of the drafter's (`lookups.prompt`); with `"corpus_lookup":
true`, requests whose text ends in a phrase the target often writes take its usual
continuation (`lookups.corpus`); with K by goodput too, whether the drafter drafts for
the others is measured (`control.drafter_gate`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_carryover import kernels
from vllm_carryover.config import CarryoverSettings
from vllm_carryover.control.drafter_gate import DrafterGate
from vllm_carryover.control.step_timer import StepTimer
from vllm_carryover.draft_trace import DraftTrace
from vllm_carryover.drafter.markov_head import draft_left_to_right
from vllm_carryover.drafter.vllm_model import ARCHITECTURE
from vllm_carryover.length_limit import LengthLimit
from vllm_carryover.lookups.corpus import CORPUS_FILE, CorpusTable
from vllm_carryover.lookups.prompt import (
    PromptLookup,
    Propose,
    draft_lengths,
    drafter_rows_kept,
    first_proposals,
    lookups_suffice,
    make_lookup_probs_one_hot,
    one_hot_probs,
    score_leading_rows,
    texts_of,
    write_drafts,
)
from vllm_carryover.metrics import CarryoverCounters
from vllm_carryover.slot import SlotLayout, plan_slots, shift_query_slots
from vllm_carryover.slot_table import ENV_CHECK, SlotTable, checks_enabled, round_slots

if TYPE_CHECKING:
    import numpy as np

logger = init_logger(f"vllm.{__name__}")  # under vLLM's configured logger
GATE_LOG_EVERY = 256  # counted cycles between logs of the drafter gate's choices


def _tp_rank() -> int:
    """This worker's rank in its tensor-parallel group (0 when there is none)."""
    from vllm.distributed import parallel_state

    try:
        return parallel_state.get_tp_group().rank_in_group
    except AssertionError:  # no model-parallel group (a bare proposer in a unit test)
        return 0


class CarryoverProposer(DFlashProposer):
    """DFlash drafting whose next block also attends to the last round's rejected states."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner: Any = None):
        super().__init__(vllm_config, device, runner)
        self.settings = CarryoverSettings.from_hf_config(self.draft_model_config.hf_config)
        self.counters = CarryoverCounters.for_this_process(_tp_rank())
        self._layout: SlotLayout | None = None
        self._bonus: torch.Tensor | None = None  # this round's bonus tokens [batch]
        self.length_limit = LengthLimit(1 + self.num_speculative_tokens)  # the runner plans it
        self.trace = DraftTrace.from_env()
        self.step_timer = StepTimer.from_env(device)
        self._runner = runner  # for request ids in traces and slot checks
        self.slot_table: SlotTable | None = None  # built on the first checked round
        self.check_slots = checks_enabled()
        if self.check_slots:
            logger.info("Carryover slot ownership is checked every round (%s=1).", ENV_CHECK)
        logger.info("Carryover drafting: context from rejected states is %s.",
                    "on" if self.settings.enabled else "off (matched baseline)")
        if markov := getattr(self.draft_model_config.hf_config, "markov_rank", 0):
            logger.info("Semi-autoregressive drafter: a Markov head of rank %d drafts each "
                        "block left to right.", markov)
        # each a `propose(text, K)`, tried in this order for the requests not yet matched
        self.lookups: list[Propose] = []
        # async scheduling verifies whole K-wide rows; sync keeps `kept_drafts`' lengths
        self._rows_stay_wide = bool(vllm_config.scheduler_config.async_scheduling)
        self._vocab_size = vllm_config.model_config.get_vocab_size()
        self._sampled: tuple[torch.Tensor, torch.Tensor] | None = None  # for the lookups
        self._draft_lengths: dict[str, int] | None = None  # this round's, set by the lookups
        self._scored_rows: int | None = None  # of the drafter's K this round (None: all)
        if self.settings.prompt_lookup:
            self.lookups.append(PromptLookup(self.settings.prompt_lookup_min,
                                             self.settings.prompt_lookup_max,
                                             vllm_config.model_config.max_model_len).propose)
            logger.info("Prompt lookup: requests whose last %d-%d tokens occur earlier in "
                        "their text draft what followed them there.",
                        self.settings.prompt_lookup_min, self.settings.prompt_lookup_max)
        if self.settings.corpus_lookup:
            path = Path(self.draft_model_config.model) / CORPUS_FILE
            corpus = CorpusTable.load(path)
            self.lookups.append(corpus.propose)
            logger.info("Corpus lookup: %d contexts from %s.", len(corpus), path)
        # With K by goodput, whether the drafter drafts beside the lookups is measured
        # too. Only synchronous scheduling lets a request verify fewer than K drafts.
        self.gate: DrafterGate | None = None
        if (self.lookups and self.settings.goodput_k and self.settings.drafter_gate
                and not self._rows_stay_wide and self.settings.prompt_lookup_drafter_k != 0):
            self.gate = DrafterGate()
            logger.info("Drafter beside the lookups: on or off per batch size by measured "
                        "goodput.")

    @override
    def propose(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.step_timer is None:
            return self._draft(*args, **kwargs)
        with self.step_timer.step(self, args, kwargs) as step:  # the draft-step benchmark
            drafts = self._draft(*args, **kwargs)
            step.carried = int(self._layout.carried.sum()) if self._layout is not None else 0
        return drafts

    def _draft(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        k = kwargs.get("num_speculative_tokens")
        cad: CommonAttentionMetadata = kwargs["common_attn_metadata"]
        if self.gate is not None:
            self._gate_step(cad.batch_size())
        if k == 0:
            return self._keep_context_only(**kwargs)
        if not self.lookups:
            return super().propose(*args, **kwargs)
        proposals = first_proposals(self._texts(cad.batch_size()), self.lookups, k)
        drafter_k = self._drafter_k(proposals)
        if not lookups_suffice(proposals, k, self._rows_stay_wide, drafter_k):
            self._scored_rows = drafter_rows_kept(k, drafter_k, self._rows_stay_wide)
            drafts = super().propose(*args, **kwargs)
            self._use_lookups(drafts, proposals, drafter_k, drafter_ran=True)
            return drafts
        # Every request drafts a lookup's tokens: the drafter's forward would only be
        # overwritten, so the step just stores the new context, as a K = 0 step does.
        self._keep_context_only(**kwargs)
        drafts = torch.zeros((len(proposals), k), dtype=torch.int64,
                             device=kwargs["target_hidden_states"].device)
        self._use_lookups(drafts, proposals, drafter_k, drafter_ran=False)
        if self._enable_probabilistic_draft_probs and not kwargs["sampling_metadata"].all_greedy:
            # else the runner would verify these drafts against an older step's probs
            self._last_draft_probs = one_hot_probs(drafts, self._vocab_size)
        return drafts

    @override
    def prepare_next_token_ids_padded(self, sampled_token_ids: torch.Tensor, requests: Any,
                                      gpu_input_batch: Any, discard_request_mask: torch.Tensor
                                      ) -> tuple[torch.Tensor, torch.Tensor]:
        # The runner calls this just before `propose` with this step's sampled tokens,
        # which the lookup needs: vLLM adds them to its token table only after drafting.
        self._sampled = (sampled_token_ids, discard_request_mask)
        return super().prepare_next_token_ids_padded(
            sampled_token_ids, requests, gpu_input_batch, discard_request_mask)

    def _texts(self, num_reqs: int) -> list[np.ndarray | None]:
        """Each request's text as this step's drafts continue it (`texts_of`)."""
        assert self._sampled is not None
        sampled, discarded = self._sampled
        batch = self._runner.input_batch
        return texts_of(batch.token_ids_cpu, batch.num_tokens_no_spec, sampled[:num_reqs],
                        discarded)

    def _drafter_k(self, proposals: list[Sequence[int]]) -> int | None:
        """How many of the drafter's tokens the requests without a lookup run draft this
        step: `prompt_lookup_drafter_k`, or 0 where the gate measured the lookups alone
        to serve faster at this batch size."""
        drafter_k = self.settings.prompt_lookup_drafter_k
        if self.gate is None or all(len(p) for p in proposals):
            return drafter_k  # not the gate's choice: the drafter would not run anyway
        return drafter_k if self.gate.choose() else 0

    def _gate_step(self, num_reqs: int) -> None:
        """Tell the gate that a step begins, and what the verification since the last
        `propose` call emitted."""
        assert self.gate is not None
        now, tokens = time.perf_counter(), None
        if self._sampled is not None:
            sampled, discarded = self._sampled
            # one read from the device for both counts
            in_prefill, emitted = torch.stack((discarded[:num_reqs].sum(),
                                               (sampled[:num_reqs] >= 0).sum())).tolist()
            if not in_prefill:  # no request in a prefill chunk
                tokens = emitted
        req_ids = tuple(self._runner.input_batch.req_ids[:num_reqs])
        if self.gate.step(now, req_ids, tokens) and self.gate.counted % GATE_LOG_EVERY == 0:
            logger.info("Drafter beside the lookups, per batch size: %s (choice; tokens/s "
                        "with the drafter, with the lookups alone)", self.gate.summary())

    def _use_lookups(self, drafts: torch.Tensor, proposals: list[Sequence[int]],
                     drafter_k: int | None, drafter_ran: bool) -> None:
        """Put the lookups' proposals into `drafts` [batch, K] (in place), with their
        one-hot distributions where sampling uses the drafter's, and keep each
        request's draft length for `kept_drafts`."""
        from_lookup = write_drafts(drafts, proposals)
        if self._last_draft_probs is not None:
            make_lookup_probs_one_hot(self._last_draft_probs, drafts, from_lookup)
        gated_off = (not drafter_ran and drafter_k == 0
                     and self.settings.prompt_lookup_drafter_k != 0)  # by the gate
        self.counters.record_lookup(from_lookup, drafter_ran, gated_off)
        lengths = draft_lengths(from_lookup, drafter_k)
        req_ids = self._runner.input_batch.req_ids[: drafts.shape[0]]
        self._draft_lengths = dict(zip(req_ids, lengths, strict=True))

    def kept_drafts(self, req_ids: list[str], drafts: list[list[int]]) -> list[list[int]]:
        """The drafts the runner hands the scheduler (vLLM's synchronous scheduling, the
        CPU default): none for requests over the length limit, and with prompt lookup
        each request's lookup run or the drafter's first tokens (`draft_lengths`)."""
        lengths, self._draft_lengths = self._draft_lengths, None  # this round's only
        if self.length_limit.over_req_ids:
            drafts = self.length_limit.drop_drafts(req_ids, drafts)
        if lengths is None:
            return drafts
        return [d[: lengths.get(r, len(d))] for r, d in zip(req_ids, drafts, strict=True)]

    def _keep_context_only(self, *, target_token_ids: torch.Tensor,
                           target_positions: torch.Tensor, target_hidden_states: torch.Tensor,
                           next_token_ids: torch.Tensor,
                           token_indices_to_sample: torch.Tensor | None,
                           common_attn_metadata: CommonAttentionMetadata,
                           num_rejected_tokens_gpu: torch.Tensor | None = None,
                           **_: Any) -> torch.Tensor:
        """A step that drafts nothing (K = 0, vLLM's dynamic K): only the new target
        states' K/V go into the drafter's context, which later drafts need. vLLM's
        DFlash also runs the drafter over one query row per request here, whose
        output nobody reads and whose K/V the next context overwrites (2.3 of the
        4.3 ms such a step spent drafting at batch 16 on a 2-core CPU)."""
        self.num_speculative_tokens = 0
        self._last_draft_probs = None
        num_query, _, _ = self.set_inputs_first_pass(
            target_token_ids, next_token_ids, target_positions,
            self.model.combine_hidden_states(target_hidden_states),
            token_indices_to_sample, common_attn_metadata, num_rejected_tokens_gpu)
        self.build_model_inputs_first_pass(num_query, num_query, None)  # stores the K/V
        return torch.empty(common_attn_metadata.batch_size(), 0, dtype=torch.int64,
                           device=target_hidden_states.device)

    @override
    def load_model(self, target_model: torch.nn.Module) -> None:
        super().load_model(target_model)
        if kernels.backend() != "reference":  # Triton compiles lazily; the reference needs none
            self.model.model.warm_up_kernels()

    @override
    def _get_model(self) -> torch.nn.Module:
        # Worker-local: build our drafter class from the DFlash checkpoint.
        self.draft_model_config.hf_config.architectures = [ARCHITECTURE]
        return super()._get_model()

    @override
    def set_inputs_first_pass(
        self,
        target_token_ids: torch.Tensor,
        next_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        cad: CommonAttentionMetadata,
        num_rejected_tokens_gpu: torch.Tensor | None,
    ) -> tuple[int, torch.Tensor, CommonAttentionMetadata]:
        positions, num_rejected = target_positions, num_rejected_tokens_gpu
        over = self.length_limit.over
        if over is not None:  # some requests are over the drafter's limit: see length_limit
            positions = self.length_limit.clamp_positions(
                target_positions[: target_token_ids.shape[0]], cad.query_start_loc)
            if num_rejected is not None:  # and carry nothing over for them
                num_rejected = num_rejected.masked_fill(over, 0)
        num_query, indices, new_cad = super().set_inputs_first_pass(
            target_token_ids, next_token_ids, positions, target_hidden_states,
            token_indices_to_sample, cad, num_rejected,
        )
        self._layout = None
        self._bonus = next_token_ids[: cad.batch_size()]
        if self.trace is not None:
            batch = cad.batch_size()
            self.trace.begin(
                req_ids=list(self._runner.input_batch.req_ids[:batch]),
                query_start_loc=cad.query_start_loc[: batch + 1],
                positions=target_positions[: target_hidden_states.shape[0]],
                states=target_hidden_states,
                num_rejected=(num_rejected_tokens_gpu if num_rejected_tokens_gpu is not None
                              else torch.zeros(batch, dtype=torch.int32)),
                next_token_ids=next_token_ids[:batch],
                query_positions=self.positions[:num_query],
                carryover=torch.tensor(self.settings.enabled),
            )
        if self.settings.enabled and num_rejected is not None:
            q = 1 + self.num_speculative_tokens
            layout = plan_slots(cad.query_start_loc, num_rejected,
                                target_hidden_states.shape[0], self.num_speculative_tokens)
            self._slot_mapping_buffer[:num_query] = shift_query_slots(
                self.positions, layout.carried, q, cad.block_table_tensor, self.block_size)
            # DFlash cut seq_lens by num_rejected; give back the carried part.
            new_cad.seq_lens = new_cad.seq_lens + layout.carried
            self._layout = layout
            self.counters.record(layout.carried)
        if over is not None:
            new_cad.seq_lens = self.length_limit.disable(
                self._context_slot_mapping_buffer[: target_token_ids.shape[0]],
                self._slot_mapping_buffer[:num_query], cad.query_start_loc, new_cad.seq_lens)
        if self.check_slots:
            self._check_slots(cad, new_cad, num_query)
        return num_query, indices, new_cad

    def _check_slots(self, cad: CommonAttentionMetadata, new_cad: CommonAttentionMetadata,
                     num_query: int) -> None:
        """Record who owns which slot this round and fail loudly on any misplacement."""
        if self.slot_table is None:
            self.slot_table = SlotTable(self.num_speculative_tokens, self.block_size,
                                        self.max_batch_size)
        batch = cad.batch_size()
        layout = self._layout
        q = 1 + self.num_speculative_tokens
        slots = round_slots(
            req_ids=list(self._runner.input_batch.req_ids[:batch]),
            committed=self.positions[: batch * q : q],  # each block starts at its bonus token
            rejected_rows=layout.rejected_rows if layout is not None else None,
            query_start_loc=cad.query_start_loc,
            context_slot_mapping=self._context_slot_mapping_buffer[: self._dflash_num_context],
            query_slot_mapping=self._slot_mapping_buffer[:num_query],
            seq_lens=new_cad.seq_lens,
            block_table=cad.block_table_tensor,
        )
        # Requests over the length limit write no slot (and never draft again).
        self.slot_table.update([s for s in slots if s.req_id not in self.length_limit.over_req_ids])

    @override
    def build_model_inputs_first_pass(
        self,
        num_tokens: int,
        num_input_tokens: int,
        mm_embed_inputs: Any,
    ) -> tuple[dict[str, Any], int]:
        num_context = self._dflash_num_context
        rejected = self._layout.rejected_rows if self._layout is not None else None
        self.model.precompute_and_store_context_kv(
            self._dflash_hidden_states,
            self._context_positions_buffer[:num_context],
            self._context_slot_mapping_buffer[:num_context],
            rejected,
        )
        return (
            dict(
                input_ids=self.input_ids[:num_input_tokens],
                positions=self._get_positions(num_input_tokens),
                inputs_embeds=None,
            ),
            num_input_tokens,
        )

    @override
    def _greedy_sample(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Two costs of vLLM's greedy drafting that matter on a CPU, where they were
        # measured (docs/results.md): torch's CPU argmax over a 49k-token row is ~3x
        # slower than max(-1).indices, which picks the same (first) maximum; and with a
        # draft vocabulary vLLM scatters the draft logits into the whole vocabulary
        # (-inf elsewhere) before that argmax. The maximum over the draft rows, mapped
        # through d2t, is the same token (d2t is increasing, so ties too).
        if self.use_local_argmax_reduction:
            return super()._greedy_sample(hidden_states)
        d2t = getattr(self.model, "draft_id_to_target_id", None)
        if d2t is None:
            return self.model.compute_logits(hidden_states).max(dim=-1).indices
        logits = self.model.logits_processor(self.model.lm_head, hidden_states)
        draft_ids = logits.max(dim=-1).indices
        return draft_ids + d2t[draft_ids]

    @override
    def _sample_draft_tokens(self, hidden_states: torch.Tensor,
                             sampling_metadata: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows, self._scored_rows = self._scored_rows, None  # this round's only
        head = self.model.markov_head
        if head is None:
            if self.trace is not None:
                self.trace.finish(self.model.compute_logits(hidden_states))
            k, sample = self.num_speculative_tokens, super()._sample_draft_tokens
            return score_leading_rows(hidden_states, k, k if rows is None else rows,
                                      lambda leading: sample(leading, sampling_metadata))
        logits = self.model.compute_logits(hidden_states)  # [batch * K, V], request-major
        assert self._bonus is not None
        tokens, probs = draft_left_to_right(
            logits.view(-1, self.num_speculative_tokens, logits.shape[-1]), self._bonus, head,
            lambda slot_logits: self._sample_from_logits(slot_logits, sampling_metadata))
        if self.trace is not None:
            self.trace.finish(logits, tokens)
        return tokens.flatten(), None if probs is None else probs.flatten(0, 1)
