"""Carryover training: parallel draft-verify-draft over all anchors of a sequence.

Plain DFlash training never shows the drafter a rejected state, so a carryover
drafter learns to use them here. Per training sequence (true tokens T, aux
target states S, cached or computed online by the same target) and for all
sampled anchors p at once:

1. draft (no gradient, full vocabulary, greedy): the block `[T[p], MASK x K]`
   over the context states at positions < p gives d_1..d_K;
2. verify: a = number of leading d_j equal to T[p+j]; ONE target forward over
   one long sequence with a block-sparse 4D mask gives the target's aux states
   at every rejected draft d_{a+1}..d_K (positions p+a+1..p+K), exactly the rows
   vLLM hands the proposer after a verify step;
3. draft again at p' = p + a + 1 (the target's bonus token, T[p'] since the data
   are the target's own greedy responses) with context states < p' plus those
   rejected states as carried-over keys (rejected embedding added), trained on
   T[p'+1..p'+K].

Loss = weighted CE of the second draft + `first_draft_weight` * the plain
first-draft loss (keeps the empty-slot case, e.g. the first round after
prefill, as good as the baseline). Gradients reach every drafter weight
(fc, the rejected embedding, the layers), never the target.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from vllm_carryover.train.baseline import (
    Sequence,
    attach_markov_head,
    load_sequences,
    param_groups,
    sequence_feed,
    target_decoder,
    target_embedding,
)
from vllm_carryover.train.device import placement
from vllm_carryover.train.dflash_loss import (
    IGNORE,
    Blocks,
    BlockStats,
    make_blocks,
    sample_anchors,
    slot_weights,
    weighted_block_ce,
)
from vllm_carryover.train.distributed import rank0_first
from vllm_carryover.train.options import CarryoverArgs
from vllm_carryover.train.paths import CHECKPOINTS, run_dir
from vllm_carryover.train.trainer import Feed, SeqResult, Trainer, meta_args
from vllm_carryover.train.vocab_subset import remap_labels, restricted_head

from vllm_carryover.carryover_slot import carried_drafts, draft_positions
from vllm_carryover.checkpoint import DrafterConfig, load_drafter_state
from vllm_carryover.torch_drafter import TorchDrafter


@dataclass
class Rejected:
    """Target aux states at the rejected drafts of a set of anchors (R rows)."""

    states: torch.Tensor  # [R, n_layers * H_target]
    anchor: torch.Tensor  # [R]: index of the anchor (into the anchors tensor)
    slot: torch.Tensor  # [R]: j - 1 for draft d_j, i.e. position = anchor + 1 + slot
    target_tokens: int = 0  # length of the verify pass's long sequence (its cost)


@dataclass
class DraftVerifyDraft:
    """Everything one sequence's draft-verify-draft pass produced."""

    anchors: torch.Tensor  # [A] first-draft anchors
    drafts: torch.Tensor  # [A, K] greedy first drafts
    accepted: torch.Tensor  # [A] accepted prefix length a
    first_logits: torch.Tensor | None  # [A, K, V'] (with grad) or None
    first_labels: torch.Tensor  # [A, K]
    keep: torch.Tensor  # [A] bool: anchors with a second draft (p' + K fits)
    rejected: Rejected  # states of the kept anchors' rejected drafts
    second_logits: torch.Tensor  # [A', K, V'] with the carried-over states
    second_labels: torch.Tensor  # [A', K]


def accepted_length(drafts: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Greedy verification: the number of leading drafts equal to the true tokens."""
    return ((drafts == labels) & (labels != IGNORE)).int().cumprod(-1).sum(-1)


def second_anchor_ok(anchors: torch.Tensor, accepted: torch.Tensor, k: int,
                     length: int) -> torch.Tensor:
    """Anchors whose next block p' = p + a + 1 has all K labels inside the sequence."""
    return anchors + accepted + 1 + k <= length - 1


def context_kv(model: TorchDrafter, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Committed-context K/V [L, T, kv, hd] of a whole sequence (fc, norm, projection)."""
    return model.context_kv(model.fuse(aux.float()),
                            torch.arange(aux.shape[0], device=aux.device))


def block_logits_over(model: TorchDrafter, k: torch.Tensor, v: torch.Tensor,
                      tokens: torch.Tensor, anchors: torch.Tensor
                      ) -> tuple[torch.Tensor, Blocks]:
    """Plain DFlash blocks over precomputed context K/V: (the backbone's logits
    [A, K, V], without any Markov bias; the blocks, with their labels [A, K])."""
    d = model.config
    blocks = make_blocks(tokens, anchors, d.block_size, d.mask_token_id, k.shape[1])
    a = anchors.shape[0]
    ctx_k = k[:, None].expand(-1, a, -1, -1, -1)
    ctx_v = v[:, None].expand(-1, a, -1, -1, -1)
    logits = model(blocks.query_ids, blocks.query_pos, ctx_k, ctx_v, blocks.ctx_mask)
    return logits[:, 1:], blocks


def verify_inputs(tokens: torch.Tensor, anchors: torch.Tensor, drafts: torch.Tensor,
                  accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor, torch.Tensor, int]:
    """(ids [N], positions [N], visible [N, N] bool, anchor [R], slot [R], true length).

    One long sequence: the true prefix T[0..m] (m = the largest p + a needed),
    then, per anchor with a < K, its rejected drafts d_{a+1}..d_K at positions
    p+a+1..p+K. A rejected row sees true positions <= p + a and, causally, its
    own anchor's rejected rows. Since d_1..d_a equal T[p+1..p+a], this is the
    target run on T[0..p] + d_1..d_K restricted to the rows that matter; the
    accepted rows' states are the true states already cached.
    """
    k, dev = drafts.shape[1], tokens.device
    rej = carried_drafts(accepted, k)  # [A, K]: the rejected drafts, the slot's rows
    anchor_idx, slot_idx = rej.nonzero(as_tuple=True)  # row-major: grouped by anchor
    last_true = anchors + accepted  # p + a: the last committed position
    n_true = int(last_true[anchor_idx].max()) + 1 if anchor_idx.numel() else 0
    ids = torch.cat([tokens[:n_true], drafts[anchor_idx, slot_idx]])
    pos = torch.cat([torch.arange(n_true, device=dev),
                     draft_positions(anchors, k)[anchor_idx, slot_idx]])
    n = ids.shape[0]
    visible = torch.zeros(n, n, dtype=torch.bool, device=dev)
    visible[:n_true, :n_true] = torch.ones(n_true, n_true, dtype=torch.bool, device=dev).tril()
    visible[n_true:, :n_true] = (torch.arange(n_true, device=dev)[None, :]
                                 <= last_true[anchor_idx][:, None])
    same = anchor_idx[:, None] == anchor_idx[None, :]
    visible[n_true:, n_true:] = same & (slot_idx[None, :] <= slot_idx[:, None])
    return ids, pos, visible, anchor_idx, slot_idx, n_true


def masked_forward(model: Any, ids: torch.Tensor, pos: torch.Tensor, visible: torch.Tensor,
                   **kwargs: Any) -> Any:
    """One forward of a transformers model over one long sequence in which row i sees
    row j iff `visible[i, j]`: passed as a 4D additive float mask, which transformers
    uses as-is (eager and SDPA alike); positions go in as `position_ids`, so RoPE sees
    the true ones. The target runs in its own dtype, as in vLLM, also inside autocast."""
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
        ~visible, torch.finfo(dtype).min)
    with torch.inference_mode(), torch.autocast(visible.device.type, enabled=False):
        return model(input_ids=ids[None], position_ids=pos[None],
                     attention_mask=mask[None, None], use_cache=False, **kwargs)


def rejected_states(decoder: Any, tokens: torch.Tensor, anchors: torch.Tensor,
                    drafts: torch.Tensor, accepted: torch.Tensor,
                    layer_ids: list[int] | tuple[int, ...]) -> Rejected:
    """The target's aux states at every rejected draft of every anchor, ONE forward.

    `decoder` is the target's (possibly truncated) decoder stack, as
    `train.target_states.truncated_decoder` returns it.
    """
    ids, pos, visible, anchor_idx, slot_idx, n_true = verify_inputs(
        tokens, anchors, drafts, accepted)
    if anchor_idx.numel() == 0:
        width = decoder.config.hidden_size * len(layer_ids)
        return Rejected(torch.empty(0, width, device=tokens.device), anchor_idx, slot_idx)
    out = masked_forward(decoder, ids, pos, visible, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1][0, n_true:] for i in layer_ids], dim=-1)
    return Rejected(feats.float().clone(), anchor_idx, slot_idx, int(ids.shape[0]))


def second_draft_logits(model: TorchDrafter, k: torch.Tensor, v: torch.Tensor,
                        tokens: torch.Tensor, anchors: torch.Tensor,
                        accepted: torch.Tensor, rejected: Rejected,
                        use_slot: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [A, K, V], labels [A, K]) of the blocks at p' = p + a + 1.

    Block i attends to context positions < p' and to its own anchor's rejected
    states (K slots per block, slot j visible iff j >= a_i, projected at their
    own positions with the rejected embedding), as the vLLM proposer drafts
    after a verify step. `rejected.anchor` indexes `anchors`. `use_slot=False`
    hides the slot: plain DFlash drafting at the same p' (the ablation).
    """
    d = model.config
    kk = d.block_size - 1
    a = anchors.shape[0]
    blocks = make_blocks(tokens, anchors + accepted + 1, d.block_size, d.mask_token_id,
                         k.shape[1])
    if a == 0:  # no anchor has a next block inside the sequence
        return k.new_zeros(0, kk, model.lm_head.shape[0]), blocks.labels
    slot_aux = torch.zeros(a, kk, rejected.states.shape[-1], device=k.device)
    slot_aux[rejected.anchor, rejected.slot] = rejected.states.float()
    slot_pos = draft_positions(anchors, kk)
    sk, sv = model.context_kv(model.fuse(slot_aux.flatten(0, 1)), slot_pos.flatten(),
                              torch.ones(a * kk, dtype=torch.bool, device=k.device))
    sk = sk.view(sk.shape[0], a, kk, *sk.shape[2:])
    sv = sv.view(sv.shape[0], a, kk, *sv.shape[2:])
    ctx_k = torch.cat([k[:, None].expand(-1, a, -1, -1, -1), sk], dim=2)
    ctx_v = torch.cat([v[:, None].expand(-1, a, -1, -1, -1), sv], dim=2)
    slot_mask = carried_drafts(accepted, kk)
    mask = torch.cat([blocks.ctx_mask, slot_mask & use_slot], dim=1)
    logits = model(blocks.query_ids, blocks.query_pos, ctx_k, ctx_v, mask)
    return model.teacher_forced(logits[:, 1:], blocks.prev_ids), blocks.labels


def draft_verify_draft(model: TorchDrafter, decoder: Any, tokens: torch.Tensor,
                       aux: torch.Tensor, anchors: torch.Tensor,
                       head_ids: torch.Tensor | None = None,
                       first_loss: bool = True) -> DraftVerifyDraft:
    """The whole pass for one sequence; logits carry gradients into the drafter.

    Drafts are always the full-vocabulary greedy ones (what inference proposes:
    left to right through a Markov head); `head_ids` restricts only the trained
    logits (sampled softmax), which are teacher-forced through a Markov head.
    """
    d = model.config
    kk = d.block_size - 1
    k, v = context_kv(model, aux)
    first = None
    if first_loss and head_ids is None:  # full-vocabulary loss: one forward does both
        base, blocks = block_logits_over(model, k, v, tokens, anchors)
        first = model.teacher_forced(base, blocks.prev_ids)
        drafts = model.draft_tokens(base.detach(), blocks.query_ids[:, 0])
    else:
        with torch.no_grad():
            base, blocks = block_logits_over(model, k.detach(), v.detach(), tokens, anchors)
            drafts = model.draft_tokens(base, blocks.query_ids[:, 0])
        if first_loss:
            with restricted_head(model, head_ids):
                base, _ = block_logits_over(model, k, v, tokens, anchors)
                first = model.teacher_forced(base, blocks.prev_ids)
    labels = blocks.labels
    accepted = accepted_length(drafts, labels)
    keep = second_anchor_ok(anchors, accepted, kk, tokens.shape[0])
    rej = rejected_states(decoder, tokens, anchors[keep], drafts[keep], accepted[keep],
                          d.target_layer_ids)
    rej.states = rej.states.to(aux.dtype).float()  # same precision as the cached context
    with restricted_head(model, head_ids):
        second, labels2 = second_draft_logits(model, k, v, tokens, anchors[keep],
                                              accepted[keep], rej)
    return DraftVerifyDraft(anchors, drafts, accepted, first, labels, keep, rej, second,
                            labels2)


def evaluate(model: TorchDrafter, decoder: Any, seqs: list[Sequence], anchors_per_seq: int,
             feed: Feed, seed: int = 1234) -> dict[str, BlockStats]:
    """Held-out per-slot accuracy: first draft, second draft with / without the slot."""
    gen = torch.Generator().manual_seed(seed)
    kk = model.config.block_size - 1
    stats = {name: BlockStats.empty(kk) for name in ("first", "second", "second_no_slot")}
    model.eval()
    with torch.no_grad():
        for seq in tqdm(seqs, desc="eval", unit="seq", leave=False):
            anchors = sample_anchors(seq.response_start, seq.tokens.shape[0] - 1,
                                     anchors_per_seq, gen)
            if not anchors.numel():
                continue
            seq = feed(seq)
            r = draft_verify_draft(model, decoder, seq.tokens, seq.aux,
                                   anchors.to(seq.tokens.device), first_loss=False)
            stats["first"].add_drafts(r.drafts, r.first_labels)
            stats["second"].add(r.second_logits, r.second_labels)
            k, v = context_kv(model, seq.aux)
            plain, labels = second_draft_logits(model, k, v, seq.tokens, r.anchors[r.keep],
                                                r.accepted[r.keep], r.rejected,
                                                use_slot=False)
            stats["second_no_slot"].add(plain, labels)
    model.train()
    return stats


def load_init(init: str) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """(config, float32 state, its training metadata) of a drafter folder or a run name."""
    path = Path(init)
    if (path / "config.json").is_file():
        cfg, state = load_drafter_state(path)
        return cfg, {k: v.float() for k, v in state.items()}, cfg.get("carryover_config", {})
    saved = torch.load(run_dir(init) / "final.pt")
    return saved["config"], saved["state"], saved["meta"]


def train_carryover(a: CarryoverArgs) -> Path:
    """Fine-tune a drafter with draft-verify-draft; save `final.pt` in the run folder.

    Returns the path of final.pt, or of last.pt when `--stop-after` ended this
    invocation before the run was complete.
    """
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    place = placement(a.device, a.dtype)
    cfg, state, init_meta = load_init(a.init)
    cfg = {k: v for k, v in cfg.items() if k != "carryover_config"}
    cfg, state = attach_markov_head(cfg, state, a.markov_rank, a.seed)
    dcfg = DrafterConfig.from_dict(cfg)
    model = TorchDrafter(dcfg, target_embedding(a.target))
    model.load_checkpoint_state(state)
    model.to(place.device)
    # the rejected embedding is new (zero) while the rest is trained: let it move faster
    groups = param_groups(model, a, a.rejected_lr_mult)
    params = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    layer_ids = list(dcfg.target_layer_ids)
    decoder = target_decoder(a, place, layer_ids)  # verify passes, online states too

    online = a.target_states == "online"
    with rank0_first():  # rank 0 fills the target-state cache, the others read it
        seqs = load_sequences(a.target, a.data, layer_ids, cached=not online)
    feed = sequence_feed(place, layer_ids, decoder if online else None)
    train, heldout = seqs["train"], seqs["heldout"]
    weights = slot_weights(dcfg.block_size - 1, a.gamma)
    counts = {"first_label_tokens": 0, "second_label_tokens": 0, "anchors": 0,
              "second_drafts": 0, "carried_states": 0, "target_tokens": 0}
    loop = Trainer(a, "carryover", model, params, opt, cfg, train, counts, place, feed)

    def heldout_eval() -> dict[str, Any]:
        with place.autocast():
            return _summary(evaluate(model, decoder, heldout, a.eval_anchors_per_seq, feed))

    if loop.main and "heldout_initial" not in loop.done.notes:  # the init drafter's
        loop.done.notes["heldout_initial"] = heldout_eval()
        print("initial heldout " + json.dumps(loop.done.notes["heldout_initial"]))

    def seq_loss(seq: Sequence, anchors: torch.Tensor, ids: torch.Tensor | None) -> SeqResult:
        r = draft_verify_draft(model, decoder, seq.tokens, seq.aux, anchors, ids,
                               first_loss=a.first_draft_weight > 0)
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
    meta = {"recipe": "dspark-carryover" if dcfg.markov_rank else "carryover",
            "steps": done.step, "trained_label_tokens": label_tokens,
            **counts, "train_seconds": round(done.train_seconds, 1),
            "label_tokens_per_s": round(label_tokens / max(done.train_seconds, 1e-9), 1),
            "anchors_per_s": round(counts["anchors"] / max(done.train_seconds, 1e-9), 2),
            "init_checkpoint": _display(a.init),
            "init_meta": {k: init_meta.get(k) for k in (
                "recipe", "steps", "trained_label_tokens", "train_seconds",
                "label_tokens_per_s") if k in init_meta},
            "data": a.data, "data_manifest_sha256": loop.data_sha,
            "train_sequences": len(train), "heldout_sequences": len(heldout),
            "processes": loop.world, "heldout": final,
            "heldout_initial": done.notes["heldout_initial"], "evals": done.evals,
            "args": {k: (_display(v) if k == "init" else v) for k, v in meta_args(a).items()}}
    return loop.save_final(cfg, model.checkpoint_state(), meta)


def _summary(st: dict[str, BlockStats]) -> dict[str, Any]:
    return {f"{name}_tau": round(s.tau(), 4) for name, s in st.items()} | {
        f"{name}_acc": s.accuracy() for name, s in st.items()}


def _display(init: str) -> str:
    """An init path relative to the repository when it is inside it (portable metadata)."""
    try:
        return str(Path(init).resolve().relative_to(CHECKPOINTS.parent.parent))
    except ValueError:
        return init
