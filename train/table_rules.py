"""Table rules: what a lookup table drafts with no model, the reference beside a drafter.

At a response position p, where the target has just written the bonus token t[p], each
rule drafts up to K tokens:

  copy          what followed the last earlier occurrence of the pair (t[p-1], t[p]) in
                the text so far (prompt and response): up to K tokens, none past p
  trigram       the train split's most frequent continuation of the last two tokens
                (else of the last token alone), chained: each draft joins the context of
                the next, until K drafts or a context the table does not know
  copy+trigram  the copy (where it finds one), extended to K by the trigram chain from
                its last two tokens

The trigram table counts every token of the train split's responses after the two
tokens before it (the first response tokens after the prompt's last two); a tie goes to
the continuation seen first. `lookup-headroom` walks these rules per category next to
the drafter's and the lookups' policies. Numpy, one text at a time, every anchor at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

RULES = ("copy", "trigram", "copy+trigram")
NO_DRAFT = -1  # a draft id no label equals


def _pair_keys(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One int64 key per token pair (token ids are under 2^31)."""
    return (a.astype(np.int64) << 32) | b.astype(np.int64)


def _most_frequent(ctx: np.ndarray, nxt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct contexts, each one's most frequent next token) of the
    occurrences (ctx[i], nxt[i]) in order; a tie goes to the one seen first."""
    if not len(ctx):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.lexsort((nxt, ctx))  # stable: each run's first entry is its first occurrence
    c, n = ctx[order], nxt[order]
    starts = np.flatnonzero(np.r_[True, (c[1:] != c[:-1]) | (n[1:] != n[:-1])])
    counts = np.diff(np.r_[starts, len(c)])
    first_seen = order[starts]
    run_ctx, run_next = c[starts], n[starts]
    best = np.lexsort((first_seen, -counts, run_ctx))
    run_ctx, run_next = run_ctx[best], run_next[best]
    head = np.r_[True, run_ctx[1:] != run_ctx[:-1]]
    return run_ctx[head], run_next[head]


def _lookup(keys: np.ndarray, values: np.ndarray, query: np.ndarray) -> np.ndarray:
    """values[keys == query] per query, NO_DRAFT where the sorted `keys` lack it."""
    if not len(keys):
        return np.full(len(query), NO_DRAFT, np.int64)
    at = np.searchsorted(keys, query).clip(max=len(keys) - 1)
    return np.where(keys[at] == query, values[at], NO_DRAFT)


@dataclass
class TrigramTable:
    """The most frequent next token after each token pair (and, as the fallback, after
    each token) in the target's responses."""

    pair_keys: np.ndarray  # [M] int64, sorted (`_pair_keys`)
    pair_next: np.ndarray  # [M]
    token_keys: np.ndarray  # [N] int64, sorted
    token_next: np.ndarray  # [N]

    @classmethod
    def build(cls, texts: Iterable[tuple[Sequence[int], Sequence[int]]]) -> TrigramTable:
        """The table of (prompt ids, response ids) texts: every response token counted
        after the two tokens before it."""
        firsts, seconds, nexts = [], [], []
        for prompt, response in texts:
            t = np.asarray(list(prompt[-2:]) + list(response), dtype=np.int64)
            if len(t) < 3:
                continue
            firsts.append(t[:-2])
            seconds.append(t[1:-1])
            nexts.append(t[2:])
        a, b, c = (np.concatenate(x) if x else np.zeros(0, np.int64)
                   for x in (firsts, seconds, nexts))
        pair_keys, pair_next = _most_frequent(_pair_keys(a, b), c)
        token_keys, token_next = _most_frequent(b, c)
        return cls(pair_keys, pair_next, token_keys, token_next)

    def next_token(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """[A]: the most frequent token after each pair (a, b), else after b alone, else
        NO_DRAFT (also where b is NO_DRAFT: a chain that has stopped)."""
        by_pair = _lookup(self.pair_keys, self.pair_next, _pair_keys(a, b))
        by_token = _lookup(self.token_keys, self.token_next, b)
        known = b != NO_DRAFT
        return np.where(known & (by_pair != NO_DRAFT), by_pair,
                        np.where(known, by_token, NO_DRAFT))

    def chain(self, a: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
        """[A, n]: n tokens chained from each pair (a, b), NO_DRAFT after it stops."""
        out = np.full((len(a), n), NO_DRAFT, np.int64)
        for j in range(n):
            out[:, j] = self.next_token(a, b)
            a, b = b, out[:, j]
        return out


def copy_drafts(tokens: np.ndarray, start: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(drafts [A, k] padded with NO_DRAFT, matched [A] bool) of the copy rule for the
    blocks anchored at positions start .. T - 2 of `tokens` [T]."""
    t = np.asarray(tokens, dtype=np.int64)
    anchors = np.arange(start, len(t) - 1)
    drafts = np.full((len(anchors), k), NO_DRAFT, np.int64)
    if not len(anchors):
        return drafts, np.zeros(0, bool)
    # source[q]: the last q' < q whose pair (t[q'-1], t[q']) is the pair ending at q
    pairs = _pair_keys(t[:-1], t[1:])  # pairs[i] ends at position i + 1
    order = np.argsort(pairs, kind="stable")
    same = np.r_[False, pairs[order][1:] == pairs[order][:-1]]
    source = np.full(len(t), -1, np.int64)
    source[order[same] + 1] = order[np.flatnonzero(same) - 1] + 1
    src = source[anchors]
    matched = src >= 0
    at = src[:, None] + 1 + np.arange(k)  # the tokens after the earlier occurrence ...
    ok = matched[:, None] & (at <= anchors[:, None])  # ... up to the anchor, not past it
    drafts[ok] = t[at[ok]]
    return drafts, matched


def rule_drafts(tokens: np.ndarray, start: int, k: int, table: TrigramTable
                ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """({rule: drafts [A, k] padded with NO_DRAFT} for `RULES`, copy matched [A] bool) of
    the blocks anchored at positions start .. T - 2 of `tokens` [T] (start >= 1)."""
    if start < 1:
        raise ValueError("the rules draft after a pair: anchors start at position 1")
    t = np.asarray(tokens, dtype=np.int64)
    copied, matched = copy_drafts(t, start, k)
    anchors = np.arange(start, len(t) - 1)
    rows = np.arange(len(anchors))
    # the text's end then the copy: the chain continues from its last two tokens
    ext = np.concatenate([t[anchors - 1, None], t[anchors, None], copied], axis=1)
    num_copied = (copied != NO_DRAFT).sum(1)
    chained = table.chain(ext[rows, num_copied], ext[rows, num_copied + 1], k)
    from_chain = np.arange(k) - num_copied[:, None]  # slot j takes chain slot j - copied
    extended = np.where(from_chain >= 0,
                        np.take_along_axis(chained, from_chain.clip(min=0), axis=1), copied)
    trigram = table.chain(t[anchors - 1], t[anchors], k)
    return {"copy": copied, "trigram": trigram, "copy+trigram": extended}, matched
