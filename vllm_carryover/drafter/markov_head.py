"""The Markov head of the semi-autoregressive (DSpark-derived) drafter.

The parallel backbone gives every block slot its logits in one pass, so slot i
cannot know which token slot i - 1 chose. The Markov head adds that dependency
cheaply: drafting goes left to right over the block and slot i's logits get
the low-rank bias `w1[x_prev] @ w2.T`, where x_prev is the token drafted for
slot i - 1 (the bonus token for the first slot). Weight names follow vLLM's
in-tree DSpark checkpoints (`markov_head.markov_w1.weight` [V, r],
`markov_head.markov_w2.weight` [V, r]).

Training uses the same bias with teacher forcing (x_prev = the true token):
a draft counts only while every earlier draft was right, and then the drafted
previous token IS the true one, so teacher-forced accuracy is exactly the
greedy acceptance.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

MARKOV_W1 = "markov_head.markov_w1.weight"
MARKOV_W2 = "markov_head.markov_w2.weight"

# logits [B, V] -> (tokens [B], probabilities [B, V] or None when drafting greedily)
Sampler = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


class MarkovHead(nn.Module):
    """Previous token -> rank-r code -> logit bias over the vocabulary."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def bias(self, prev_ids: torch.Tensor, vocab_ids: torch.Tensor | None = None
             ) -> torch.Tensor:
        """Bias [..., V] (or [..., len(vocab_ids)]) for previous tokens `prev_ids` [...]."""
        w2 = self.markov_w2.weight if vocab_ids is None else self.markov_w2.weight[vocab_ids]
        return self.markov_w1(prev_ids) @ w2.T


def draft_left_to_right(base_logits: torch.Tensor, bonus: torch.Tensor, head: MarkovHead,
                        sample: Sampler) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft blocks slot by slot: (tokens [B, K], probabilities [B, K, V] or None).

    `base_logits` [B, K, V] are the backbone's; `bonus` [B] the tokens before slot 1.
    The probabilities are those each token was drawn from (what rejection
    sampling needs), so they include the bias of the token actually drawn before.
    """
    prev, tokens, probs = bonus, [], []
    for i in range(base_logits.shape[1]):
        tok, p = sample(base_logits[:, i] + head.bias(prev).to(base_logits.dtype))
        tokens.append(tok)
        probs.append(p)
        prev = tok
    stacked = None if probs[0] is None else torch.stack(probs, dim=1)
    return torch.stack(tokens, dim=1), stacked


def fresh_markov_state(vocab_size: int, rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Head weights to extend a trained drafter: w1 random, w2 zero, so the bias starts
    at zero (the drafter drafts as before) while w2's gradient does not vanish."""
    gen = torch.Generator().manual_seed(seed)
    return {MARKOV_W1: torch.randn(vocab_size, rank, generator=gen),
            MARKOV_W2: torch.zeros(vocab_size, rank)}


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, None]:
    return logits.argmax(dim=-1), None
