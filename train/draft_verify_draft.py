"""Draft-verify-draft: the pure tensor maths of carryover training, per sequence.

Plain DFlash training never shows the drafter a rejected state, so a carryover
drafter learns to use them from this pass. Per training sequence (true tokens
T, aux target states S) and for all sampled anchors p at once:

1. draft (no gradient, full vocabulary, greedy): the block `[T[p], MASK x K]`
   over the context states at positions < p gives d_1..d_K;
2. verify: a = number of leading d_j equal to T[p+j]; ONE target forward over
   one long sequence with a block-sparse 4D mask gives the target's aux states
   at every rejected draft d_{a+1}..d_K (positions p+a+1..p+K), exactly the rows
   vLLM hands the proposer after a verify step;
3. draft again at p' = p + a + 1 (the target's bonus token, T[p'] since the data
   are the target's own greedy responses) with context states < p' plus those
   rejected states as carried-over keys (rejected embedding added).

Which drafts are carried and at which positions is `vllm_carryover.slot`'s rule, the
one vLLM's batch planning uses too. The recipe around this (loss, optimiser,
checkpoints) is `train.carryover`; `train.headroom` reuses the same pieces.
Names: `ctx_k`/`ctx_v` are key/value tensors, `num_drafts` is K.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm_carryover.train.dflash_loss import Blocks, accepted_length, make_blocks
from vllm_carryover.train.slot_proposals import fill_slots
from vllm_carryover.train.vocab_subset import restricted_head

from vllm_carryover.drafter.torch_model import TorchDrafter
from vllm_carryover.slot import carried_drafts, draft_positions


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


def second_anchor_ok(anchors: torch.Tensor, accepted: torch.Tensor, num_drafts: int,
                     length: int) -> torch.Tensor:
    """Anchors whose next block p' = p + a + 1 has all K labels inside the sequence."""
    return anchors + accepted + 1 + num_drafts <= length - 1


def context_kv(model: TorchDrafter, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Committed-context K/V [L, T, kv, hd] of a whole sequence (fc, norm, projection)."""
    return model.context_kv(model.fuse(aux.float()),
                            torch.arange(aux.shape[0], device=aux.device))


def block_logits_over(model: TorchDrafter, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                      tokens: torch.Tensor, anchors: torch.Tensor, with_bonus: bool = False,
                      proposals: torch.Tensor | None = None) -> tuple[torch.Tensor, Blocks]:
    """Plain DFlash blocks over precomputed context K/V: (the backbone's logits
    [A, K, V], without any Markov bias; the blocks, with their labels [A, K]).
    `with_bonus`: the logits are [A, 1 + K, V], the bonus token's row first.
    `proposals` [T, K]: lookup proposals in the slots (`train.slot_proposals`)."""
    d = model.config
    blocks = make_blocks(tokens, anchors, d.block_size, d.mask_token_id, ctx_k.shape[1])
    blocks.query_ids = fill_slots(blocks.query_ids, anchors, proposals)
    # one context for all anchors, each masked to the positions before it
    logits = model(blocks.query_ids, blocks.query_pos, ctx_k[:, None], ctx_v[:, None],
                   blocks.ctx_mask)
    return (logits if with_bonus else logits[:, 1:]), blocks


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
    num_drafts, dev = drafts.shape[1], tokens.device
    rej = carried_drafts(accepted, num_drafts)  # [A, K]: the rejected drafts, the slot's rows
    anchor_idx, slot_idx = rej.nonzero(as_tuple=True)  # row-major: grouped by anchor
    last_true = anchors + accepted  # p + a: the last committed position
    n_true = int(last_true[anchor_idx].max()) + 1 if anchor_idx.numel() else 0
    ids = torch.cat([tokens[:n_true], drafts[anchor_idx, slot_idx]])
    pos = torch.cat([torch.arange(n_true, device=dev),
                     draft_positions(anchors, num_drafts)[anchor_idx, slot_idx]])
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


def second_draft_logits(model: TorchDrafter, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                        tokens: torch.Tensor, anchors: torch.Tensor,
                        accepted: torch.Tensor, rejected: Rejected,
                        use_slot: bool = True, proposals: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [A, K, V], labels [A, K]) of the blocks at p' = p + a + 1.

    Block i attends to context positions < p' and to its own anchor's rejected
    states (K slots per block, slot j visible iff j >= a_i, projected at their
    own positions with the rejected embedding), as the vLLM proposer drafts
    after a verify step. `rejected.anchor` indexes `anchors`. `use_slot=False`
    hides the slot: plain DFlash drafting at the same p' (the ablation). `proposals`
    [T, K]: lookup proposals in the slots (`train.slot_proposals`).
    """
    d = model.config
    num_drafts = d.block_size - 1
    a = anchors.shape[0]
    blocks = make_blocks(tokens, anchors + accepted + 1, d.block_size, d.mask_token_id,
                         ctx_k.shape[1])
    blocks.query_ids = fill_slots(blocks.query_ids, anchors + accepted + 1, proposals)
    if a == 0:  # no anchor has a next block inside the sequence
        return ctx_k.new_zeros(0, num_drafts, model.lm_head.shape[0]), blocks.labels
    dev = ctx_k.device
    slot_aux = torch.zeros(a, num_drafts, rejected.states.shape[-1], device=dev)
    slot_aux[rejected.anchor, rejected.slot] = rejected.states.float()
    slot_pos = draft_positions(anchors, num_drafts)
    slot_k, slot_v = model.context_kv(model.fuse(slot_aux.flatten(0, 1)), slot_pos.flatten(),
                                      torch.ones(a * num_drafts, dtype=torch.bool, device=dev))
    slot_k = slot_k.view(slot_k.shape[0], a, num_drafts, *slot_k.shape[2:])
    slot_v = slot_v.view(slot_v.shape[0], a, num_drafts, *slot_v.shape[2:])
    slot_mask = carried_drafts(accepted, num_drafts)
    mask = torch.cat([blocks.ctx_mask, slot_mask & use_slot], dim=1)
    # the shared context, then each block's own slot
    logits = model(blocks.query_ids, blocks.query_pos, ctx_k[:, None], ctx_v[:, None], mask,
                   row_k=slot_k, row_v=slot_v)
    return model.teacher_forced(logits[:, 1:], blocks.prev_ids), blocks.labels


def draft_verify_draft(model: TorchDrafter, decoder: Any, tokens: torch.Tensor,
                       aux: torch.Tensor, anchors: torch.Tensor,
                       head_ids: torch.Tensor | None = None,
                       first_loss: bool = True, use_slot: bool = True,
                       proposals: torch.Tensor | None = None) -> DraftVerifyDraft:
    """The whole pass for one sequence; logits carry gradients into the drafter.

    Drafts are always the full-vocabulary greedy ones (what inference proposes:
    left to right through a Markov head); `head_ids` restricts only the trained
    logits (sampled softmax), which are teacher-forced through a Markov head.
    `use_slot=False` is the control: the second draft without carried rows, so no
    verify pass is needed. `proposals` [T, K]: lookup proposals in both drafts' slots.
    """
    d = model.config
    num_drafts = d.block_size - 1
    ctx_k, ctx_v = context_kv(model, aux)
    first = None
    if first_loss and head_ids is None:  # full-vocabulary loss: one forward does both
        base, blocks = block_logits_over(model, ctx_k, ctx_v, tokens, anchors,
                                         proposals=proposals)
        first = model.teacher_forced(base, blocks.prev_ids)
        drafts = model.draft_tokens(base.detach(), blocks.query_ids[:, 0])
    else:
        with torch.no_grad():
            base, blocks = block_logits_over(model, ctx_k.detach(), ctx_v.detach(), tokens,
                                             anchors, proposals=proposals)
            drafts = model.draft_tokens(base, blocks.query_ids[:, 0])
        if first_loss:
            with restricted_head(model, head_ids):
                base, _ = block_logits_over(model, ctx_k, ctx_v, tokens, anchors,
                                            proposals=proposals)
                first = model.teacher_forced(base, blocks.prev_ids)
    labels = blocks.labels
    accepted = accepted_length(drafts, labels)
    keep = second_anchor_ok(anchors, accepted, num_drafts, tokens.shape[0])
    if use_slot:
        rej = rejected_states(decoder, tokens, anchors[keep], drafts[keep], accepted[keep],
                              d.target_layer_ids)
        rej.states = rej.states.to(aux.dtype).float()  # same precision as the cached context
    else:
        none = anchors.new_zeros(0)
        rej = Rejected(aux.new_zeros(0, aux.shape[-1]).float(), none, none)
    with restricted_head(model, head_ids):
        second, labels2 = second_draft_logits(model, ctx_k, ctx_v, tokens, anchors[keep],
                                              accepted[keep], rej, use_slot, proposals)
    return DraftVerifyDraft(anchors, drafts, accepted, first, labels, keep, rej, second,
                            labels2)
