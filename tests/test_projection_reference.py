"""The context projection: rejected rows get the mark, everything else is plain DFlash."""

from __future__ import annotations

import torch
from vllm_carryover.kernels import project_context_kv_reference

from vllm_carryover.drafter.format import DrafterConfig, make_config_dict, random_state_dict
from vllm_carryover.drafter.torch_model import TorchDrafter

TARGET = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
          "max_position_embeddings": 256}


def drafter(seed: int = 0) -> TorchDrafter:
    cfg = DrafterConfig.from_dict(make_config_dict(
        TARGET, num_layers=2, block_size=5, target_layer_ids=[1, 3], mask_token_id=0))
    model = TorchDrafter(cfg, torch.randn(100, 64, generator=torch.Generator().manual_seed(9)))
    state = random_state_dict(cfg, seed)
    state["rejected_embedding"] = torch.randn(64, generator=torch.Generator().manual_seed(1))
    model.load_checkpoint_state(state)
    return model.eval()


def test_no_rejected_row_gives_exactly_the_plain_projection():
    m = drafter()
    x, pos = torch.randn(7, 64), torch.arange(7)
    w = m.projection_weights()
    k0, v0 = project_context_kv_reference(x, pos, None, w)
    k1, v1 = project_context_kv_reference(x, pos, torch.zeros(7, dtype=torch.bool), w)
    assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_rejected_mark_changes_only_the_marked_rows():
    m = drafter()
    x, pos = torch.randn(7, 64), torch.arange(7)
    rejected = torch.tensor([False] * 4 + [True] * 3)
    w = m.projection_weights()
    k0, v0 = project_context_kv_reference(x, pos, None, w)
    k1, v1 = project_context_kv_reference(x, pos, rejected, w)
    assert torch.equal(k0[:, :4], k1[:, :4]) and torch.equal(v0[:, :4], v1[:, :4])
    assert not torch.allclose(k0[:, 4:], k1[:, 4:])


@torch.no_grad()
def test_changing_only_rejected_states_changes_draft_logits_and_empty_slot_does_not():
    m = drafter()
    ctx, ctx_pos = torch.randn(10, 64), torch.arange(10)
    slot_a, slot_b, slot_pos = torch.randn(3, 64), torch.randn(3, 64), torch.arange(11, 14)
    plain = m.draft_logits(ctx, ctx_pos, 5, 11, 4)
    empty = m.draft_logits(ctx, ctx_pos, 5, 11, 4, torch.zeros(0, 64), slot_pos[:0])
    a = m.draft_logits(ctx, ctx_pos, 5, 11, 4, slot_a, slot_pos)
    b = m.draft_logits(ctx, ctx_pos, 5, 11, 4, slot_b, slot_pos)
    assert torch.equal(plain, empty)
    assert (a - plain).abs().max() > 1e-3
    assert (a - b).abs().max() > 1e-3


@torch.no_grad()
def test_attention_over_context_and_slot_equals_one_softmax_over_concatenated_keys():
    """Keys in any order give the same non-causal attention: slot after context."""
    m = drafter()
    ctx, ctx_pos = torch.randn(6, 64), torch.arange(6)
    slot, slot_pos = torch.randn(2, 64), torch.tensor([7, 8])
    rejected = torch.tensor([False] * 6 + [True] * 2)
    k, v = m.context_kv(torch.cat([ctx, slot]), torch.cat([ctx_pos, slot_pos]), rejected)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(3))
    ids, pos = torch.tensor([[5, 0, 0, 0, 0]]), torch.arange(7, 12)[None]
    together = m(ids, pos, k[:, None], v[:, None])
    shuffled = m(ids, pos, k[:, perm][:, None], v[:, perm][:, None])
    torch.testing.assert_close(together, shuffled, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together[0, 1:], m.draft_logits(ctx, ctx_pos, 5, 7, 4, slot,
                                                               slot_pos), atol=1e-5, rtol=1e-5)


def test_a_shared_context_gives_the_logits_and_gradients_of_one_copy_per_row():
    """Training passes one context for all anchors of a sequence (never expanded per
    row): the same numbers as each row holding its own copy, masked alike."""
    m = drafter().train()
    s, anchors = 12, torch.tensor([2, 5, 9, 11])
    aux, ids = torch.randn(s, 128), torch.randint(100, (4, 5))
    pos = anchors[:, None] + torch.arange(5)
    mask = torch.arange(s)[None, :] < anchors[:, None]

    def logits_and_grads(copies: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        m.zero_grad()
        k, v = m.context_kv(m.fuse(aux), torch.arange(s))
        out = m(ids, pos, k[:, None].expand(-1, copies, -1, -1, -1),
                v[:, None].expand(-1, copies, -1, -1, -1), mask)
        out.square().mean().backward()
        return out.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]

    shared, grads_shared = logits_and_grads(1)
    per_row, grads_per_row = logits_and_grads(4)
    torch.testing.assert_close(shared, per_row, rtol=1e-5, atol=1e-5)
    assert len(grads_shared) == len(grads_per_row) > 0
    for a, b in zip(grads_shared, grads_per_row, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_rows_own_keys_after_a_shared_context_are_keys_after_a_copied_one():
    """Carryover training's second draft: the shared context, then each row's own slot
    keys (some masked), gives what one context + slot copy per row gives."""
    m = drafter()
    s, anchors = 12, torch.tensor([2, 5, 9])
    ids, pos = torch.randint(100, (3, 5)), anchors[:, None] + 1 + torch.arange(5)
    k, v = m.context_kv(m.fuse(torch.randn(s, 128)), torch.arange(s))
    slot_k, slot_v = torch.randn(2, 3, 4, 2, 16), torch.randn(2, 3, 4, 2, 16)
    mask = torch.cat([torch.arange(s)[None, :] <= anchors[:, None],
                      torch.rand(3, 4) < 0.5], dim=1)
    with torch.no_grad():
        shared = m(ids, pos, k[:, None], v[:, None], mask, row_k=slot_k, row_v=slot_v)
        copied = m(ids, pos, torch.cat([k[:, None].expand(-1, 3, -1, -1, -1), slot_k], dim=2),
                   torch.cat([v[:, None].expand(-1, 3, -1, -1, -1), slot_v], dim=2), mask)
    torch.testing.assert_close(shared, copied, rtol=1e-5, atol=1e-5)
