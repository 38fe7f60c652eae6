"""Each request's text as a step's drafts continue it, read in pieces.

The suffix lookup needs, per request and step, only the tokens its trees have not
learned yet and the last `max_tree_depth` tokens to match: building every request's
whole text each step (its committed tokens and the step's sampled ones) would cost
O(text) per request per step. `StepTexts` gives a request's length and any piece
of its text straight from vLLM's token table and the step's sampled tokens, so a
step costs O(new tokens) per request; `WholeTexts` gives the same from texts held
whole (offline walks, tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch


class Texts(Protocol):
    """A batch's texts, by row: what `SuffixLookup.learn` and `propose` read."""

    def length(self, i: int) -> int | None:
        """Row `i`'s text length; None where it sampled nothing this step."""
        ...

    def piece(self, i: int, start: int, stop: int | None = None) -> np.ndarray:
        """Row `i`'s `text[start:stop]` (0 <= start; stop None: to the end)."""
        ...


class StepTexts:
    """Each request's text as this step's drafts continue it: its committed tokens
    (vLLM's token table, `num_tokens` of row i) then the tokens this step sampled
    (accepted drafts and the bonus, -1 where rejected), which vLLM appends to the table
    only after drafting. A request that sampled nothing this step (a prefill chunk that
    is not its last, `discarded`) has no text (length None)."""

    def __init__(self, token_ids: np.ndarray, num_tokens: np.ndarray, sampled: torch.Tensor,
                 discarded: torch.Tensor) -> None:
        sampled_np = sampled.cpu().numpy()
        discarded_np = discarded[: len(sampled_np)].cpu().numpy()
        self._token_ids = token_ids
        self._num_tokens = num_tokens
        self._fresh: list[np.ndarray | None] = [
            None if discarded_np[i] else row[row >= 0].astype(token_ids.dtype)
            for i, row in enumerate(sampled_np)]

    def __len__(self) -> int:
        return len(self._fresh)

    def length(self, i: int) -> int | None:
        fresh = self._fresh[i]
        return None if fresh is None else int(self._num_tokens[i]) + len(fresh)

    def piece(self, i: int, start: int, stop: int | None = None) -> np.ndarray:
        fresh = self._fresh[i]
        assert fresh is not None, "a request that sampled nothing has no text"
        committed = int(self._num_tokens[i])
        stop = committed + len(fresh) if stop is None else stop
        old = self._token_ids[i, min(start, committed): min(stop, committed)]
        new = fresh[max(start - committed, 0): max(stop - committed, 0)]
        if not len(new):
            return old
        return new if not len(old) else np.concatenate((old, new))

    def whole(self, i: int) -> np.ndarray | None:
        """Row `i`'s whole text (None where it sampled nothing): O(text), for checks."""
        return None if self._fresh[i] is None else self.piece(i, 0)


class WholeTexts:
    """Texts held whole (None: sampled nothing), as `Texts`."""

    def __init__(self, texts: Sequence[np.ndarray | None]) -> None:
        self.texts = texts

    def __len__(self) -> int:
        return len(self.texts)

    def length(self, i: int) -> int | None:
        text = self.texts[i]
        return None if text is None else len(text)

    def piece(self, i: int, start: int, stop: int | None = None) -> np.ndarray:
        text = self.texts[i]
        assert text is not None, "a request that sampled nothing has no text"
        return text[start:stop]
