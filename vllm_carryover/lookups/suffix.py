"""The lookup beside the drafter: arctic-inference's suffix trees, learning while serving.

SuffixDecoding (arctic-inference's `SuffixDecodingCache`, what vLLM's `"method":
"suffix"` runs) keeps a suffix tree of each running request's own text (its prompt,
then what it has answered so far) and one global tree of the answers the server has
written (it grows while serving; the oldest of `max_cached_requests` answers are
dropped first). Each step it matches the end of a request's text in both trees and
drafts the continuation of the more probable match, as many tokens as the tree's
counts back (each at least `min_token_prob` likely, at most `max_spec_factor` times
the match's length, at most K).

With `"suffix_lookup": true`, `lookups.beside` asks it each step: its proposals fill
the drafts, the others keep the drafter's first `lookup_drafter_k` tokens, the drafts
are one-hot where sampling needs probabilities, the rejected tokens' states are
carried (`lookups.drafts`). It reads each request's text in pieces
(`lookups.texts`): per step only the tokens its trees have not learned and the last
`max_tree_depth` to match. The knobs are vLLM's own `suffix_decoding_*` keys, with
vLLM's defaults.

The global tree need not start empty: `python -m train suffix-seed` writes up to
`SEED_ANSWERS` of the train split's answers beside the drafter as `suffix_seed.npz`,
and `seed` feeds them in at startup, as if the server had written them; the server's
own answers then replace them oldest first. Only answers are stored: the cache keeps
a prompt in its request's own tree, which is dropped when the request stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, pairwise
from pathlib import Path
from typing import Any

import numpy as np

from vllm_carryover.lookups.texts import Texts

SEED_FILE = "suffix_seed.npz"  # in the drafter folder
# vLLM's default suffix_decoding_max_cached_requests: the global tree keeps no more
# answers than that, so a bigger seed would only be evicted while it is fed.
SEED_ANSWERS = 10_000


class SuffixLookup:
    """One `SuffixDecodingCache` fed with each step's batch (`learn`), asked per request
    (`propose`)."""

    def __init__(self, max_tree_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float, max_model_len: int) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=max_tree_depth,
                                         max_cached_requests=max_cached_requests)
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_model_len = max_model_len
        self._learned: dict[str, int] = {}  # per running request: text tokens in its trees

    def seed(self, answers: Sequence[np.ndarray]) -> int:
        """Put past answers (int32 token ids) into the global tree, as if requests had
        written them, and return how many: the last `max_cached_requests` of them (the
        tree would evict the earlier ones first), none where there is no global tree."""
        limit = self.cache.max_cached_requests
        if limit == 0:
            return 0
        kept = answers[-limit:] if limit > 0 else answers
        no_prompt = np.empty(0, dtype=np.int32)  # the global tree holds answers only
        for i, answer in enumerate(kept):
            # integer ids: vLLM's request ids are strings, so a seed's never meets one
            self.cache.start_request(i, no_prompt)
            self.cache.add_active_response(i, answer)
            self.cache.stop_request(i)
        return len(kept)

    def learn(self, req_ids: Sequence[str], texts: Texts, prompt_lens: Sequence[int]) -> None:
        """Bring the trees up to this step's batch (`texts`: row i is `req_ids[i]`'s):
        drop the trees of requests no longer in it (finished, preempted or unscheduled:
        one that returns starts again from its whole text), start each new request's
        tree from its prompt, and add the tokens each text gained since the last call
        (its answer so far, on first sight): per request O(new tokens), not O(text).
        Learning from the text rather than from one step's tokens means a step that
        drafted nothing (K = 0) loses nothing. A text is None (length None) in a prefill
        chunk that sampled nothing: that request is started once its prompt is whole."""
        for gone in self._learned.keys() - set(req_ids):
            self.cache.stop_request(gone)  # its answer stays in the global tree
            del self._learned[gone]
        for i, (req_id, prompt_len) in enumerate(zip(req_ids, prompt_lens, strict=True)):
            length = texts.length(i)
            if length is None:
                continue
            if req_id not in self._learned:
                # replaces an answer of the same request id still in the global tree
                self.cache.start_request(req_id, _tokens(texts.piece(i, 0, int(prompt_len))))
                self._learned[req_id] = int(prompt_len)
            if length > self._learned[req_id]:
                self.cache.add_active_response(
                    req_id, _tokens(texts.piece(i, self._learned[req_id])))
                self._learned[req_id] = length

    def propose(self, req_ids: Sequence[str], texts: Texts, k: int) -> list[Sequence[int]]:
        """Each request's draft of at most `k` tokens (empty where the trees have none,
        or where the text is None), matching the last `max_tree_depth` tokens of its
        text; call `learn` with the same batch first."""
        return [() if d is None else d.token_ids for d in self.drafts(req_ids, texts, k)]

    def drafts(self, req_ids: Sequence[str], texts: Texts, k: int) -> list[Any]:
        """`propose`'s drafts as the cache gives them (token_ids, their path
        probabilities `probs`, the `match_len` they continue), None where it was not
        asked (no text, or no room left before `max_model_len`)."""
        out: list[Any] = []
        for i, req_id in enumerate(req_ids):
            length = texts.length(i)
            # the bonus token after the drafts needs a position within max_model_len too
            room = 0 if length is None else min(k, self.max_model_len - length - 1)
            if room <= 0:  # (the cache reads max_spec_tokens 0 as "up to the tree depth")
                out.append(None)
                continue
            end = texts.piece(i, max(length - self.max_tree_depth, 0))
            out.append(self.cache.speculate(req_id, _tokens(end), max_spec_tokens=room,
                                            max_spec_factor=self.max_spec_factor,
                                            min_token_prob=self.min_token_prob))
        return out


def _tokens(ids: np.ndarray) -> np.ndarray:
    """`ids` as the cache's zero-copy path takes them: contiguous int32."""
    return np.ascontiguousarray(ids, dtype=np.int32)


def save_seed(path: Path, answers: Sequence[Sequence[int]]) -> None:
    """`answers` as one flat array of token ids (uint16 where every id fits, else int32)
    and the offsets [N + 1] at which each begins and the last ends, compressed."""
    tokens = np.fromiter(chain.from_iterable(answers), dtype=np.int64)
    small = tokens.size == 0 or tokens.max() < 1 << 16
    offsets = np.cumsum([0, *(len(a) for a in answers)], dtype=np.int64)
    np.savez_compressed(path, tokens=tokens.astype(np.uint16 if small else np.int32),
                        offsets=offsets)


def load_seed(path: Path) -> list[np.ndarray]:
    """The answers `save_seed` wrote, in its order, each as the cache takes them."""
    with np.load(path) as z:
        tokens, offsets = _tokens(z["tokens"]), z["offsets"]
    return [tokens[start:end] for start, end in pairwise(offsets.tolist())]
