"""DFlash block training: anchor sampling, block inputs, context mask, weighted CE.

An anchor p opens the block `[token at p, MASK x (B-1)]` at positions p..p+B-1,
exactly like an inference round whose bonus token sits at p: the block sees the
target's context states at positions < p (committed context) and, non-causally,
itself. Block slot j (1..B-1) is trained to predict the true token at p + j,
weighted by exp(-(j-1)/gamma). These helpers are shared with carryover training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE = -100


@dataclass
class Blocks:
    """Draft blocks of one sequence: A anchors, Q = block size queries each."""

    anchors: torch.Tensor  # [A]
    query_ids: torch.Tensor  # [A, Q]: token at anchor, then mask ids
    query_pos: torch.Tensor  # [A, Q]: anchor .. anchor + Q - 1
    labels: torch.Tensor  # [A, Q - 1]: true tokens at anchor + 1.., IGNORE past the end
    ctx_mask: torch.Tensor  # [A, S]: context position s visible iff s < anchor

    @property
    def prev_ids(self) -> torch.Tensor:
        """[A, Q - 1]: the true token before each draft slot (the Markov head's
        teacher-forced input); past the end, where labels are ignored, a dummy 0."""
        prev = torch.cat([self.query_ids[:, :1], self.labels[:, :-1]], dim=1)
        return prev.clamp(min=0)


def sample_anchors(lo: int, hi: int, num: int, gen: torch.Generator) -> torch.Tensor:
    """Up to `num` distinct anchor positions in [lo, hi) (all of them if fewer)."""
    n = hi - lo
    if n <= 0:
        return torch.empty(0, dtype=torch.long)
    if n <= num:
        return torch.arange(lo, hi)
    return (torch.randperm(n, generator=gen)[:num] + lo).sort().values


def make_blocks(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int,
                mask_token_id: int, num_ctx: int | None = None) -> Blocks:
    """Block inputs, labels and committed-context mask for anchors in `tokens` [T]."""
    t = tokens.shape[0]
    offs = torch.arange(block_size, device=tokens.device)
    pos = anchors[:, None] + offs[None]  # [A, Q]
    ids = torch.full_like(pos, mask_token_id)
    ids[:, 0] = tokens[anchors]
    lab_pos = pos[:, 1:]
    labels = torch.where(lab_pos < t, tokens[lab_pos.clamp(max=t - 1)],
                         torch.full_like(lab_pos, IGNORE))
    s = t if num_ctx is None else num_ctx
    ctx_mask = torch.arange(s, device=tokens.device)[None, :] < anchors[:, None]
    return Blocks(anchors, ids, pos, labels, ctx_mask)


def slot_weights(num_slots: int, gamma: float) -> torch.Tensor:
    """exp(-(j-1)/gamma) for block slots j = 1..num_slots."""
    return torch.exp(-torch.arange(num_slots, dtype=torch.float) / gamma)


def weighted_block_ce(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                      anchor_weights: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted mean CE, per-slot weight sum) of draft logits [A, K, V] vs labels [A, K];
    slot j weighs `weights[j]`, and block a also `anchor_weights[a]` when given."""
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                         reduction="none").view(labels.shape)
    w = weights.to(ce.device)[None, :] * (labels != IGNORE)
    if anchor_weights is not None:
        w = w * anchor_weights.to(ce.device)[:, None]
    return (ce * w).sum() / w.sum().clamp(min=1e-6), w.sum(0)


def accepted_length(drafts: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Greedy verification: the number of leading drafts equal to the true tokens."""
    return ((drafts == labels) & (labels != IGNORE)).int().cumprod(-1).sum(-1)


@dataclass
class BlockStats:
    """Top-1 accuracy per block slot and the acceptance length it implies (on the CPU)."""

    correct: torch.Tensor  # [K]
    total: torch.Tensor  # [K]
    accepted: float = 0.0  # sum over blocks of the accepted prefix length
    blocks: int = 0

    @classmethod
    def empty(cls, k: int) -> BlockStats:
        return cls(torch.zeros(k), torch.zeros(k))

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.add_drafts(logits.argmax(-1), labels)

    def add_drafts(self, drafts: torch.Tensor, labels: torch.Tensor) -> None:
        """Count greedy drafts [A, K] (token ids) against labels [A, K]."""
        ok = (drafts == labels) & (labels != IGNORE)
        self.correct += ok.sum(0).float().cpu()
        self.total += (labels != IGNORE).sum(0).float().cpu()
        full = (labels != IGNORE).all(-1)
        self.accepted += float(ok[full].int().cumprod(-1).sum())
        self.blocks += int(full.sum())

    def accuracy(self) -> list[float]:
        return [round(float(c / max(n, 1)), 4) for c, n in
                zip(self.correct, self.total, strict=True)]

    def tau(self) -> float:
        """Greedy acceptance length 1 + E[accepted prefix] (full blocks only)."""
        return 1.0 + self.accepted / max(self.blocks, 1)


def walk_visits(anchors: torch.Tensor, accepted: torch.Tensor, start: int) -> torch.Tensor:
    """[A] bool: which of the sorted `anchors` a greedy speculative run from `start`
    anchors a block at, given each block's accepted prefix length: the run jumps past
    the accepted drafts and the target's own token. Where that position was not among
    the anchors (a sample), the walk resumes at the next anchor after it."""
    pos, acc = anchors.tolist(), accepted.tolist()
    visits = [False] * len(pos)
    i, nxt = 0, start
    while True:
        while i < len(pos) and pos[i] < nxt:
            i += 1
        if i == len(pos):
            return torch.tensor(visits, dtype=torch.bool)
        visits[i] = True
        nxt = pos[i] + acc[i] + 1
        i += 1


def visit_weights(drafts: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor,
                  start: int, unvisited: float) -> torch.Tensor:
    """[A] loss weights of the blocks at sorted `anchors`: 1 where a greedy run of these
    drafts [A, K] from `start` anchors a block, `unvisited` elsewhere (inside a stretch
    the block before drafted right)."""
    visits = walk_visits(anchors, accepted_length(drafts, labels), start)
    return torch.where(visits, 1.0, unvisited)


@dataclass
class WalkStats:
    """Acceptance length along the anchors a greedy speculative run actually visits.

    A run anchors its first block at the first response token and each next one just
    past the accepted prefix and the target's own token, so it never anchors inside a
    stretch it has just accepted: it meets the hard positions more often than uniformly
    sampled anchors do. This is the estimate that predicts vLLM's tau (docs/results.md
    sets the uniform, walked and vLLM figures of the shipped baseline side by side).
    """

    rounds: int = 0
    accepted: int = 0

    def add(self, drafts: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Walk one response: greedy drafts [A, K] and labels [A, K] of the blocks
        anchored at every response position in order, from the first. Returns which of
        the first blocks the walk visited ([blocks before the response's end] bool)."""
        acc = accepted_length(drafts, labels)
        # a run ends before the blocks that reach past the response's end
        num_full = int((labels != IGNORE).all(-1).int().cumprod(0).sum())
        acc = acc[:num_full]
        visits = walk_visits(torch.arange(num_full), acc, 0)
        self.rounds += int(visits.sum())
        self.accepted += int(acc[visits].sum())
        return visits

    def tau(self) -> float:
        return 1.0 + self.accepted / max(self.rounds, 1)


def cosine_lr(step: int, progress: float, warmup: int, peak: float,
              floor: float = 0.05) -> float:
    """Linear warmup over the first `warmup` optimizer steps, then cosine decay to
    `floor * peak` over the run's progress (0..1, by steps or by a --minutes budget).

    The warmup counts real steps: a time budget with a large --steps (progress far ahead
    of step / steps) must still warm a fresh optimizer up, most of all on a continued run.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, max(0.0, progress))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))
