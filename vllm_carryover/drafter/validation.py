"""Checking a drafter folder against the target it is to serve, at startup.

Every failure raises `CarryoverConfigError` naming the problem and the fix, so
that `vllm serve` stops at startup instead of failing inside a worker on the
first request.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm_carryover.drafter.checkpoint import read_tensor, read_weights_header
from vllm_carryover.drafter.format import (
    D2T,
    REJECTED_EMBEDDING,
    SLOT_CONFIDENCE,
    DrafterConfig,
    expected_shapes,
)
from vllm_carryover.drafter.markov_head import MARKOV_W1, MARKOV_W2
from vllm_carryover.drafter.vocab import from_offsets
from vllm_carryover.errors import CarryoverConfigError


def validate_for_target_folder(path: str | Path, target: str | Path,
                               num_speculative_tokens: int | None) -> DrafterConfig:
    """`validate_drafter` against a target folder's `config.json` (what the tools that
    write drafters check them with, without loading a transformers config)."""
    cfg = json.loads((Path(target) / "config.json").read_text())
    return validate_drafter(path, SimpleNamespace(**cfg), num_speculative_tokens)


def _target_dims(target_cfg: Any) -> tuple[int, int, int]:
    """(hidden size, vocab size, number of layers) of a target HF config."""
    text = getattr(target_cfg, "get_text_config", lambda: target_cfg)()
    return text.hidden_size, text.vocab_size, text.num_hidden_layers


def validate_drafter(path: str | Path, target_cfg: Any, num_speculative_tokens: int | None
                     ) -> DrafterConfig:
    """Check that the drafter folder at `path` can serve `target_cfg`.

    Every failure names the problem and the fix, so that `vllm serve` stops at
    startup instead of failing inside a worker on the first request.
    """
    path = Path(path)
    if not path.is_dir():
        raise CarryoverConfigError(
            f"drafter folder {path} does not exist; pass a local folder made by "
            "`python -m vllm_carryover.drafter.init_drafter` or by `python -m train export`, or a "
            "Hugging Face hub id (owner/name)"
        )
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CarryoverConfigError(f"drafter folder {path} has no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
        drafter = DrafterConfig.from_dict(raw)
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CarryoverConfigError(
            f"{cfg_file} is not a DFlash drafter config ({type(e).__name__}: {e}); it needs "
            "hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, "
            "vocab_size and dflash_config.{mask_token_id,target_layer_ids}"
        ) from e
    header = read_weights_header(path)

    hidden, vocab, depth = _target_dims(target_cfg)
    if drafter.target_hidden_size != hidden or drafter.hidden_size != hidden:
        raise CarryoverConfigError(
            f"drafter {path} was built for hidden size {drafter.hidden_size} "
            f"(target features {drafter.target_hidden_size}) but the target's hidden size "
            f"is {hidden}; use a drafter made for this target"
        )
    if drafter.vocab_size != vocab:
        raise CarryoverConfigError(
            f"drafter {path} has vocabulary size {drafter.vocab_size} but the target has "
            f"{vocab}; the drafter must share the target's tokenizer"
        )
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < depth - 1]
    if bad:
        raise CarryoverConfigError(
            f"drafter {path} reads target layers {bad}, outside 0..{depth - 2} of a "
            f"{depth}-layer target; use a drafter made for this target"
        )
    if not 0 <= drafter.mask_token_id < vocab:
        raise CarryoverConfigError(
            f"drafter {path} has mask_token_id {drafter.mask_token_id} outside the vocabulary"
        )
    if isinstance(drafter.markov_rank, bool) or not isinstance(drafter.markov_rank, int) \
            or drafter.markov_rank < 0:
        raise CarryoverConfigError(
            f"drafter {path} has markov_rank {drafter.markov_rank!r}; it must be a "
            "non-negative integer (0 or absent: no Markov head)"
        )
    if drafter.causal:
        raise CarryoverConfigError(
            f"drafter {path} is causal; carryover places rejected states after the query "
            "block, so it needs a non-causal (bidirectional) block drafter"
        )
    max_k = drafter.block_size - 1
    if num_speculative_tokens is not None and not 1 <= num_speculative_tokens <= max_k:
        raise CarryoverConfigError(
            f"num_speculative_tokens={num_speculative_tokens} but drafter {path} has "
            f"block_size {drafter.block_size}, so it drafts at most {max_k} tokens; "
            f"use 1..{max_k}"
        )
    _check_shapes(path, header, drafter)
    if drafter.draft_vocab_size:
        _check_draft_vocab(path, header, drafter)
    elif D2T in header:
        raise CarryoverConfigError(
            f"drafter weights in {path} hold a draft vocabulary ({D2T}) but config.json has "
            "no draft_vocab_size; add \"draft_vocab_size\": N (the length of d2t)")
    return drafter


def _check_shapes(path: Path, header: dict[str, Any], d: DrafterConfig) -> None:
    want = expected_shapes(d)
    missing = sorted(set(want) - set(header))
    if missing:
        raise CarryoverConfigError(
            f"drafter weights in {path} lack {len(missing)} tensors "
            f"(first: {missing[0]}); the file does not match its config.json"
        )
    stray = sorted(n for n in (MARKOV_W1, MARKOV_W2) if n in header and n not in want)
    if stray:
        raise CarryoverConfigError(
            f"drafter weights in {path} hold a Markov head ({stray[0]}) but "
            "config.json has no markov_rank; add \"markov_rank\": R (the head's second "
            "dimension) to config.json"
        )
    if SLOT_CONFIDENCE in header and SLOT_CONFIDENCE not in want:
        raise CarryoverConfigError(
            f"drafter weights in {path} hold the slots' confidence levels ({SLOT_CONFIDENCE}) "
            "but config.json's slot_proposals has no confidence_levels; add "
            "\"confidence_levels\": L (the tensor's first dimension) to slot_proposals"
        )
    for name, shape in want.items():
        got = tuple(header[name]["shape"])
        if got != shape:
            raise CarryoverConfigError(
                f"drafter tensor {name} has shape {list(got)} but config.json implies "
                f"{list(shape)}; the checkpoint does not match its config"
            )
    if REJECTED_EMBEDDING in header and tuple(header[REJECTED_EMBEDDING]["shape"]) != (
        d.hidden_size,
    ):
        raise CarryoverConfigError(
            f"drafter tensor {REJECTED_EMBEDDING} has shape "
            f"{header[REJECTED_EMBEDDING]['shape']}, expected [{d.hidden_size}]"
        )


def _check_draft_vocab(path: Path, header: dict[str, Any], d: DrafterConfig) -> None:
    """`d2t` must map the draft ids onto distinct target ids, in order."""
    if header[D2T]["dtype"] not in ("I64", "I32"):
        raise CarryoverConfigError(
            f"drafter tensor {D2T} in {path} is {header[D2T]['dtype']}; it must be an integer "
            "tensor (target id = draft id + d2t); rebuild the draft vocabulary with "
            "`python -m train draft-vocab`")
    ids = from_offsets(read_tensor(path, D2T))
    if d.draft_vocab_size > d.vocab_size or bool((ids[1:] <= ids[:-1]).any()) \
            or int(ids[0]) < 0 or int(ids[-1]) >= d.vocab_size:
        raise CarryoverConfigError(
            f"drafter {path} has a draft vocabulary ({D2T}) that does not map its "
            f"{d.draft_vocab_size} ids onto distinct target ids in 0..{d.vocab_size - 1} in "
            "order; rebuild it with `python -m train draft-vocab`")
