"""Why a new drafter has two layers: a one-layer block drafter cannot continue repeated
text, a two-layer one learns to.

In the first layer a draft slot's query is the mask embedding plus its position, so it
cannot ask the context where the bonus token occurred before; from the second layer on it
can (it has read the bonus token from the block), and the context row after that
occurrence says what came next. The synthetic task: each sequence repeats a random
segment after random filler, so the repeat's next token is knowable only by that lookup
(no fixed bigram, no fixed offset). A context row carries its token and the one before
it, as a target's states do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm_carryover.train.draft_verify_draft import block_logits_over, context_kv

from vllm_carryover.drafter.format import DrafterConfig, make_config_dict
from vllm_carryover.drafter.torch_model import TorchDrafter

VOCAB, HIDDEN, BLOCK = 24, 64, 4
TARGET = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
          "num_hidden_layers": 2, "max_position_embeddings": 256, "rope_theta": 10000.0,
          "rms_norm_eps": 1e-5}


def repeat_sequence(gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """(tokens, start of the repeat): filler, a segment of distinct tokens, filler, the
    segment again; tokens 1.. (0 is the mask)."""
    seg_len = int(torch.randint(8, 14, (1,), generator=gen))
    seg = torch.randperm(VOCAB - 1, generator=gen)[:seg_len] + 1
    fill = [torch.randint(1, VOCAB, (int(torch.randint(1, 8, (1,), generator=gen)),),
                          generator=gen) for _ in range(2)]
    tokens = torch.cat([fill[0], seg, fill[1], seg])
    return tokens, tokens.shape[0] - seg_len


def copy_accuracy_after_training(layers: int, steps: int = 1200) -> float:
    """Slot-1 accuracy on held-out repeats of a drafter trained on them (slot 1 and, as
    `train baseline --bonus-weight` does, the bonus row)."""
    torch.manual_seed(0)
    cfg = make_config_dict(TARGET, num_layers=layers, block_size=BLOCK, target_layer_ids=[0],
                           mask_token_id=0, intermediate_size=2 * HIDDEN)
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen) * 3 / HIDDEN ** 0.5
    this = torch.randn(VOCAB, HIDDEN, generator=gen)
    model = TorchDrafter(DrafterConfig.from_dict(cfg), embed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def first_rows(tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [A, 2, V] of the bonus row and slot 1, slot 1's labels [A])."""
        aux = this[tokens] + embed[torch.cat([tokens[:1], tokens[:-1]])]
        k, v = context_kv(model, aux)
        anchors = torch.arange(start, tokens.shape[0] - BLOCK)
        rows, blocks = block_logits_over(model, k, v, tokens, anchors, with_bonus=True)
        return rows[:, :2], blocks.labels[:, 0]

    for _ in range(steps):
        loss = torch.zeros(())
        for _ in range(4):
            rows, label = first_rows(*repeat_sequence(gen))
            loss = loss + F.cross_entropy(rows.flatten(0, 1), label.repeat_interleave(2))
        opt.zero_grad()
        loss.backward()
        opt.step()
    right = total = 0
    with torch.no_grad():
        for _ in range(40):
            rows, label = first_rows(*repeat_sequence(gen))
            right += int((rows[:, 1].argmax(-1) == label).sum())
            total += label.numel()
    return right / total


def test_two_layers_learn_to_copy_repeated_text_that_one_layer_cannot() -> None:
    torch.set_num_threads(1)
    assert copy_accuracy_after_training(1) < 0.3
    assert copy_accuracy_after_training(2) > 0.9
