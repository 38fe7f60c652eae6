"""Carryover training: the recipe that fine-tunes a drafter with draft-verify-draft.

Each step runs `train.draft_verify_draft` on a batch of sequences (all sampled
anchors at once: draft, verify with the target, draft again over the rejected
states) and trains on the second draft. Loss = weighted CE of the second draft
+ `first_draft_weight` * the plain first-draft loss (keeps the empty-slot case,
e.g. the first round after prefill, as good as the baseline). Gradients reach
every drafter weight (fc, the rejected embedding, the layers), never the target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from vllm_carryover.train.baseline import (
    Sequence,
    attach_markov_head,
    computed_once,
    load_sequences,
    param_groups,
    sequence_feed,
    target_decoder,
)
from vllm_carryover.train.device import placement
from vllm_carryover.train.dflash_loss import (
    IGNORE,
    BlockStats,
    sample_anchors,
    slot_weights,
    weighted_block_ce,
)
from vllm_carryover.train.draft_verify_draft import (
    context_kv,
    draft_verify_draft,
    second_draft_logits,
)
from vllm_carryover.train.options import CarryoverArgs
from vllm_carryover.train.paths import data_dir
from vllm_carryover.train.slot_proposals import proposal_feeds
from vllm_carryover.train.state_cache import dataset_cache
from vllm_carryover.train.trainer import (
    Feed,
    SeqResult,
    Trainer,
    load_init,
    meta_args,
    portable,
)
from vllm_carryover.train.vocab_subset import remap_labels

from vllm_carryover.drafter.format import DrafterConfig
from vllm_carryover.drafter.target_weights import target_embedding
from vllm_carryover.drafter.torch_model import TorchDrafter


def evaluate(model: TorchDrafter, decoder: Any, seqs: list[Sequence], anchors_per_seq: int,
             feed: Feed, seed: int = 1234) -> dict[str, BlockStats]:
    """Held-out per-slot accuracy: first draft, second draft with / without the slot."""
    gen = torch.Generator().manual_seed(seed)
    num_drafts = model.config.block_size - 1
    stats = {name: BlockStats.empty(num_drafts) for name in ("first", "second", "second_no_slot")}
    model.eval()
    with torch.no_grad():
        for seq in tqdm(seqs, desc="eval", unit="seq", leave=False):
            anchors = sample_anchors(seq.response_start, seq.tokens.shape[0] - 1,
                                     anchors_per_seq, gen)
            if not anchors.numel():
                continue
            seq = feed(seq)
            r = draft_verify_draft(model, decoder, seq.tokens, seq.aux,
                                   anchors.to(seq.tokens.device), first_loss=False,
                                   proposals=seq.proposals)
            stats["first"].add_drafts(r.drafts, r.first_labels)
            stats["second"].add(r.second_logits, r.second_labels)
            ctx_k, ctx_v = context_kv(model, seq.aux)
            plain, labels = second_draft_logits(model, ctx_k, ctx_v, seq.tokens, r.anchors[r.keep],
                                                r.accepted[r.keep], r.rejected,
                                                use_slot=False, proposals=seq.proposals)
            stats["second_no_slot"].add(plain, labels)
    model.train()
    return stats


def mark_at_context_scale(model: TorchDrafter, seed: int) -> None:
    """Start a new rejected embedding as a random direction at a context row's norm
    (the hidden norm's output, about its weight's norm). Started at zero it grew to a
    norm of 1.5 in 184 steps against about 24 for a context row, so carried rows
    still looked like committed context."""
    direction = torch.randn(model.rejected_embedding.shape,
                            generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model.rejected_embedding.copy_(direction / direction.norm()
                                       * model.hidden_norm.weight.norm())


def train_carryover(a: CarryoverArgs) -> Path:
    """Fine-tune a drafter with draft-verify-draft; save `final.pt` in the run folder.

    Returns the path of final.pt, or of last.pt when `--stop-after` ended this
    invocation before the run was complete.
    """
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    place = placement(a.device, a.dtype)
    cfg, state, init_meta = load_init(a.init, a.target, "--init")
    cfg = {k: v for k, v in cfg.items() if k != "carryover_config"}
    cfg, state = attach_markov_head(cfg, state, a.markov_rank, a.seed)
    dcfg = DrafterConfig.from_dict(cfg)
    model = TorchDrafter(dcfg, target_embedding(a.target))
    model.load_checkpoint_state(state)
    if not model.rejected_embedding.any() and not a.hide_carried:
        mark_at_context_scale(model, a.seed)
    model.to(place.device)
    # the rejected embedding is new while the rest is trained: let it move faster
    groups = param_groups(model, a, a.rejected_lr_mult)
    params = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    layer_ids = list(dcfg.target_layer_ids)
    decoder = target_decoder(a, place, layer_ids)  # verify passes, uncached states too
    seqs = load_sequences(a.data)
    cache = dataset_cache(a.target_states, data_dir(a.data), layer_ids,
                          len(layer_ids) * dcfg.target_hidden_size, place.dtype)
    feed = sequence_feed(place, layer_ids, decoder, cache)  # the baseline recipe's feed
    feed, heldout_feed = proposal_feeds(cfg, a.data, feed)
    heldout_feed = computed_once(heldout_feed) if cache is None else heldout_feed
    train, heldout = seqs["train"], seqs["heldout"]
    weights = slot_weights(dcfg.block_size - 1, a.gamma)
    counts = {"first_label_tokens": 0, "second_label_tokens": 0, "anchors": 0,
              "second_drafts": 0, "carried_states": 0, "target_tokens": 0}
    loop = Trainer(a, "carryover", model, params, opt, cfg, train, counts, place, feed,
                   lineage_steps=init_meta.get("steps", 0))

    def heldout_eval() -> dict[str, Any]:
        with place.autocast():
            return _summary(evaluate(model, decoder, heldout, a.eval_anchors_per_seq,
                                     heldout_feed))

    if loop.main and "heldout_initial" not in loop.done.notes:  # the init drafter's
        loop.done.notes["heldout_initial"] = heldout_eval()
        print("initial heldout " + json.dumps(loop.done.notes["heldout_initial"]))

    def seq_loss(seq: Sequence, anchors: torch.Tensor, ids: torch.Tensor | None) -> SeqResult:
        r = draft_verify_draft(model, decoder, seq.tokens, seq.aux, anchors, ids,
                               first_loss=a.first_draft_weight > 0,
                               use_slot=not a.hide_carried, proposals=seq.proposals)
        lab2 = r.second_labels if ids is None else remap_labels(
            r.second_labels, ids, dcfg.vocab_size)
        loss2, _ = weighted_block_ce(r.second_logits, lab2, weights)
        loss = loss2
        n = {"second_label_tokens": int((r.second_labels != IGNORE).sum()),
             "anchors": int(anchors.numel()), "second_drafts": int(r.keep.sum()),
             "carried_states": int(r.rejected.anchor.numel()),
             "target_tokens": r.rejected.target_tokens}
        if r.first_logits is not None:
            lab1 = r.first_labels if ids is None else remap_labels(
                r.first_labels, ids, dcfg.vocab_size)
            loss = loss + a.first_draft_weight * weighted_block_ce(
                r.first_logits, lab1, weights)[0]
            n["first_label_tokens"] = int((r.first_labels != IGNORE).sum())
        return SeqResult(loss, {"loss_second": loss2.item(),
                                "accepted": float(r.accepted.float().mean())}, n)

    complete = loop.run(seq_loss, heldout_eval)
    if not complete or not loop.main:
        return loop.out / ("final.pt" if complete else "last.pt")
    final = heldout_eval()
    print("final heldout " + json.dumps(final))
    done, counts = loop.done, loop.done.counts
    label_tokens = counts["first_label_tokens"] + counts["second_label_tokens"]
    family = "dspark" if dcfg.markov_rank else "dflash"
    meta = {"recipe": f"{family}-baseline" if a.hide_carried else
            ("dspark-carryover" if dcfg.markov_rank else "carryover"),
            "steps": done.step, "trained_label_tokens": label_tokens,
            **counts, "train_seconds": round(done.train_seconds, 1),
            "label_tokens_per_s": round(label_tokens / max(done.train_seconds, 1e-9), 1),
            "anchors_per_s": round(counts["anchors"] / max(done.train_seconds, 1e-9), 2),
            "init_checkpoint": portable(a.init),
            "init_meta": {k: init_meta.get(k) for k in (
                "recipe", "steps", "trained_label_tokens", "train_seconds",
                "label_tokens_per_s") if k in init_meta},
            "data": a.data, "data_manifest_sha256": loop.data_sha,
            "train_sequences": len(train), "heldout_sequences": len(heldout),
            "processes": loop.world, "heldout": final,
            "heldout_initial": done.notes["heldout_initial"], "evals": done.evals,
            "args": meta_args(a)}
    return loop.save_final(cfg, model.checkpoint_state(), meta)


def _summary(st: dict[str, BlockStats]) -> dict[str, Any]:
    return {f"{name}_tau": round(s.tau(), 4) for name, s in st.items()} | {
        f"{name}_acc": s.accuracy() for name, s in st.items()}
