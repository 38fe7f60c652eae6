"""CarryoverProposer: vLLM's DFlash proposer that keeps rejected target states.

After each verify step vLLM hands the proposer the target's hidden states of
every verified row, rejected drafts included. DFlash projects them all and then
lets the next query block overwrite the rejected ones. This proposer marks the
rejected rows (the drafter adds its rejected embedding to them) and moves the
query block past them, so the next draft attends to them (see `slot`).
A drafter with a Markov head (the semi-autoregressive variant) then picks its
block left to right instead of in one parallel sample (`markov_head`). Near the
drafter's length limit, requests that still fit keep drafting (`length_limit`).
With `"suffix_lookup": true`, requests whose text continues in arctic-inference's
suffix trees of their own text and of past answers take the trees' draft instead of
the drafter's (`lookups.suffix`, `lookups.drafts`); with K by goodput too, whether the
drafter drafts for the others is measured (`control.drafter_gate`). A drafter trained
on the lookup's proposals in its slots gets them there instead (`lookups.slots`).

The proposer holds the method; its collaborators: `Lookups` (`lookups.beside`: the
lookups, the gate and their per-round state), `LengthLimit`, the observers that read a
round (`round_observers`: trace, slot checks), `DeferredContext` (a step that drafts
nothing keeps its target states for the next context write) and `DFlashBase` (DFlash as
the plugin runs it: the drafter class, steps that only store context, the CPU greedy
sample).
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_carryover.config import CarryoverSettings
from vllm_carryover.control.step_timer import StepTimer
from vllm_carryover.deferred_context import DeferredContext
from vllm_carryover.dflash_base import DFlashBase
from vllm_carryover.draft_trace import DraftTrace
from vllm_carryover.drafter.markov_head import draft_left_to_right
from vllm_carryover.length_limit import LengthLimit
from vllm_carryover.lookups.beside import Lookups
from vllm_carryover.lookups.drafts import score_leading_rows
from vllm_carryover.lookups.slots import fill_query_slots, slot_settings
from vllm_carryover.metrics import CarryoverCounters
from vllm_carryover.round_observers import SlotChecks, trace_round
from vllm_carryover.slot import SlotLayout, plan_slots, shift_query_slots

logger = init_logger(f"vllm.{__name__}")  # under vLLM's configured logger


def _tp_rank() -> int:
    """This worker's rank in its tensor-parallel group (0 when there is none)."""
    from vllm.distributed import parallel_state

    try:
        return parallel_state.get_tp_group().rank_in_group
    except AssertionError:  # no model-parallel group (a bare proposer in a unit test)
        return 0


class CarryoverProposer(DFlashBase):
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
        self.slot_checks = SlotChecks.from_env()
        self.deferred = DeferredContext()  # K = 0 steps' target states, written late
        logger.info("Carryover drafting: context from rejected states is %s.",
                    "on" if self.settings.enabled else "off (matched baseline)")
        if markov := getattr(self.draft_model_config.hf_config, "markov_rank", 0):
            logger.info("Semi-autoregressive drafter: a Markov head of rank %d drafts each "
                        "block left to right.", markov)
        # the suffix lookup beside the drafter (with the gate and its round's state), or
        # in its slots for a drafter trained on them
        self.lookups = Lookups.build(self.settings, vllm_config, self.draft_model_config.model,
                                     runner, self.counters,
                                     slot_settings(self.draft_model_config.hf_config))
        self._slot_codes: torch.Tensor | None = None  # this step's, for the query blocks

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
        num_reqs = kwargs["common_attn_metadata"].batch_size()
        lookups = self.lookups
        if lookups is not None:
            lookups.step_begins(num_reqs)
        if k == 0 and self._keeps_for_later(**kwargs):
            return kwargs["target_hidden_states"].new_empty((num_reqs, 0), dtype=torch.int64)
        self.deferred.write(self.model)  # before this step's context, which may reuse slots
        if k == 0:
            return self._keep_context_only(**kwargs)
        if lookups is None:
            return super().propose(*args, **kwargs)
        plan = lookups.plan(num_reqs, k)
        if lookups.into_slots:  # `set_inputs_first_pass` puts them in the query blocks
            self._slot_codes = plan.slot_codes
            return super().propose(*args, **kwargs)
        if plan.drafter_runs:
            drafts = super().propose(*args, **kwargs)
            lookups.fill(drafts, plan, self._last_draft_probs)
            return drafts
        # Every request drafts a lookup's tokens: the drafter's forward would only be
        # overwritten, so the step just stores the new context, as a K = 0 step does.
        self._keep_context_only(**kwargs)
        drafts = torch.zeros((len(plan.proposals), k), dtype=torch.int64,
                             device=kwargs["target_hidden_states"].device)
        lookups.fill(drafts, plan, self._last_draft_probs)
        if self._enable_probabilistic_draft_probs and not kwargs["sampling_metadata"].all_greedy:
            # else the runner would verify these drafts against an older step's probs
            self._last_draft_probs = lookups.one_hot(drafts)
        return drafts

    def _keeps_for_later(self, *, target_positions: torch.Tensor,
                         target_hidden_states: torch.Tensor,
                         common_attn_metadata: CommonAttentionMetadata,
                         num_rejected_tokens_gpu: torch.Tensor | None = None,
                         **kwargs: Any) -> bool:
        """Keep a K = 0 step's target states for the next step that writes context
        (`deferred_context`), unless it must write them now: it verified drafts (the
        rejected rows belong to this round's slot; `_keep_context_only` places them) or
        some request is past the drafter's length limit (its rows are dropped there).
        (vLLM hands over a count of rejected drafts, zeros included, whenever it
        speculates.)"""
        if self.length_limit.over is not None or (
                num_rejected_tokens_gpu is not None and bool(num_rejected_tokens_gpu.any())):
            return False
        self._drafts_nothing()
        if self.trace is not None:  # the rows as the drafter will read them
            trace_round(self.trace, self, common_attn_metadata, target_positions,
                        self.model.combine_hidden_states(target_hidden_states),
                        num_rejected_tokens_gpu, kwargs["next_token_ids"], 0)
        if self.deferred.keep(target_hidden_states, target_positions,
                              common_attn_metadata.slot_mapping):
            self.deferred.write(self.model)  # enough kept
        return True

    @override
    def prepare_next_token_ids_padded(self, sampled_token_ids: torch.Tensor, requests: Any,
                                      gpu_input_batch: Any, discard_request_mask: torch.Tensor
                                      ) -> tuple[torch.Tensor, torch.Tensor]:
        # The runner calls this just before `propose` with this step's sampled tokens,
        # which the lookup needs: vLLM adds them to its token table only after drafting.
        if self.lookups is not None:
            self.lookups.sampled = (sampled_token_ids, discard_request_mask)
        return super().prepare_next_token_ids_padded(
            sampled_token_ids, requests, gpu_input_batch, discard_request_mask)

    def kept_drafts(self, req_ids: list[str], drafts: list[list[int]]) -> list[list[int]]:
        """The drafts the runner hands the scheduler (vLLM's synchronous scheduling, the
        CPU default): none for requests over the length limit, and with prompt lookup
        each request's lookup run or the drafter's first tokens (`draft_lengths`)."""
        lengths = self.lookups.take_lengths() if self.lookups is not None else None
        if self.length_limit.over_req_ids:
            drafts = self.length_limit.drop_drafts(req_ids, drafts)
        if lengths is None:
            return drafts
        return [d[: lengths.get(r, len(d))] for r, d in zip(req_ids, drafts, strict=True)]

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
        if self._slot_codes is not None:
            fill_query_slots(self.input_ids, self._slot_codes, self.num_speculative_tokens)
            self._slot_codes = None
        if self.trace is not None:
            trace_round(self.trace, self, cad, target_positions, target_hidden_states,
                        num_rejected_tokens_gpu, next_token_ids, num_query)
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
        if self.slot_checks is not None:
            self.slot_checks.check(self, cad, new_cad, num_query)
        return num_query, indices, new_cad

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
    def _sample_draft_tokens(self, hidden_states: torch.Tensor,
                             sampling_metadata: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = self.lookups.take_scored_rows() if self.lookups is not None else None
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
