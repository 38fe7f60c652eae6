"""Training recipes against brute-force per-anchor loops on a tiny random Llama.

The parallel passes (one block-sparse target forward over all drafted blocks,
one drafter forward over all blocks) must equal running each anchor alone the
way inference does: the target on T[0..p] + drafts, the drafter through
`TorchDrafter.draft_logits` with the carried-over states as its slot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_carryover.train.baseline import (
    Sequence,
    attach_markov_head,
    block_logits,
)
from vllm_carryover.train.dflash_loss import accepted_length, slot_weights, weighted_block_ce
from vllm_carryover.train.draft_verify_draft import (
    context_kv,
    draft_verify_draft,
    rejected_states,
    second_anchor_ok,
    second_draft_logits,
)
from vllm_carryover.train.target_states import aux_states, truncated_decoder
from vllm_carryover.train.vocab_subset import remap_labels, restricted_head, step_vocab

from vllm_carryover.drafter.checkpoint import load_drafter_state
from vllm_carryover.drafter.format import DrafterConfig
from vllm_carryover.drafter.init_drafter import init_drafter
from vllm_carryover.drafter.markov_head import MARKOV_W1, MARKOV_W2
from vllm_carryover.drafter.target_weights import target_embedding
from vllm_carryover.drafter.torch_model import TorchDrafter

BLOCK = 6  # K = 5
LAYER_IDS = [0, 2]
ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TorchDrafter]:
    """A tiny Llama target folder and a random drafter for it (non-zero rejected mark)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("tiny_train")
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, max_position_embeddings=512,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp / "target")
    init_drafter(tmp / "target", tmp / "drafter", block_size=BLOCK,
                 target_layer_ids=LAYER_IDS, intermediate_size=128, seed=0)
    dcfg, state = load_drafter_state(tmp / "drafter")
    state["rejected_embedding"] = torch.randn(64, generator=torch.Generator().manual_seed(1))
    model = TorchDrafter(DrafterConfig.from_dict(dcfg), target_embedding(str(tmp / "target")))
    model.load_checkpoint_state(state)
    return tmp / "target", model


def decoder_for(target: Path, attn: str = "sdpa") -> Any:
    """The truncated target decoder as training loads it, with a chosen attention."""
    dec = truncated_decoder(str(target), max(LAYER_IDS))
    dec.set_attn_implementation(attn)
    return dec


def sequence(decoder: Any, length: int, seed: int) -> Sequence:
    """Random tokens and their float32 aux target states."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 256, (length,), generator=gen)
    aux = aux_states(decoder, [tokens.tolist()], LAYER_IDS)[0].clone()
    return Sequence(tokens, 3, aux)


def synthetic_drafts(tokens: torch.Tensor, anchors: torch.Tensor, k: int, seed: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts that equal the true tokens up to a chosen a (0..K), then differ."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(0, k + 1, (anchors.shape[0],), generator=gen)
    a[:k + 1] = torch.arange(k + 1)[: anchors.shape[0]]  # every a at least once
    drafts = torch.randint(1, 256, (anchors.shape[0], k), generator=gen)
    for i, p in enumerate(anchors.tolist()):
        drafts[i, : a[i]] = tokens[p + 1: p + 1 + a[i]]
        if a[i] < k and drafts[i, a[i]] == tokens[p + 1 + a[i]]:
            drafts[i, a[i]] = tokens[p + 1 + a[i]] % 255 + 1
    return drafts, a


def brute_rejected(decoder: Any, tokens: torch.Tensor, p: int, drafts: torch.Tensor,
                   a: int) -> torch.Tensor:
    """The target alone on T[0..p] + d_1..d_K; aux states at d_{a+1}..d_K."""
    ids = tokens[: p + 1].tolist() + drafts.tolist()
    return aux_states(decoder, [ids], LAYER_IDS)[0][p + 1 + a:]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_parallel_verify_equals_per_anchor_target_runs(tiny, attn: str) -> None:
    target, _ = tiny
    decoder = decoder_for(target, attn)
    seq = sequence(decoder, 48, seed=2)
    k = BLOCK - 1
    anchors = torch.tensor([3, 5, 6, 11, 17, 20, 26, 31, 40, 42])
    drafts, a = synthetic_drafts(seq.tokens, anchors, k, seed=3)
    assert torch.equal(accepted_length(drafts, seq.tokens[anchors[:, None] + 1
                                                          + torch.arange(k)]), a)
    rej = rejected_states(decoder, seq.tokens, anchors, drafts, a, LAYER_IDS)
    assert rej.states.shape[0] == int((k - a).sum())
    for i, p in enumerate(anchors.tolist()):
        rows = rej.anchor == i
        assert torch.equal(rej.slot[rows], torch.arange(int(a[i]), k))
        want = brute_rejected(decoder, seq.tokens, p, drafts[i], int(a[i]))
        torch.testing.assert_close(rej.states[rows], want, atol=ATOL, rtol=ATOL)
    # all accepted: nothing to run
    none = rejected_states(decoder, seq.tokens, anchors[:2], drafts[:2],
                           torch.full((2,), k), LAYER_IDS)
    assert none.states.shape == (0, 64 * len(LAYER_IDS))


def test_parallel_second_draft_equals_draft_logits_loop(tiny) -> None:
    target, model = tiny
    decoder = decoder_for(target)
    seq = sequence(decoder, 48, seed=4)
    k = BLOCK - 1
    anchors = torch.tensor([3, 4, 9, 14, 15, 22, 27, 30, 33, 36])
    drafts, a = synthetic_drafts(seq.tokens, anchors, k, seed=5)
    assert second_anchor_ok(anchors, a, k, 48).all()
    rej = rejected_states(decoder, seq.tokens, anchors, drafts, a, LAYER_IDS)
    with torch.no_grad():
        kc, vc = context_kv(model, seq.aux)
        got, labels = second_draft_logits(model, kc, vc, seq.tokens, anchors, a, rej)
        plain, _ = second_draft_logits(model, kc, vc, seq.tokens, anchors, a, rej,
                                       use_slot=False)
        fused = model.fuse(seq.aux)
        want, want_plain = [], []
        for i, p in enumerate(anchors.tolist()):
            p2 = p + int(a[i]) + 1
            rows = rej.anchor == i
            args = (fused[:p2], torch.arange(p2), int(seq.tokens[p2]), p2, k)
            want.append(model.draft_logits(*args, model.fuse(rej.states[rows]),
                                           p + 1 + rej.slot[rows]))
            want_plain.append(model.draft_logits(*args))
            assert torch.equal(labels[i], seq.tokens[p2 + 1: p2 + 1 + k])
    want_t, plain_t = torch.stack(want), torch.stack(want_plain)
    torch.testing.assert_close(got, want_t, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(plain, plain_t, atol=ATOL, rtol=ATOL)
    w = slot_weights(k, 4.0)
    torch.testing.assert_close(weighted_block_ce(got, labels, w)[0],
                               weighted_block_ce(want_t, labels, w)[0], atol=ATOL, rtol=ATOL)
    # the carried states change the draft exactly where something was rejected
    changed = (got - plain).abs().amax(dim=(1, 2)) > 1e-4
    assert torch.equal(changed, a < k)


def test_draft_verify_draft_end_to_end_equals_brute_force(tiny) -> None:
    """The whole pass with the drafter's own greedy drafts vs a per-anchor loop."""
    target, model = tiny
    decoder = decoder_for(target)
    seq = sequence(decoder, 40, seed=6)
    k = BLOCK - 1
    # make some drafts right: copy the drafter's greedy drafts into the sequence
    anchors = torch.tensor([4, 12, 20, 28])
    with torch.no_grad():
        fused = model.fuse(seq.aux)
        for j, p in enumerate(anchors.tolist()):
            d = model.draft_logits(fused[:p], torch.arange(p), int(seq.tokens[p]), p,
                                   k).argmax(-1)
            seq.tokens[p + 1: p + 1 + j + 1] = d[: j + 1]  # anchor j: a >= j + 1
            seq.aux = aux_states(decoder, [seq.tokens.tolist()], LAYER_IDS)[0].clone()
            fused = model.fuse(seq.aux)
    anchors = torch.tensor([4, 12, 20, 28, 34, 35])
    with torch.no_grad():
        r = draft_verify_draft(model, decoder, seq.tokens, seq.aux, anchors)
        assert (r.accepted[:4] >= torch.arange(1, 5)).all(), r.accepted
        assert r.keep.tolist() == [True, True, True, True, False, False]
        want_first = []
        for i, p in enumerate(anchors.tolist()):
            want_first.append(model.draft_logits(fused[:p], torch.arange(p),
                                                 int(seq.tokens[p]), p, k))
            d = want_first[-1].argmax(-1)
            assert torch.equal(r.drafts[i], d)
            if not r.keep[i]:
                continue
            a = int(r.accepted[i])
            rows = r.rejected.anchor == int(r.keep[:i].sum())
            brute = brute_rejected(decoder, seq.tokens, p, d, a)
            torch.testing.assert_close(r.rejected.states[rows], brute, atol=ATOL, rtol=ATOL)
            p2 = p + a + 1
            want = model.draft_logits(fused[:p2], torch.arange(p2), int(seq.tokens[p2]), p2,
                                      k, model.fuse(brute), torch.arange(p + a + 1, p + k + 1))
            j = int(r.keep[:i].sum())
            torch.testing.assert_close(r.second_logits[j], want, atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(r.first_logits, torch.stack(want_first), atol=ATOL,
                                   rtol=ATOL)


def test_control_arm_second_draft_is_plain_drafting_at_the_next_anchor(tiny) -> None:
    """--hide-carried: the second draft sees no carried row (so the rejected embedding
    gets no gradient) and equals a plain draft at p' = p + a + 1."""
    target, model = tiny
    decoder = decoder_for(target)
    seq = sequence(decoder, 40, seed=6)
    anchors = torch.tensor([4, 12, 20])
    k = BLOCK - 1
    r = draft_verify_draft(model, decoder, seq.tokens, seq.aux, anchors, use_slot=False)
    assert r.rejected.states.shape[0] == 0 and r.keep.all()
    r.second_logits.sum().backward()
    assert model.rejected_embedding.grad is None or not model.rejected_embedding.grad.any()
    with torch.no_grad():
        fused = model.fuse(seq.aux)
        for i, p in enumerate(anchors.tolist()):
            p2 = p + int(r.accepted[i]) + 1
            want = model.draft_logits(fused[:p2], torch.arange(p2), int(seq.tokens[p2]), p2, k)
            torch.testing.assert_close(r.second_logits[i], want, atol=ATOL, rtol=ATOL)


def test_slot_proposals_fill_the_slots_of_both_drafts_at_their_own_anchors(tiny) -> None:
    """A slot-proposal drafter (train/slot_proposals.py): row p of the proposals fills
    the block anchored at p, in the first draft and in the second at p' = p + a + 1;
    slots without a proposal keep the mask token."""
    target, model = tiny
    decoder = decoder_for(target)
    seq = sequence(decoder, 40, seed=6)
    anchors, k = torch.tensor([4, 12, 20]), BLOCK - 1
    gen = torch.Generator().manual_seed(3)
    proposals = torch.randint(1, 256, (40, k), generator=gen)
    proposals[torch.rand(40, k, generator=gen) < 0.3] = -1
    mask = model.config.mask_token_id

    def by_hand(p: int) -> torch.Tensor:
        """The block at p, its slots filled one by one, drafted over the context < p."""
        ids = torch.tensor([int(seq.tokens[p])] + [
            int(t) if t >= 0 else mask for t in proposals[p]])
        ctx_k, ctx_v = context_kv(model, seq.aux)
        visible = (torch.arange(ctx_k.shape[1]) < p)[None]
        out = model(ids[None], torch.arange(p, p + BLOCK)[None], ctx_k[:, None],
                    ctx_v[:, None], visible)
        return model.teacher_forced(out[:, 1:], torch.cat(
            [ids[:1], seq.tokens[p + 1:p + k]])[None])[0]

    with torch.no_grad():
        r = draft_verify_draft(model, decoder, seq.tokens, seq.aux, anchors,
                               use_slot=False, proposals=proposals)
        for i, p in enumerate(anchors.tolist()):
            torch.testing.assert_close(r.first_logits[i], by_hand(p), atol=ATOL, rtol=ATOL)
            torch.testing.assert_close(r.second_logits[i], by_hand(p + int(r.accepted[i]) + 1),
                                       atol=ATOL, rtol=ATOL)
        plain = draft_verify_draft(model, decoder, seq.tokens, seq.aux, anchors,
                                   use_slot=False)
        assert not torch.allclose(plain.first_logits, r.first_logits)


def test_no_second_block_inside_the_sequence(tiny) -> None:
    """Anchors too close to the end train only their first draft (no crash, zero loss)."""
    target, model = tiny
    decoder = decoder_for(target)
    seq = sequence(decoder, 20, seed=10)
    r = draft_verify_draft(model, decoder, seq.tokens, seq.aux, torch.tensor([14, 16, 18]))
    assert not r.keep.any() and r.rejected.states.shape[0] == 0
    assert r.second_logits.shape == (0, BLOCK - 1, 256)
    loss = weighted_block_ce(r.second_logits, r.second_labels, slot_weights(BLOCK - 1, 4.0))[0]
    assert float(loss) == 0.0


def test_few_steps_lower_the_carryover_loss(tiny) -> None:
    """Sampled-softmax training steps lower both losses (full-vocabulary evaluation)."""
    target, model0 = tiny
    decoder = decoder_for(target)
    model = TorchDrafter(model0.config, model0.embed)
    model.load_checkpoint_state(model0.checkpoint_state())
    seqs = [sequence(decoder, 40, seed=s) for s in (7, 8)]
    anchors = torch.arange(3, 30, 2)
    w = slot_weights(BLOCK - 1, 4.0)
    vocab = torch.unique(torch.cat([s.tokens for s in seqs]))
    ids = step_vocab(vocab, 256, 16, torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def losses(head: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(second-draft loss, first-draft loss) summed over the sequences."""
        second, first = torch.zeros(()), torch.zeros(())
        for s in seqs:
            r = draft_verify_draft(model, decoder, s.tokens, s.aux, anchors, head)
            assert r.keep.any() and (r.accepted < BLOCK - 1).any()
            lab = (lambda x: x) if head is None else (lambda x: remap_labels(x, head, 256))
            second = second + weighted_block_ce(r.second_logits, lab(r.second_labels), w)[0]
            first = first + weighted_block_ce(r.first_logits, lab(r.first_labels), w)[0]
        return second, first

    with torch.no_grad():
        before = losses(None)
    for _ in range(8):
        opt.zero_grad()
        sum(losses(ids)).backward()
        assert model.rejected_embedding.grad.abs().sum() > 0
        assert model.fc.weight.grad.abs().sum() > 0
        opt.step()
    with torch.no_grad():
        after = losses(None)
    assert after[0] < 0.95 * before[0], (before, after)
    assert after[1] < 0.95 * before[1], (before, after)


def test_baseline_blocks_equal_per_anchor_draft_logits(tiny) -> None:
    target, model = tiny
    decoder = decoder_for(target)
    seq = sequence(decoder, 30, seed=9)
    k = BLOCK - 1
    anchors = torch.tensor([3, 7, 8, 15, 24, 27, 28])  # the last ones run past the end
    with torch.no_grad():
        got, labels = block_logits(model, seq, anchors)
        fused = model.fuse(seq.aux)
        want = torch.stack([model.draft_logits(fused[:p], torch.arange(p), int(seq.tokens[p]),
                                               p, k) for p in anchors.tolist()])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
    for i, p in enumerate(anchors.tolist()):
        n = min(k, 30 - p - 1)
        assert torch.equal(labels[i, :n], seq.tokens[p + 1: p + 1 + n])
        assert (labels[i, n:] == -100).all()
    w = slot_weights(k, 4.0)
    torch.testing.assert_close(weighted_block_ce(got, labels, w)[0],
                               weighted_block_ce(want, labels, w)[0], atol=ATOL, rtol=ATOL)


# -- the semi-autoregressive variant (Markov head) ----------------------------------------


@pytest.fixture(scope="module")
def tiny_markov(tiny) -> TorchDrafter:
    """The tiny drafter plus a random Markov head of rank 8 (large enough to steer drafts)."""
    _, model = tiny
    cfg = DrafterConfig(**{**vars(model.config), "markov_rank": 8})
    head = TorchDrafter(cfg, model.embed)
    gen = torch.Generator().manual_seed(2)
    head.load_checkpoint_state(model.checkpoint_state() | {
        MARKOV_W1: torch.randn(256, 8, generator=gen),
        MARKOV_W2: torch.randn(256, 8, generator=gen) / 2})
    return head


def test_markov_drafts_go_left_to_right_and_trained_logits_are_teacher_forced(
        tiny, tiny_markov) -> None:
    """draft-verify-draft with a Markov head vs a per-anchor loop: the first drafts are
    the greedy left-to-right picks (so the rejected states are the target's at those
    tokens), the trained logits add the bias of the TRUE previous token."""
    target, _ = tiny
    model = tiny_markov
    decoder = decoder_for(target)
    seq = sequence(decoder, 40, seed=11)
    k = BLOCK - 1
    anchors = torch.arange(3, 33, 3)
    with torch.no_grad():
        r = draft_verify_draft(model, decoder, seq.tokens, seq.aux, anchors)
        fused = model.fuse(seq.aux)
        steered = 0
        for i, p in enumerate(anchors.tolist()):
            base = model.draft_logits(fused[:p], torch.arange(p), int(seq.tokens[p]), p, k)
            drafts = model.draft_tokens(base[None], seq.tokens[p:p + 1])[0]
            assert torch.equal(r.drafts[i], drafts)
            steered += not torch.equal(drafts, base.argmax(-1))
            true_prev = seq.tokens[p:p + k]
            torch.testing.assert_close(r.first_logits[i], model.teacher_forced(base, true_prev),
                                       atol=ATOL, rtol=ATOL)
            if not r.keep[i]:
                continue
            a, j = int(r.accepted[i]), int(r.keep[:i].sum())
            brute = brute_rejected(decoder, seq.tokens, p, drafts, a)
            torch.testing.assert_close(r.rejected.states[r.rejected.anchor == j], brute,
                                       atol=ATOL, rtol=ATOL)
            p2 = p + a + 1
            want = model.draft_logits(fused[:p2], torch.arange(p2), int(seq.tokens[p2]), p2,
                                      k, model.fuse(brute), torch.arange(p + a + 1, p + k + 1))
            torch.testing.assert_close(r.second_logits[j],
                                       model.teacher_forced(want, seq.tokens[p2:p2 + k]),
                                       atol=ATOL, rtol=ATOL)
    assert steered > 0, "the head should change some drafts"


def test_teacher_forced_greedy_acceptance_equals_left_to_right_acceptance(tiny_markov) -> None:
    """Why the recipes may train and evaluate teacher-forced: a slot counts only while
    every earlier draft was right, and then the drafted previous token is the true one."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(400, BLOCK - 1, 256, generator=gen)
    tokens = torch.randint(0, 256, (400, BLOCK), generator=gen)
    with torch.no_grad():
        drafts = tiny_markov.draft_tokens(base, tokens[:, 0])
        labels = tokens[:, 1:].clone()
        # make long accepted prefixes common: copy a random prefix of the drafts
        cut = torch.randint(0, BLOCK, (400,), generator=gen)
        keep = torch.arange(BLOCK - 1)[None, :] < cut[:, None]
        labels[keep] = drafts[keep]
        prev = torch.cat([tokens[:, :1], labels[:, :-1]], dim=1)
        forced = tiny_markov.teacher_forced(base, prev).argmax(-1)
    assert torch.equal(accepted_length(forced, labels), accepted_length(drafts, labels))
    assert (accepted_length(drafts, labels) >= 3).sum() > 50


def test_fresh_markov_head_starts_as_the_drafter_it_extends_and_learns(tiny) -> None:
    """--markov-rank on a trained drafter: same logits at step 0, then the head's w2
    learns through the sampled softmax and the teacher-forced loss falls."""
    target, model0 = tiny
    decoder = decoder_for(target)
    cfg = {**vars(model0.config), "markov_rank": 0, "vocab_size": 256,
           "target_layer_ids": list(model0.config.target_layer_ids)}
    cfg2, state = attach_markov_head(cfg, model0.checkpoint_state(), 8, seed=0)
    assert cfg2["markov_rank"] == 8
    model = TorchDrafter(DrafterConfig(**{**cfg2, "target_layer_ids": LAYER_IDS}),
                         model0.embed)
    model.load_checkpoint_state(state)
    seq = sequence(decoder, 40, seed=12)
    anchors = torch.arange(3, 33, 2)
    with torch.no_grad():
        torch.testing.assert_close(block_logits(model, seq, anchors)[0],
                                   block_logits(model0, seq, anchors)[0])
    ids = step_vocab(torch.unique(seq.tokens), 256, 16, torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.markov_head.parameters(), lr=3e-2)
    w = slot_weights(BLOCK - 1, 4.0)

    def loss() -> torch.Tensor:
        with restricted_head(model, ids):
            logits, labels = block_logits(model, seq, anchors)
        return weighted_block_ce(logits, remap_labels(labels, ids, 256), w)[0]

    before = loss().item()
    for _ in range(10):
        opt.zero_grad()
        loss().backward()
        opt.step()
    assert loss().item() < 0.9 * before
    assert model.markov_head.markov_w2.weight.abs().sum() > 0
