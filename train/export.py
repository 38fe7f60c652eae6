"""Export a trained run as a servable drafter folder (bf16 DFlash checkpoint)."""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
from vllm_carryover.train.vocab_subset import with_dataset_vocab

from vllm_carryover.drafter.checkpoint import load_drafter_state, save_drafter
from vllm_carryover.drafter.validation import validate_for_target_folder


def export(run_file: Path, out: Path, target: str, draft_vocab: int = 0) -> Path:
    """Write `config.json` (with `carryover_config` training metadata) and bf16 weights;
    with `draft_vocab` > 0 the LM head covers the tokens the target writes most often in
    the run's training data."""
    saved = torch.load(run_file)
    meta = dict(saved["meta"])
    meta.pop("evals", None)
    meta["date"] = datetime.date.today().isoformat()
    meta["target"] = Path(target).name
    meta["args"] = dict(meta.get("args", {}), target=Path(target).name)
    cfg, state = dict(saved["config"], carryover_config=meta), saved["state"]
    if draft_vocab:
        cfg, state = with_dataset_vocab(cfg, state, target, meta["data"], draft_vocab)
    path = save_drafter(out, cfg, state, dtype=torch.bfloat16)
    validate_for_target_folder(path, target, cfg["block_size"] - 1)
    return path


def convert_to_draft_vocab(drafter: str, out: Path, target: str, data: str, size: int
                           ) -> Path:
    """Any drafter folder (or hub id) as a copy with a draft vocabulary, in bf16; exact
    on the kept tokens, since the drafter's LM head is the target's."""
    from vllm_carryover.drafter.source import resolve_drafter

    folder = resolve_drafter(drafter)
    cfg, state = load_drafter_state(folder, fill_rejected=False)
    cfg, state = with_dataset_vocab(cfg, state, target, data, size)
    path = save_drafter(out, cfg, state, dtype=torch.bfloat16)
    validate_for_target_folder(path, target, cfg["block_size"] - 1)
    return path

