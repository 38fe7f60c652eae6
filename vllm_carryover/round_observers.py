"""What reads a drafting round and changes nothing in it: the draft trace
(`draft_trace`) and the slot checks (`slot_table`), each called by the proposer
once per round after it placed the round's context and query slots."""

from __future__ import annotations

from typing import Any

import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_carryover.draft_trace import DraftTrace
from vllm_carryover.slot_table import ENV_CHECK, SlotTable, checks_enabled, round_slots

logger = init_logger(f"vllm.{__name__}")  # under vLLM's configured logger


def trace_round(trace: DraftTrace, proposer: Any, cad: CommonAttentionMetadata,
                target_positions: torch.Tensor, target_hidden_states: torch.Tensor,
                num_rejected_tokens_gpu: torch.Tensor | None, next_token_ids: torch.Tensor,
                num_query: int) -> None:
    """Record a round's inputs as the runner handed them to the proposer."""
    batch = cad.batch_size()
    trace.begin(
        req_ids=list(proposer._runner.input_batch.req_ids[:batch]),
        query_start_loc=cad.query_start_loc[: batch + 1],
        positions=target_positions[: target_hidden_states.shape[0]],
        states=target_hidden_states,
        num_rejected=(num_rejected_tokens_gpu if num_rejected_tokens_gpu is not None
                      else torch.zeros(batch, dtype=torch.int32)),
        next_token_ids=next_token_ids[:batch],
        query_positions=proposer.positions[:num_query],
        query_ids=proposer.input_ids[:num_query],
        carryover=torch.tensor(proposer.settings.enabled),
    )


class SlotChecks:
    """Who owns which slot, checked every round (with `VLLM_CARRYOVER_CHECK_SLOTS=1`)."""

    def __init__(self) -> None:
        self.table: SlotTable | None = None  # built on the first checked round

    @classmethod
    def from_env(cls) -> SlotChecks | None:
        if not checks_enabled():
            return None
        logger.info("Carryover slot ownership is checked every round (%s=1).", ENV_CHECK)
        return cls()

    def check(self, proposer: Any, cad: CommonAttentionMetadata,
              new_cad: CommonAttentionMetadata, num_query: int) -> None:
        """Record who owns which slot this round and fail loudly on any misplacement."""
        p = proposer
        if self.table is None:
            self.table = SlotTable(p.num_speculative_tokens, p.block_size, p.max_batch_size)
        batch = cad.batch_size()
        layout = p._layout
        q = 1 + p.num_speculative_tokens
        slots = round_slots(
            req_ids=list(p._runner.input_batch.req_ids[:batch]),
            committed=p.positions[: batch * q : q],  # each block starts at its bonus token
            rejected_rows=layout.rejected_rows if layout is not None else None,
            query_start_loc=cad.query_start_loc,
            context_slot_mapping=p._context_slot_mapping_buffer[: p._dflash_num_context],
            query_slot_mapping=p._slot_mapping_buffer[:num_query],
            seq_lens=new_cad.seq_lens,
            block_table=cad.block_table_tensor,
        )
        # Requests over the length limit write no slot (and never draft again).
        over = p.length_limit.over_req_ids
        self.table.update([s for s in slots if s.req_id not in over])
