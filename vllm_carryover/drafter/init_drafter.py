"""Make a drafter checkpoint for a target: random init, or from a DFlash checkpoint.

The folder is what `train/` starts from and what `--speculative-config
'{"method": "carryover", "model": DIR}'` serves. A random drafter is almost
always wrong, which is what the lossless tests want (full carryover slots).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from vllm_carryover.drafter.checkpoint import load_drafter_state, save_drafter
from vllm_carryover.drafter.format import (
    REJECTED_EMBEDDING,
    DrafterConfig,
    default_target_layers,
    make_config_dict,
    random_state_dict,
)
from vllm_carryover.drafter.source import resolve_drafter
from vllm_carryover.drafter.validation import validate_for_target_folder
from vllm_carryover.drafter.vocab import build as build_draft_vocab


def init_drafter(
    target: str | Path,
    out: str | Path,
    *,
    num_layers: int = 1,
    block_size: int = 8,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    intermediate_size: int | None = None,
    markov_rank: int = 0,
    from_dflash: str | Path | None = None,
    draft_vocab: int = 0,
    token_counts: torch.Tensor | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a drafter folder for `target` into `out` and return its path; with
    `draft_vocab` > 0 its LM head covers the tokens most frequent in `token_counts`
    (the target's responses; `python -m train draft-vocab` counts a dataset's)."""
    target_cfg: dict[str, Any] = json.loads((Path(target) / "config.json").read_text())
    if from_dflash is not None:
        cfg, state = load_drafter_state(resolve_drafter(str(from_dflash)))
        cfg.setdefault("carryover_config", {})["initialized_from"] = str(from_dflash)
        had_embedding = REJECTED_EMBEDDING in state and bool(state[REJECTED_EMBEDDING].any())
        print(f"init_drafter: copied DFlash weights from {from_dflash}; rejected embedding "
              f"{'kept' if had_embedding else 'starts at zero'}", file=sys.stderr)
    else:
        depth = target_cfg["num_hidden_layers"]
        cfg = make_config_dict(
            target_cfg,
            num_layers=num_layers,
            block_size=block_size,
            target_layer_ids=target_layer_ids or default_target_layers(depth),
            mask_token_id=mask_token_id if mask_token_id is not None else 0,
            intermediate_size=intermediate_size,
            markov_rank=markov_rank,
            carryover_meta={"initialized": "random", "seed": seed},
        )
        state = random_state_dict(DrafterConfig.from_dict(cfg), seed)
    if draft_vocab:
        if token_counts is None:
            raise ValueError("a draft vocabulary needs token_counts to rank the tokens")
        cfg, state = build_draft_vocab(cfg, state, target, token_counts, draft_vocab)
    path = save_drafter(out, cfg, state, dtype)
    validate_for_target_folder(path, target, None)
    return path



def main(argv: list[str] | None = None,
         prog: str = "python -m vllm_carryover.drafter.init_drafter") -> None:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Create a carryover drafter checkpoint (config.json + model.safetensors) "
        "for a target model folder: random weights, or copied from a vLLM DFlash checkpoint. "
        "Prints the folder path.",
    )
    p.add_argument("--target", required=True,
                   help="target model folder (e.g. the path printed by "
                   "`python -m vllm_carryover.tools.testbed`)")
    p.add_argument("--out", required=True, help="folder to write the drafter into")
    p.add_argument("--layers", type=int, default=1, help="drafter transformer layers")
    p.add_argument("--block-size", type=int, default=8,
                   help="draft block incl. the bonus token: drafts up to block-size - 1 tokens")
    p.add_argument("--target-layers", type=int, nargs="+",
                   help="target layers whose hidden states feed the drafter "
                   "(default: 3 spread over the depth)")
    p.add_argument("--mask-token-id", type=int, help="token id used for mask queries "
                   "(default 0)")
    p.add_argument("--intermediate-size", type=int, help="drafter MLP width "
                   "(default: the target's)")
    p.add_argument("--markov-rank", type=int, default=0,
                   help="the semi-autoregressive variant: a Markov head of this rank, which "
                   "drafts the block left to right with a logit bias from the previous "
                   "token (default: 0, the parallel DFlash-style drafter)")
    p.add_argument("--from-dflash", help="start from this DFlash checkpoint (a folder or a "
                   "Hugging Face hub id) instead of random weights; a missing rejected "
                   "embedding starts at zero")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    a = p.parse_args(argv)
    path = init_drafter(
        a.target, a.out, num_layers=a.layers, block_size=a.block_size,
        target_layer_ids=a.target_layers, mask_token_id=a.mask_token_id,
        intermediate_size=a.intermediate_size, markov_rank=a.markov_rank,
        from_dflash=a.from_dflash, seed=a.seed,
        dtype=getattr(torch, a.dtype),
    )
    print(path)


if __name__ == "__main__":
    main()
