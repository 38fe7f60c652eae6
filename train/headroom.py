"""How much the rejected states could tell a drafter, measured before training on them.

After a rejection the next block starts at the target's own token y (position
p' = p + a + 1), and its first draft guesses the token at p' + 1. The first
rejected draft d_{a+1} sat at p' too, so the target's state there is its
prediction of position p' + 1 after the WRONG token. Wherever the target's
argmax at that row is the true token while the drafter (empty slot) is wrong,
the carried states hold something the drafter lacks; where both are wrong, no
use of the states at the argmax level can help. On the held-out split, per
category, for the first draft slot after every rejection:

  target   the target's argmax at the first rejected row is the true next token
  drafter  the drafter's own first guess (carryover off) is right
  either   an upper bound for that slot from reading the argmax off the states
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from train.paths import DEFAULT_DATA

COLUMNS = ("rejections", "target", "drafter", "either")


def headroom(target: str, init: str, data: str, anchors_per_seq: int,
             seed: int = 1234) -> dict[str, dict[str, float]]:
    """Per category (and "all"): rejections counted and the three hit rates."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from train.baseline import load_sequences
    from train.carryover import context_kv, draft_verify_draft, second_draft_logits, verify_inputs
    from train.dflash_loss import sample_anchors

    drafter = load_drafter(target, init)
    dcfg = drafter.config
    full = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    seqs = load_sequences(target, data, list(dcfg.target_layer_ids))["heldout"]
    gen = torch.Generator().manual_seed(seed)
    hits: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    with torch.no_grad():
        for seq in tqdm(seqs, desc="headroom", unit="seq"):
            anchors = sample_anchors(seq.response_start, seq.tokens.shape[0] - 1,
                                     anchors_per_seq, gen)
            if not anchors.numel():
                continue
            # the full decoder returns the same aux states as the truncated one
            r = draft_verify_draft(drafter, full.model, seq.tokens, seq.aux, anchors,
                                   first_loss=False)
            kept, drafts, acc = anchors[r.keep], r.drafts[r.keep], r.accepted[r.keep]
            ids, pos, visible, row_anchor, row_slot, n_true = verify_inputs(
                seq.tokens, kept, drafts, acc)
            if not row_anchor.numel():
                continue
            mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
            target_next = full(input_ids=ids[None], position_ids=pos[None],
                               attention_mask=mask[None, None]).logits[0, n_true:].argmax(-1)
            k, v = context_kv(drafter, seq.aux)
            plain, labels = second_draft_logits(drafter, k, v, seq.tokens, kept, acc,
                                                r.rejected, use_slot=False)
            first_row = row_slot == acc[row_anchor]  # d_{a+1} of each anchor
            for row in first_row.nonzero().flatten().tolist():
                i = int(row_anchor[row])
                true = int(labels[i, 0])
                t, d = int(target_next[row]) == true, int(plain[i, 0].argmax()) == true
                for name in ("all", seq.category) if seq.category else ("all",):
                    h = hits[name]
                    h[0] += 1
                    h[1] += t
                    h[2] += d
                    h[3] += t or d
    return {name: {"rejections": h[0], **{c: round(x / max(h[0], 1), 4) for c, x in zip(
        COLUMNS[1:], h[1:], strict=True)}} for name, h in hits.items()}


def load_drafter(target: str, init: str) -> Any:
    """A TorchDrafter (eval mode) from a drafter folder or a run name."""
    from train.baseline import target_embedding
    from train.carryover import load_init
    from vllm_carryover.checkpoint import DrafterConfig
    from vllm_carryover.torch_drafter import TorchDrafter

    cfg, state, _ = load_init(init)
    dcfg = DrafterConfig.from_dict({k: v for k, v in cfg.items() if k != "carryover_config"})
    drafter = TorchDrafter(dcfg, target_embedding(target))
    drafter.load_checkpoint_state(state)
    return drafter.eval()


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "headroom", help="what the rejected states could add, before carryover training",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model folder (default: the testbed SmolLM2 folder)")
    p.add_argument("--init", required=True,
                   help="drafter folder, or a run name in the cache (its final.pt)")
    p.add_argument("--data", default=DEFAULT_DATA,
                   help="dataset name in the cache (default: %(default)s)")
    p.add_argument("--anchors-per-seq", type=int, default=16,
                   help="anchors per held-out sequence (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads (default: %(default)s)")
    p.add_argument("--out", help="also write the table as JSON here")
    p.set_defaults(fn=_run)


def _run(a: argparse.Namespace) -> None:
    import torch

    from train.__main__ import default_target

    torch.set_num_threads(a.threads)
    table = headroom(a.target or default_target(), a.init, a.data, a.anchors_per_seq)
    order = sorted(table, key=lambda n: (n == "all", n))
    print("| category | " + " | ".join(COLUMNS) + " |")
    print("|" + " --- |" * (len(COLUMNS) + 1))
    for name in order:
        row = table[name]
        print(f"| {name} | " + " | ".join(str(row[c]) for c in COLUMNS) + " |")
    if a.out:
        Path(a.out).write_text(json.dumps(table, indent=1))
