"""What prompt lookup and the drafter could do together, measured before building it.

vLLM's n-gram proposer (prompt lookup) finds the longest earlier occurrence (2 to 4
tokens by default) of the text's last tokens and proposes the K tokens that followed
it: where a response repeats its prompt or itself (code, translation, quoted text) it
drafts long runs that are right, elsewhere it proposes nothing. The drafter drafts
everywhere, short runs. On the held-out split, at every response position, this takes
the drafter's greedy block and the lookup's proposal, and walks each response as a
greedy speculative run does (`WalkStats`) under these policies:

  drafter        the drafter's block at every step
  lookup         the lookup's proposal; where it has none, a step that drafts nothing
  both           the lookup's proposal where it has one, the drafter's block elsewhere
  corpus         the corpus lookup's proposal (`vllm_carryover.corpus_lookup`: what the
                 target most often wrote after the same 2-5 tokens in the train split's
                 responses), else nothing
  lookup+corpus  the prompt lookup's proposal, else the corpus lookup's, else nothing
  all            the prompt lookup's, else the corpus lookup's, else the drafter's block

Reported per category (and "all"): each policy's tau (tokens per step), and the share
of the `both` walk's steps that used the lookup. Without `--init` only the policies
that need no drafter (lookup, corpus, lookup+corpus), `-k` tokens per step, in seconds:
how a corpus table's rule (`--min-count`, `--min-share`) drafts.
`--max-response-tokens N` walks only each response's first N tokens, the part a
served request with `max_tokens` N writes: the lookups draft more of a response's later
tokens, where it has begun to repeat itself (docs/results.md, session 31), so a
short-answer benchmark meets fewer of them.
Target states and drafts are computed in the machine's fastest dtype (bf16 where
native), as training's held-out estimate is.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import replace
from typing import TYPE_CHECKING

from vllm_carryover.train.data import add_corpus_rule_options
from vllm_carryover.train.headroom import add_drafter_options, load_drafter, print_table

from vllm_carryover.corpus_lookup import MIN_COUNT, MIN_SHARE
from vllm_carryover.prompt_lookup import DEFAULT_MAX_N, DEFAULT_MIN_N, PromptLookup, Propose

if TYPE_CHECKING:
    import torch

POLICIES = ("drafter", "lookup", "both", "corpus", "lookup+corpus", "all")
LOOKUP_POLICIES = ("lookup", "corpus", "lookup+corpus")  # the walks without a drafter
NO_DRAFT = -1  # a draft id no label equals


def anchored_drafts(tokens: torch.Tensor, start: int, num_drafts: int,
                    propose: Propose) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts [A, K] padded with NO_DRAFT, proposed [A] bool) of a lookup for the blocks
    anchored at positions start .. T - 2 of `tokens` [T]: `propose(ids, K)` sees the text
    up to and including the anchor's token and returns at most K draft ids."""
    import numpy as np
    import torch

    ids = tokens.cpu().numpy().astype(np.int32)
    positions = range(start, len(ids) - 1)
    drafts = torch.full((len(positions), num_drafts), NO_DRAFT, dtype=torch.long)
    for row, p in enumerate(positions):
        found = np.asarray(propose(ids[: p + 1], num_drafts), dtype=np.int64)
        drafts[row, : len(found)] = torch.from_numpy(found)
    return drafts, (drafts != NO_DRAFT).any(-1)


def response_labels(tokens: torch.Tensor, start: int, num_drafts: int) -> torch.Tensor:
    """The labels [A, K] of the blocks anchored at positions start .. T - 2 of `tokens`
    [T]: the true tokens after each anchor, IGNORE past the end (as `greedy_blocks`)."""
    import torch
    from vllm_carryover.train.dflash_loss import make_blocks

    anchors = torch.arange(start, tokens.shape[0] - 1, device=tokens.device)
    return make_blocks(tokens, anchors, num_drafts + 1, mask_token_id=0).labels


def lookup_headroom(target: str, init: str | None, data: str, chunk: int = 64,
                    min_count: int = MIN_COUNT, min_share: float = MIN_SHARE,
                    max_response_tokens: int | None = None, num_drafts: int = 7
                    ) -> dict[str, dict[str, float]]:
    """Per category (and "all"): each policy's walked tau and the lookup's share of the
    `both` walk's steps; `min_count` / `min_share`: the corpus table's rule;
    `max_response_tokens`: walk only each response's first this many tokens. Without a
    drafter (`init` None) only the lookups' policies, `num_drafts` tokens per step."""
    import torch
    from tqdm import tqdm
    from vllm_carryover.train.baseline import greedy_blocks, load_sequences, sequence_feed
    from vllm_carryover.train.data import corpus_table
    from vllm_carryover.train.device import placement
    from vllm_carryover.train.dflash_loss import WalkStats
    from vllm_carryover.train.paths import data_dir
    from vllm_carryover.train.target_states import truncated_decoder

    policies = POLICIES if init else LOOKUP_POLICIES
    drafter, layer_ids = None, []
    if init:
        place = placement()  # the machine's fastest dtype, as training evaluates
        drafter = load_drafter(target, init).to(place.device)
        num_drafts = drafter.config.block_size - 1
        layer_ids = list(drafter.config.target_layer_ids)
        feed = sequence_feed(place, layer_ids, truncated_decoder(
            target, max(layer_ids), place.dtype, place.device))
    seqs = [seq if max_response_tokens is None else
            replace(seq, tokens=seq.tokens[: seq.response_start + max_response_tokens])
            for seq in load_sequences(target, data, layer_ids, cached=False)["heldout"]]
    corpus = corpus_table(data_dir(data), min_count, min_share)
    vllm_lookup = PromptLookup(DEFAULT_MIN_N, DEFAULT_MAX_N, 1 << 30).propose  # vLLM's matcher
    walks: dict[str, dict[str, WalkStats]] = defaultdict(
        lambda: {p: WalkStats() for p in policies})
    lookup_steps: dict[str, int] = defaultdict(int)
    with torch.no_grad():
        for seq in tqdm(seqs, desc="lookup headroom", unit="seq"):
            start, t = seq.response_start, seq.tokens.shape[0]
            if t - 1 <= start:
                continue
            looked, proposed = anchored_drafts(seq.tokens, start, num_drafts, vllm_lookup)
            from_corpus, in_corpus = anchored_drafts(seq.tokens, start, num_drafts,
                                                     corpus.propose)
            either = torch.where(proposed[:, None], looked, from_corpus)
            by_policy = {"lookup": looked, "corpus": from_corpus, "lookup+corpus": either}
            if drafter is None:
                label = response_labels(seq.tokens, start, num_drafts)
            else:
                with place.autocast():
                    model, label = greedy_blocks(drafter, feed(seq), chunk)
                model = model.cpu()
                by_policy |= {"drafter": model,
                              "both": torch.where(proposed[:, None], looked, model),
                              "all": torch.where((proposed | in_corpus)[:, None], either, model)}
            label = label.cpu()
            groups = ("all", seq.category) if seq.category else ("all",)
            for name in groups:
                visits = {policy: walks[name][policy].add(drafts, label)
                          for policy, drafts in by_policy.items()}
                if "both" in visits:  # the steps of the `both` walk that used the lookup
                    both = visits["both"]
                    lookup_steps[name] += int((both & proposed[: len(both)]).sum())

    def row(name: str, w: dict[str, WalkStats]) -> dict[str, float]:
        out: dict[str, float] = {p: round(w[p].tau(), 4) for p in policies}
        if "both" in w:
            out["both_steps"] = w["both"].rounds
            out["lookup_share"] = round(lookup_steps[name] / max(w["both"].rounds, 1), 4)
        return out

    return {name: row(name, w) for name, w in walks.items()}


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lookup-headroom", help="what prompt lookup and the drafter could do together",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_drafter_options(p, init_required=False)
    add_corpus_rule_options(p)
    p.add_argument("--max-response-tokens", type=int, metavar="N",
                   help="walk only each response's first N tokens, as a served request "
                   "with max_tokens N writes them (default: whole responses)")
    p.add_argument("-k", type=int, default=7,
                   help="tokens per step without --init (with it: the drafter's block "
                   "size - 1; default: %(default)s)")
    p.set_defaults(fn=_run)


def _run(a: argparse.Namespace) -> None:
    import torch
    from vllm_carryover.train.paths import default_target

    torch.set_num_threads(a.threads)
    print_table(lookup_headroom(a.target or default_target(), a.init, a.data,
                                min_count=a.min_count, min_share=a.min_share,
                                max_response_tokens=a.max_response_tokens, num_drafts=a.k),
                [*POLICIES, "both_steps", "lookup_share"] if a.init else LOOKUP_POLICIES,
                a.out)
