"""Corpus lookup: an n-gram model of the target's own writing, drafting with no forward.

A small target writes the same phrases again and again ("Here is a", "I'm sorry,
but", a code idiom). The table holds, for every context of 2 to 5 tokens in the
target's responses to the training prompts, its most frequent next token (a stricter
rule, `min_count` / `min_share`, keeps only confident ones). It drafts a chain: the
continuation of the longest known context of the text's end, then of that text plus
the new token, and so on, until no context is known. Offline, on the first 64 tokens
of the held-out responses, prompt lookup then this table walk 2.44 tokens per step,
against 2.22 with the confident contexts alone (seen twice, and half of their
context's continuations). Served side by side, the two tables measured within the
machine's noise of each other; the full one drafts more at concurrency 1 (docs/results.md).

Built from a dataset by `python -m train corpus-table`, stored beside the drafter
as `corpus_table.npz`, read by the proposer with `"corpus_lookup": true`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

CORPUS_FILE = "corpus_table.npz"  # in the drafter folder
MIN_N, MAX_N = 2, 5  # context lengths, the longest tried first
# The shipped rule keeps every context's most frequent continuation. A stricter one
# drops those seen fewer than MIN_COUNT times or under MIN_SHARE of their context's
# continuations (the confident table: 2 and 0.5).
MIN_COUNT, MIN_SHARE = 1, 0.0
# A context's key folds its tokens from the last back: key = key * KEY_MUL + token + 1
# (mod 2^64), so one pass over a text's end gives the keys of all its suffixes. Two
# contexts with one key would only make a wrong draft, which verification rejects.
KEY_MUL = 0x100000001B3  # the 64-bit FNV prime: odd, so no token's bits are lost
KEY_MASK = (1 << 64) - 1


def context_keys(contexts: np.ndarray) -> np.ndarray:
    """The key [M] uint64 of each context [M, n], as `CorpusTable.propose` computes it."""
    keys = np.zeros(len(contexts), dtype=np.uint64)
    for j in range(contexts.shape[1] - 1, -1, -1):
        keys = keys * np.uint64(KEY_MUL) + contexts[:, j].astype(np.uint64) + np.uint64(1)
    return keys


class CorpusTable:
    """The most frequent next token of each context of `MIN_N`..`MAX_N` tokens.

    Held as arrays per context length (what is saved) and, for lookups, one dict from
    each context's 64-bit key to its next token: about 130 bytes a context, under half of
    a dict keyed by token tuples (2.9M contexts: about 0.37 GB per worker)."""

    def __init__(self, by_length: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
        self.by_length = by_length  # n -> (contexts [M, n] int32, next tokens [M] int32)
        self._next: dict[int, int] = {}
        vocab = max((int(nxt.max()) + 1 for _, nxt in by_length.values() if len(nxt)), default=0)
        tokens = np.arange(vocab).astype(object)  # one int object per token, shared
        for n in sorted(by_length):
            contexts, nxt = by_length[n]
            self._next.update(zip(context_keys(contexts).tolist(), tokens[nxt].tolist(),
                                  strict=True))

    def __len__(self) -> int:
        return sum(len(nxt) for _, nxt in self.by_length.values())

    @classmethod
    def from_dict(cls, next_token: Mapping[tuple[int, ...], int]) -> CorpusTable:
        """A table of the given contexts and their next tokens (tests write their own)."""
        by_length: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for n in sorted({len(c) for c in next_token}):
            keys = [c for c in next_token if len(c) == n]
            by_length[n] = (np.array(keys, dtype=np.int32).reshape(-1, n),
                            np.array([next_token[c] for c in keys], dtype=np.int32))
        return cls(by_length)

    def to_dict(self) -> dict[tuple[int, ...], int]:
        """Each context and its next token (for tests and small tables)."""
        return {tuple(c): t for contexts, nxt in self.by_length.values()
                for c, t in zip(contexts.tolist(), nxt.tolist(), strict=True)}

    @classmethod
    def build(cls, texts: Sequence[tuple[Sequence[int], Sequence[int]]],
              min_count: int = MIN_COUNT, min_share: float = MIN_SHARE) -> CorpusTable:
        """From (prompt ids, response ids) pairs: only response tokens are predicted,
        from contexts that may reach back into the prompt's last tokens. A context's most
        frequent continuation is kept if seen `min_count` times and `min_share` of the
        context's continuations (the defaults are the shipped table's rule)."""
        from numpy.lib.stride_tricks import sliding_window_view

        by_length: dict[int, tuple[np.ndarray, np.ndarray]] = {}
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
            by_length[n] = (pairs[keep, :n].astype(np.int32), pairs[keep, n].astype(np.int32))
        return cls(by_length)

    def save(self, path: Path) -> None:
        """One array of contexts and one of next tokens per context length."""
        arrays: dict[str, np.ndarray] = {}
        for n, (contexts, nxt) in self.by_length.items():
            arrays[f"contexts_{n}"], arrays[f"next_{n}"] = contexts, nxt
        np.savez_compressed(path, **arrays)

    @classmethod
    def load(cls, path: Path) -> CorpusTable:
        with np.load(path) as z:
            return cls({n: (z[f"contexts_{n}"], z[f"next_{n}"])
                        for n in range(MIN_N, MAX_N + 1) if f"contexts_{n}" in z})

    def propose(self, text: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens, each the continuation of the longest context (`MAX_N`
        tokens down to `MIN_N`) of `text` and the tokens proposed so far."""
        out: list[int] = []
        ctx = [int(t) for t in text[-MAX_N:]]
        while len(out) < k:
            key, nxt = 0, None
            for n, token in enumerate(reversed(ctx), start=1):  # suffixes, shortest first
                key = (key * KEY_MUL + token + 1) & KEY_MASK
                if n >= MIN_N and (found := self._next.get(key)) is not None:
                    nxt = found  # a longer context's continuation replaces a shorter's
            if nxt is None:
                break
            out.append(nxt)
            ctx = [*ctx, nxt][-MAX_N:]
        return out
