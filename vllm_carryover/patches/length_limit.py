"""The length limit: drafting decided per request, not per batch (patch 6).

6. `GPUModelRunner._input_fits_in_drafter` and `take_draft_token_ids`, when
   the first `CarryoverProposer` is built, acting only for a runner whose drafter
   is one: the length-limit rule per request instead of for the batch's longest
   one; requests over the limit get no drafts (`vllm_carryover.length_limit`), and with prompt
   lookup each request keeps its own number of drafts
   (`CarryoverProposer.kept_drafts`).
"""

from __future__ import annotations

from typing import Any


def _patch_runner_per_request_drafts() -> None:
    """Per-request drafting near the length limit, and per-request draft lengths with
    prompt lookup (`CarryoverProposer.kept_drafts`), for runners whose drafter asks.

    Applied when the first carryover proposer is built (in a worker, where the runner
    module is loaded anyway); runners with another drafter keep vLLM's behaviour."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner._input_fits_in_drafter, "_carryover", False):
        return
    fits, take = GPUModelRunner._input_fits_in_drafter, GPUModelRunner.take_draft_token_ids

    def _input_fits_in_drafter(self: Any, cad: Any) -> bool:
        limit = getattr(getattr(self, "drafter", None), "length_limit", None)
        if limit is None:
            return fits(self, cad)
        return limit.plan(cad, self.effective_drafter_max_model_len, self.input_batch.req_ids)

    def take_draft_token_ids(self: Any) -> Any:
        drafts = take(self)
        kept = getattr(getattr(self, "drafter", None), "kept_drafts", None)
        if drafts is None or kept is None:
            return drafts
        return type(drafts)(drafts.req_ids, kept(drafts.req_ids, drafts.draft_token_ids))

    _input_fits_in_drafter._carryover = True  # type: ignore[attr-defined]
    GPUModelRunner._input_fits_in_drafter = _input_fits_in_drafter
    GPUModelRunner.take_draft_token_ids = take_draft_token_ids
