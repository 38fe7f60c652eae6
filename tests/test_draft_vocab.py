"""A draft vocabulary: ranking, the d2t map, the checkpoint round trip, the drafter's logits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from vllm_carryover.drafter.checkpoint import load_drafter_state, save_drafter
from vllm_carryover.drafter.format import D2T, LM_HEAD, DrafterConfig, random_state_dict
from vllm_carryover.drafter.torch_model import TorchDrafter
from vllm_carryover.drafter.vocab import (
    coverage,
    expand_logits,
    from_offsets,
    most_frequent,
    to_offsets,
    token_counts,
    with_draft_vocab,
)

VOCAB, HIDDEN = 100, 64
CONFIG = DrafterConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=1e4,
                       max_position_embeddings=256, block_size=4, mask_token_id=0,
                       target_layer_ids=(0, 1), target_hidden_size=HIDDEN, causal=False)


def test_most_frequent_keeps_the_top_tokens_and_the_forced_ones_sorted():
    counts = token_counts([[5, 5, 5, 7, 7, 9], [7, 3, 3, 3, 3]], VOCAB)
    assert counts[3] == 4 and counts[5] == 3 and counts[7] == 3 and counts[9] == 1
    assert most_frequent(counts, 3).tolist() == [3, 5, 7]  # ties: the lower id first
    assert most_frequent(counts, 3, always=[99]).tolist() == [3, 5, 99]
    assert coverage(counts, torch.tensor([3, 5, 7])) == pytest.approx(10 / 11)
    with pytest.raises(ValueError, match="must hold the 2 forced ones"):
        most_frequent(counts, 1, always=[1, 2])


def test_d2t_offsets_map_draft_ids_back_to_target_ids():
    ids = torch.tensor([0, 3, 4, 50, 99])
    assert to_offsets(ids).tolist() == [0, 2, 2, 47, 95]  # EAGLE-3's convention
    assert torch.equal(from_offsets(to_offsets(ids)), ids)


def test_expanded_logits_are_minus_infinity_outside_the_draft_vocabulary():
    ids = torch.tensor([1, 4])
    full = expand_logits(torch.tensor([[0.5, -2.0]]), ids, 6)
    assert full[0, 1] == 0.5 and full[0, 4] == -2.0
    assert torch.isinf(full[0, [0, 2, 3, 5]]).all()
    assert full.argmax(-1).item() == 1


def drafter_pair() -> tuple[TorchDrafter, TorchDrafter, torch.Tensor]:
    """The same drafter with the whole vocabulary and with a draft vocabulary."""
    embed = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1))
    state = random_state_dict(CONFIG)
    full = TorchDrafter(CONFIG, embed)
    full.load_checkpoint_state(state)
    ids = torch.tensor([0, 3, 5, 7, 50, 99])
    _, cut_state = with_draft_vocab({}, state, embed, ids)
    cut = TorchDrafter(dataclasses.replace(CONFIG, draft_vocab_size=len(ids)), embed)
    cut.load_checkpoint_state(cut_state)
    return full, cut, ids


def test_drafter_with_a_draft_vocabulary_scores_its_tokens_as_the_full_one_does():
    full, cut, ids = drafter_pair()
    gen = torch.Generator().manual_seed(2)
    query = torch.randint(VOCAB, (2, 4), generator=gen)
    pos = torch.arange(10, 14)[None].expand(2, 4)
    ctx_k, ctx_v = torch.randn(2, 1, 2, 10, 2, 16, generator=gen)
    a, b = full(query, pos, ctx_k, ctx_v), cut(query, pos, ctx_k, ctx_v)
    assert b.shape == a.shape
    torch.testing.assert_close(b[..., ids], a[..., ids])
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(b[..., outside]).all()
    assert set(b.argmax(-1).flatten().tolist()) <= set(ids.tolist())


def test_draft_vocabulary_survives_a_bfloat16_checkpoint_and_the_training_model(tmp_path: Path):
    _, cut, ids = drafter_pair()
    state = cut.checkpoint_state()
    assert state[D2T].dtype == torch.int64 and state[LM_HEAD].shape == (len(ids), HIDDEN)
    cfg = {"hidden_size": HIDDEN, "draft_vocab_size": len(ids)}
    folder = save_drafter(tmp_path / "d", cfg, state, dtype=torch.bfloat16)
    _, loaded = load_drafter_state(folder)
    assert loaded[D2T].dtype == torch.int64  # ids stay exact; weights are bf16
    assert torch.equal(from_offsets(loaded[D2T]), ids)
    assert loaded[LM_HEAD].dtype == torch.bfloat16


def test_training_negatives_come_from_the_draft_vocabulary():
    from vllm_carryover.train.vocab_subset import step_vocab

    universe = torch.tensor([2, 4, 8, 16, 32, 64])
    ids = step_vocab(torch.tensor([4, 8]), VOCAB, 50, torch.Generator().manual_seed(0),
                     universe)
    assert set(ids.tolist()) <= set(universe.tolist()) and {4, 8} <= set(ids.tolist())
