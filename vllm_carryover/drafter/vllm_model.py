"""The drafter as a vLLM model: vLLM's DFlash drafter plus the rejected-state path.

The query side (bonus + mask tokens through the drafter layers) is vLLM's
DFlash code unchanged. The context side is replaced by `kernels.project_context_kv`,
which also serves rejected states: they get the learned `rejected_embedding`
added after the hidden norm. The proposer decides which rows are rejected and
where their K/V go in the paged cache. A checkpoint with `markov_rank` > 0 also
gets the Markov head (`markov_head.py`), which the proposer drafts with; one whose
slots read confidence levels (`lookups.slots`) gets their embedding, added to each
query token's as the slot codes in its query ids say.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM, DFlashQwen3Model

from vllm_carryover.drafter.format import REJECTED_EMBEDDING, SLOT_CONFIDENCE
from vllm_carryover.drafter.markov_head import MarkovHead
from vllm_carryover.kernels import ContextProjectionWeights, project_context_kv
from vllm_carryover.lookups.slots import levels_of, slot_settings, split_codes

logger = init_logger(f"vllm.{__name__}")  # under vLLM's configured logger

ARCHITECTURE = "CarryoverDraftModel"
# Row counts that reach every compiled variant of the context projection: each tile
# height of its epilogue (16, 32, 64 rows, `projection_launches`) and Triton's own
# specialisation of the row count (1, a multiple of 16, anything else).
WARMUP_ROWS = (1, 2, 16, 17, 32, 33, 64, 65)


class CarryoverDFlashModel(DFlashQwen3Model):
    """DFlash drafter body with the rejected-state embedding (and, for a drafter that
    reads them, the slots' confidence-level embedding)."""

    def __init__(self, *, vllm_config: VllmConfig, start_layer_id: int = 0,
                 prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, start_layer_id=start_layer_id,
                         prefix=prefix)
        dtype = vllm_config.model_config.dtype
        self.rejected_embedding = nn.Parameter(
            torch.zeros(self.config.hidden_size, dtype=dtype), requires_grad=False)
        levels = levels_of(slot_settings(self.config))
        self.slot_confidence = nn.Parameter(
            torch.zeros(levels, self.config.hidden_size, dtype=dtype), requires_grad=False
        ) if levels else None
        self._projection: ContextProjectionWeights | None = None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.slot_confidence is None:
            return super().embed_input_ids(input_ids)
        ids, levels = split_codes(input_ids, self.config.vocab_size)
        return super().embed_input_ids(ids) + self.slot_confidence[levels]

    def _build_fused_kv_buffers(self) -> None:
        super()._build_fused_kv_buffers()
        if self._fused_kv_weight is None:
            raise NotImplementedError("carryover drafting needs an unquantized drafter")
        cache = self._rope_cos_sin_cache
        self._projection = ContextProjectionWeights(
            hidden_norm_weight=self._hidden_norm_weight,
            rejected_embedding=self.rejected_embedding.data,
            kv_weight=self._fused_kv_weight,
            kv_bias=self._fused_kv_bias,
            k_norm_weight=self._k_norm_weights,
            cos_sin_cache=cache,
            num_layers=self._num_attn_layers,
            num_kv_heads=self._num_kv_heads,
            head_dim=self._head_dim,
            eps=self._rms_norm_eps,
            is_neox_style=self._rope_is_neox,
        )

    def precompute_and_store_context_kv(
        self,
        context_states: torch.Tensor,
        context_positions: torch.Tensor,
        context_slot_mapping: torch.Tensor | None = None,
        rejected_rows: torch.Tensor | None = None,
    ) -> None:
        """Project context states (committed and rejected) and write their K/V."""
        if self._projection is None:
            self._build_fused_kv_buffers()
        assert self._projection is not None
        k, v = project_context_kv(context_states, context_positions, rejected_rows,
                                  self._projection)
        if context_slot_mapping is None:
            return
        v_scale = getattr(self.layers[0].self_attn, "v_scale", None)
        if v_scale is not None:
            v = v * v_scale
        for i, attn in enumerate(self._attn_layers):
            attn.impl.do_kv_cache_update(attn, k[i], v[i], attn.kv_cache,
                                         context_slot_mapping)


    def warm_up_kernels(self) -> None:
        """Run the context projection once per compiled variant (see `WARMUP_ROWS`), so
        that Triton compiles them all at startup rather than on the first requests that
        need them: vLLM's dummy run drafts without rejected rows, at one batch size."""
        if self._projection is None:
            self._build_fused_kv_buffers()
        assert self._projection is not None
        weight = self._projection.kv_weight
        for rows in WARMUP_ROWS:
            states = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
            positions = torch.zeros(rows, dtype=torch.int64, device=weight.device)
            for rejected in (None, torch.ones(rows, dtype=torch.bool, device=weight.device)):
                project_context_kv(states, positions, rejected, self._projection)


class CarryoverDraftModel(DFlashQwen3ForCausalLM):
    """Registered with vLLM as `CarryoverDraftModel`; loads DFlash checkpoints too."""

    model_cls = CarryoverDFlashModel

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        rank = getattr(self.config, "markov_rank", 0) or 0
        self.markov_head = MarkovHead(self.config.vocab_size, rank) if rank else None

    def precompute_and_store_context_kv(
        self,
        context_states: torch.Tensor,
        context_positions: torch.Tensor,
        context_slot_mapping: torch.Tensor | None = None,
        rejected_rows: torch.Tensor | None = None,
    ) -> None:
        self.model.precompute_and_store_context_kv(
            context_states, context_positions, context_slot_mapping, rejected_rows
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        found = False
        head = dict(self.markov_head.named_parameters(prefix="markov_head")) \
            if self.markov_head is not None else {}
        rest = []
        for name, tensor in weights:
            if name.endswith(REJECTED_EMBEDDING):
                self.model.rejected_embedding.data.copy_(tensor.reshape(-1))
                found = True
            elif name.endswith(SLOT_CONFIDENCE) and self.model.slot_confidence is not None:
                self.model.slot_confidence.data.copy_(tensor)
            elif (own := next((k for k in head if name.endswith(k)), None)) is not None:
                head.pop(own).data.copy_(tensor)
            else:
                rest.append((name, tensor))
        if head:
            raise ValueError(f"drafter checkpoint lacks the Markov head weights {sorted(head)}")
        if not found:
            logger.info(
                "Drafter checkpoint has no %s: it starts at zero, so rejected states "
                "enter the drafter unmarked (a plain DFlash checkpoint).", REJECTED_EMBEDDING)
        super().load_weights(rest)
