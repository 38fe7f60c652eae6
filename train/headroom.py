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

and the same split by near misses, where carried states are likeliest to help:

  near         the true token was among the drafter's top 4 at the rejected slot
  target_near  `target` within the near misses (target_far: within the others)
  p_rejected   the target's mean probability of the rejected draft token

and, for scale, the drafter's own greedy acceptance length along the anchors a
speculative run visits (`walked_tau`, the estimate that tracks vLLM's tau).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from vllm_carryover.train.paths import DEFAULT_DATA

COLUMNS = ("rejections", "target", "drafter", "either", "near", "target_near",
           "target_far", "p_rejected", "walked_tau")
NEAR_TOP = 4  # a rejected slot whose true token was this high in the drafter's ranking


def headroom(target: str, init: str, data: str, anchors_per_seq: int,
             per_category: int | None = None, seed: int = 1234) -> dict[str, dict[str, float]]:
    """Per category (and "all"): rejections counted and the three hit rates."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM
    from vllm_carryover.train.dflash_loss import accepted_length, sample_anchors
    from vllm_carryover.train.draft_verify_draft import (
        Rejected,
        block_logits_over,
        context_kv,
        masked_forward,
        second_anchor_ok,
        second_draft_logits,
        verify_inputs,
    )

    drafter, proposals = load_drafter(target, init, data)
    num_drafts = drafter.config.block_size - 1
    full = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    seqs = [proposals(s) for s in heldout_sequences(
        target, data, list(drafter.config.target_layer_ids), per_category)]
    gen = torch.Generator().manual_seed(seed)
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    with torch.no_grad():
        for seq in tqdm(seqs, desc="headroom", unit="seq"):
            tokens = seq.tokens
            anchors = sample_anchors(seq.response_start, tokens.shape[0] - 1,
                                     anchors_per_seq, gen)
            if not anchors.numel():
                continue
            ctx_k, ctx_v = context_kv(drafter, seq.aux)
            first, blocks = block_logits_over(drafter, ctx_k, ctx_v, tokens, anchors,
                                              proposals=seq.proposals)
            labels = blocks.labels
            drafts = drafter.draft_tokens(first, blocks.query_ids[:, 0])
            acc = accepted_length(drafts, labels)
            # anchors with a rejection whose next block fits in the sequence
            keep = second_anchor_ok(anchors, acc, num_drafts, tokens.shape[0]) & (acc < num_drafts)
            if not keep.any():
                continue
            kept, acc = anchors[keep], acc[keep]
            ids, pos, visible, row_anchor, row_slot, n_true = verify_inputs(
                tokens, kept, drafts[keep], acc)
            # verify_inputs' rows are the carried drafts (carryover_slot's rule); the
            # first of each anchor is d_{a+1}
            first_row = row_slot == acc[row_anchor]
            rows = torch.arange(len(kept))
            slot_logits, slot_true = first[keep][rows, acc], labels[keep][rows, acc]
            near = (slot_logits.topk(NEAR_TOP, -1).indices == slot_true[:, None]).any(-1)
            # the target's probability of d_{a+1} where it chose the true token instead
            probs = full(input_ids=tokens[None]).logits[0].float().softmax(-1)
            p_rejected = probs[kept + acc, drafts[keep][rows, acc]]
            target_next = masked_forward(full, ids, pos, visible).logits[0, n_true:][
                first_row].argmax(-1)
            no_slot = Rejected(torch.empty(0, seq.aux.shape[-1]), row_anchor[:0], row_slot[:0])
            plain, next_labels = second_draft_logits(drafter, ctx_k, ctx_v, tokens, kept, acc,
                                                     no_slot, use_slot=False,
                                                     proposals=seq.proposals)
            true = next_labels[:, 0]  # row_anchor[first_row] is 0..len(kept)-1 in order
            t, d = target_next == true, plain[:, 0].argmax(-1) == true
            for name in ("all", seq.category) if seq.category else ("all",):
                c = counts[name]
                c["rejections"] += len(true)
                c["target"] += int(t.sum())
                c["drafter"] += int(d.sum())
                c["either"] += int((t | d).sum())
                c["near"] += int(near.sum())
                c["target_near"] += int((t & near).sum())
                c["p_rejected"] += float(p_rejected.sum())
    walked = walked_tau(drafter, seqs)
    return {name: rates(c) | {"walked_tau": walked[name]} for name, c in counts.items()}


def rates(c: Counter[str]) -> dict[str, float]:
    """One category's counts as the table's columns (shares of its rejections; the
    near-miss split as shares of the near misses and of the others)."""
    def share(hits: float, of: float) -> float:
        return round(hits / max(of, 1), 4)

    n, near = c["rejections"], c["near"]
    return {"rejections": n, "target": share(c["target"], n), "drafter": share(c["drafter"], n),
            "either": share(c["either"], n), "near": share(near, n),
            "target_near": share(c["target_near"], near),
            "target_far": share(c["target"] - c["target_near"], n - near),
            "p_rejected": share(c["p_rejected"], n)}


def walked_tau(drafter: Any, seqs: list[Any]) -> dict[str, float]:
    """Per category (and "all"): the drafter's greedy acceptance length along the anchors
    a speculative run visits."""
    from vllm_carryover.train.baseline import evaluate
    from vllm_carryover.train.dflash_loss import WalkStats

    groups: dict[str, list[Any]] = defaultdict(list)
    for seq in seqs:
        groups[seq.category].append(seq)
    walks = {name: evaluate(drafter, group, 1, lambda s: s)[1] for name, group in groups.items()}
    total = WalkStats(sum(w.rounds for w in walks.values()),
                      sum(w.accepted for w in walks.values()))
    return {name: round(w.tau(), 4) for name, w in walks.items() if name} | {
        "all": round(total.tau(), 4)}


def heldout_sequences(target: str, data: str, layer_ids: list[int],
                      per_category: int | None = None) -> list[Any]:
    """The held-out sequences (the first `per_category` of each category when given)
    with their target states computed now, in float32.

    Only the held-out split's states are computed, once each, and no state cache is
    filled (the training caches hold states of the training dtype)."""
    import torch
    from tqdm import tqdm
    from vllm_carryover.train.baseline import load_sequences, sequence_feed
    from vllm_carryover.train.device import Placement
    from vllm_carryover.train.target_states import truncated_decoder

    seqs, taken = [], Counter()
    for seq in load_sequences(data)["heldout"]:
        taken[seq.category] += 1
        if per_category is None or taken[seq.category] <= per_category:
            seqs.append(seq)
    decoder = truncated_decoder(target, max(layer_ids))
    feed = sequence_feed(Placement(torch.device("cpu"), torch.float32), layer_ids, decoder)
    return [feed(s) for s in tqdm(seqs, desc="held-out target states", unit="seq")]


def load_drafter(target: str, init: str, data: str) -> tuple[Any, Any]:
    """(a TorchDrafter in eval mode from a drafter folder or a run name, the feed that
    gives a held-out sequence of `data` the drafter's slot proposals: for a drafter
    that reads mask tokens, one that leaves it as it is)."""
    from vllm_carryover.train.carryover import load_init
    from vllm_carryover.train.slot_proposals import proposal_feeds

    from vllm_carryover.drafter.format import DrafterConfig
    from vllm_carryover.drafter.target_weights import target_embedding
    from vllm_carryover.drafter.torch_model import TorchDrafter

    cfg, state, _ = load_init(init, target, "--init")
    dcfg = DrafterConfig.from_dict({k: v for k, v in cfg.items() if k != "carryover_config"})
    drafter = TorchDrafter(dcfg, target_embedding(target))
    drafter.load_checkpoint_state(state)
    return drafter.eval(), proposal_feeds(cfg, data, lambda seq: seq)[1]


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "headroom", help="what the rejected states could add, before carryover training",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_drafter_options(p)
    p.add_argument("--anchors-per-seq", type=int, default=16,
                   help="anchors per held-out sequence (default: %(default)s)")
    p.add_argument("--per-category", type=int,
                   help="only the first N held-out sequences of each category (default: "
                   "all; each sequence's target states are computed first)")
    p.set_defaults(fn=_run)


def add_drafter_options(p: argparse.ArgumentParser, init_required: bool = True) -> None:
    """The options of a held-out analysis of one drafter (this one and `lookup-headroom`,
    where the drafter is optional)."""
    p.add_argument("--target", help="target model folder (default: the testbed SmolLM2 folder)")
    p.add_argument("--init", required=init_required,
                   help="drafter folder, else a run name in the cache (its final.pt), else a "
                   "Hugging Face hub id"
                   + ("" if init_required else "; without it only the lookups are walked"))
    p.add_argument("--data", default=DEFAULT_DATA,
                   help="dataset name in the cache (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads (default: %(default)s)")
    p.add_argument("--out", help="also write the table as JSON here")


def print_table(table: dict[str, dict[str, Any]], columns: list[str] | tuple[str, ...],
                out: str | None) -> None:
    """A per-category table as markdown, "all" last; also as JSON to `out` when given."""
    print("| category | " + " | ".join(columns) + " |")
    print("|" + " --- |" * (len(columns) + 1))
    for name in sorted(table, key=lambda n: (n == "all", n)):
        print(f"| {name} | " + " | ".join(str(table[name][c]) for c in columns) + " |")
    if out:
        Path(out).write_text(json.dumps(table, indent=1))


def _run(a: argparse.Namespace) -> None:
    import torch
    from vllm_carryover.train.paths import default_target

    torch.set_num_threads(a.threads)
    print_table(headroom(a.target or default_target(), a.init, a.data, a.anchors_per_seq,
                         a.per_category), COLUMNS, a.out)
