"""vLLM's DFlash proposer as the plugin runs it, before the carryover method: our drafter
class built from the DFlash checkpoint with its kernels warmed, steps that draft nothing
(K = 0) storing only the new context, and a cheaper greedy sample on a CPU."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_carryover import kernels
from vllm_carryover.drafter.vllm_model import ARCHITECTURE


class DFlashBase(DFlashProposer):
    """DFlash with the plugin's drafter; `CarryoverProposer` adds the method on top."""

    def _drafts_nothing(self) -> None:
        """This step proposes no token: as vLLM's propose would set K, and no draft
        distribution for the runner to verify against."""
        self.num_speculative_tokens = 0
        self._last_draft_probs = None

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
        self._drafts_nothing()
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
