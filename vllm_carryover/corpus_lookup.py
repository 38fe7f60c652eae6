"""Corpus lookup: an n-gram model of the target's own writing, drafting with no forward.

A small target writes the same phrases again and again ("Here is a", "I'm sorry,
but", a code idiom). The table holds, for every context of 2 to 5 tokens in the
target's responses to the training prompts, its most frequent next token, where
that token is confident (seen at least `MIN_COUNT` times, and at least `MIN_SHARE`
of that context's continuations). It drafts a chain: the continuation of the
longest known context of the text's end, then of that text plus the new token, and
so on, until no context is known. Offline, on the held-out responses, this walks
1.54 tokens per step, as many as the shipped drafter, and prompt lookup, then the
corpus, then the drafter's block walk 2.98, against 2.68 for prompt lookup and the
drafter alone (docs/results.md, session 27).

Built from a dataset by `python -m train corpus-table`, stored beside the drafter
as `corpus_table.npz`, read by the proposer with `"corpus_lookup": true`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

CORPUS_FILE = "corpus_table.npz"  # in the drafter folder
MIN_N, MAX_N = 2, 5  # context lengths, the longest tried first
MIN_COUNT = 2  # a continuation seen fewer times is not proposed ...
MIN_SHARE = 0.5  # ... nor one that is not this share of its context's continuations


class CorpusTable:
    """The most frequent next token of each context of `MIN_N`..`MAX_N` tokens."""

    def __init__(self, next_token: dict[tuple[int, ...], int]) -> None:
        self.next_token = next_token

    def __len__(self) -> int:
        return len(self.next_token)

    @classmethod
    def build(cls, texts: Sequence[tuple[Sequence[int], Sequence[int]]],
              min_count: int = MIN_COUNT, min_share: float = MIN_SHARE) -> CorpusTable:
        """From (prompt ids, response ids) pairs: only response tokens are predicted,
        from contexts that may reach back into the prompt's last tokens. A context's most
        frequent continuation is kept if seen `min_count` times and `min_share` of the
        context's continuations (the defaults are the shipped table's rule)."""
        from numpy.lib.stride_tricks import sliding_window_view

        next_token: dict[tuple[int, ...], int] = {}
        for n in range(MIN_N, MAX_N + 1):
            windows = [sliding_window_view(np.asarray([*p[-n:], *r], dtype=np.int64), n + 1)
                       for p, r in texts if len(p[-n:]) + len(r) > n]
            if not windows:
                continue
            pairs, counts = np.unique(np.concatenate(windows), axis=0, return_counts=True)
            # pairs are sorted by context, then next token: one group per context
            starts = np.r_[True, (pairs[1:, :n] != pairs[:-1, :n]).any(1)]
            group = np.cumsum(starts) - 1
            total = np.bincount(group, weights=counts)
            order = np.lexsort((-counts, group))  # each group's most frequent next first
            best = order[np.r_[True, group[order][1:] != group[order][:-1]]]
            keep = best[(counts[best] >= min_count)
                        & (counts[best] >= min_share * total[group[best]])]
            next_token.update(zip(map(tuple, pairs[keep, :n].tolist()),
                                  pairs[keep, n].tolist(), strict=True))
        return cls(next_token)

    def save(self, path: Path) -> None:
        """One array of contexts and one of next tokens per context length."""
        arrays: dict[str, np.ndarray] = {}
        for n in range(MIN_N, MAX_N + 1):
            keys = [k for k in self.next_token if len(k) == n]
            arrays[f"contexts_{n}"] = np.array(keys, dtype=np.int32).reshape(-1, n)
            arrays[f"next_{n}"] = np.array([self.next_token[k] for k in keys], dtype=np.int32)
        np.savez_compressed(path, **arrays)

    @classmethod
    def load(cls, path: Path) -> CorpusTable:
        next_token: dict[tuple[int, ...], int] = {}
        with np.load(path) as z:
            for n in range(MIN_N, MAX_N + 1):
                next_token.update(zip(map(tuple, z[f"contexts_{n}"].tolist()),
                                      z[f"next_{n}"].tolist(), strict=True))
        return cls(next_token)

    def propose(self, text: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens, each the continuation of the longest context (`MAX_N`
        tokens down to `MIN_N`) of `text` and the tokens proposed so far."""
        out: list[int] = []
        ctx = [int(t) for t in text[-MAX_N:]]
        while len(out) < k:
            nxt = next((self.next_token[key] for n in range(MAX_N, MIN_N - 1, -1)
                        if len(ctx) >= n and (key := tuple(ctx[-n:])) in self.next_token),
                       None)
            if nxt is None:
                break
            out.append(nxt)
            ctx = [*ctx, nxt][-MAX_N:]
        return out
