"""The scheduler's goodput hook: K per step by measured goodput (patches 8 and 10).

8. `Scheduler.__init__`, `make_spec_decoding_stats` and `update_from_output`, acting
   only for a carryover config with `"num_speculative_tokens_per_batch_size":
   "goodput"`: vLLM's dynamic-K lookup asks `control.goodput_k.GoodputK` for each step's K,
   and the scheduler reports every verified request's accepted drafts and the time
   of every decode step to it.
10. `Scheduler.schedule` and `EngineCore.post_step`, carryover configs only, speed:
   after a step that drafted nothing (K = 0), the engine core does not ask the
   worker for its drafts (one IPC round trip per step on the critical path, 2.6 %
   of a served engine core's time at concurrency 16, where K by goodput is 0).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's configured logger
LOG_EVERY_STEPS = 256  # how often K by goodput logs its choice



def _patch_scheduler_goodput_k() -> None:
    """K by measured goodput (`goodput_k`) for schedulers whose drafter asks for it.

    vLLM's dynamic speculative decoding already drafts `dynamic_sd_lookup[batch]`
    tokens per step; a carryover config with `"num_speculative_tokens_per_batch_size":
    "goodput"` gets a lookup that asks a `GoodputK` instead of a fixed table, and
    the scheduler reports to it what each step verified and how long it took."""
    import time

    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_carryover.config import runtime_settings
    from vllm_carryover.control.goodput_k import GoodputK, KLookup, TimedStep

    if getattr(Scheduler.__init__, "_carryover", False):
        return
    init, update, stats = (Scheduler.__init__, Scheduler.update_from_output,
                           Scheduler.make_spec_decoding_stats)

    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        init(self, vllm_config, *args, **kwargs)
        self._goodput_k = None
        settings = runtime_settings(vllm_config)
        if settings is not None and settings.goodput_k and self.dynamic_sd_lookup is not None:
            self._goodput_k = GoodputK(self.num_spec_tokens)
            self._goodput_last_end: float | None = None
            self.dynamic_sd_lookup = KLookup(self._goodput_k)
            logger.info("Carryover: K by measured goodput, 0..%d drafted tokens per step",
                        self.num_spec_tokens)

    def make_spec_decoding_stats(self: Any, spec_decoding_stats: Any, num_draft_tokens: int,
                                 num_accepted_tokens: int, num_invalid_spec_tokens: Any,
                                 request_id: str) -> Any:
        if self._goodput_k is not None:
            invalid = (num_invalid_spec_tokens or {}).get(request_id, 0)
            self._goodput_k.observe_request(num_draft_tokens - invalid, num_accepted_tokens)
        return stats(self, spec_decoding_stats, num_draft_tokens=num_draft_tokens,
                     num_accepted_tokens=num_accepted_tokens,
                     num_invalid_spec_tokens=num_invalid_spec_tokens, request_id=request_id)

    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        out = update(self, scheduler_output, model_runner_output)
        if self._goodput_k is not None:
            _time_decode_step(self, scheduler_output, time.perf_counter())
        return out

    def _time_decode_step(self: Any, so: Any, end: float) -> None:
        # A step counts if it and the one before it were pure decode steps: then the
        # time between their ends is this step's cost.
        spec = so.scheduled_spec_decode_tokens
        batch = len(so.num_scheduled_tokens)
        decode = batch > 0 and all(n == 1 + len(spec.get(r, ()))
                                   for r, n in so.num_scheduled_tokens.items())
        last, self._goodput_last_end = self._goodput_last_end, end if decode else None
        if decode and last is not None:
            g = self._goodput_k
            g.observe_step(TimedStep(
                batch=batch, verified=so.total_num_scheduled_tokens - batch,
                drafted=batch * so.num_spec_tokens_to_schedule, seconds=end - last))
            if g.timed_steps % LOG_EVERY_STEPS == 0 and g.coef is not None:
                logger.info("Carryover K by goodput: %s (batch first-last: K); acceptance "
                            "per draft position %s", g.schedule(self.max_num_running_reqs),
                            g.acceptance().round(2).tolist())

    __init__._carryover = True  # type: ignore[attr-defined]
    Scheduler.__init__ = __init__  # type: ignore[method-assign]
    Scheduler.make_spec_decoding_stats = make_spec_decoding_stats  # type: ignore[method-assign]
    Scheduler.update_from_output = update_from_output  # type: ignore[method-assign]


def _skip_draft_fetch_after_k0() -> None:
    """Patch 10. A step scheduled with K = 0 makes the drafter propose zero tokens for
    every request, and `Scheduler.schedule` has already emptied the drafts of every
    request it scheduled, so fetching those empty drafts changes nothing. Only the
    plain step (`EngineCore.step`, no batch queue) is covered: there the last
    schedule is the step that just ran."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    from vllm_carryover.config import wants_carryover

    if getattr(EngineCore.post_step, "_carryover", False):
        return
    schedule, post_step = Scheduler.schedule, EngineCore.post_step

    def schedule_and_note_k(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = schedule(self, *args, **kwargs)
        self.carryover_last_k = out.num_spec_tokens_to_schedule
        return out

    def post_step_without_empty_fetch(self: Any, model_executed: bool) -> None:
        skips = self.__dict__.get("_carryover_skips_empty_fetch")
        if skips is None:
            skips = self._carryover_skips_empty_fetch = (
                self.batch_queue is None and wants_carryover(self.vllm_config))
        if skips and getattr(self.scheduler, "carryover_last_k", None) == 0:
            return
        post_step(self, model_executed)

    post_step_without_empty_fetch._carryover = True  # type: ignore[attr-defined]
    Scheduler.schedule = schedule_and_note_k  # type: ignore[method-assign]
    EngineCore.post_step = post_step_without_empty_fetch  # type: ignore[method-assign]
