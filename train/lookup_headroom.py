"""What the suffix lookup and the drafter could do together, and what a table does alone.

The suffix lookup (`vllm_carryover.lookups.suffix`: arctic-inference's suffix trees,
what `"suffix_lookup": true` serves) matches the end of a request's text in a tree of
the request's own text and in a tree of past answers, and drafts the continuation the
trees' counts back: where a response repeats its prompt, itself or a past answer (code,
translation, quoted text, the target's usual phrases) it drafts long runs that are
right, elsewhere little or nothing. The drafter drafts everywhere, short runs. On the
held-out split, at every response position, this takes the drafter's greedy block and
the lookup's proposal, and walks each response as a greedy speculative run does
(`WalkStats`) under these policies:

  drafter        the drafter's block at every step
  lookup         the suffix lookup's proposal; where it has none, a step that drafts nothing
  both           the lookup's proposal where it has one, the drafter's block elsewhere

The lookup is set up as serving sets it up, with vLLM's `suffix_decoding_*` defaults:
its answer tree holds the seed `python -m train suffix-seed` writes (up to
`SEED_ANSWERS` of the train split's responses), each held-out request's tree its prompt
and then its response up to the anchor. Each held-out response is walked as the first
request after startup: its answer leaves the answer tree after its walk, so held-out
responses never draft one another, and the seed stays whole.

And, the reference every drafter is compared with, the table rules (`train.table_rules`):

  copy           what followed the last earlier occurrence of (previous token, bonus
                 token) in the text so far (prompt and response), K tokens, none past it
  trigram        the train split's most frequent continuation of the last two tokens
                 (else of the last one), chained to K tokens
  copy+trigram   the copy, extended to K by the trigram chain

Reported per category (and "all"): each policy's tau (tokens per step), and the share
of the `both` walk's steps that used the lookup; with a drafter also its slot-1
accuracy (the first draft right) over every response position, split by whether the
copy rule finds a match there (`slot1_copy_match`, `slot1_no_match`). Without `--init`
only the policies that need no drafter (lookup and the table rules), `-k` tokens per
step, in seconds: what the lookup and a table alone walk.
`--max-response-tokens N` walks only each response's first N tokens, the part a
served request with `max_tokens` N writes: the lookup drafts more of a response's
later tokens, where it has begun to repeat itself (docs/results.md), so a
short-answer benchmark meets fewer of them.
Target states and drafts are computed in the machine's fastest dtype (bf16 where
native), as training's held-out estimate is.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import TYPE_CHECKING

from vllm_carryover.train.headroom import add_drafter_options, load_drafter, print_table
from vllm_carryover.train.table_rules import NO_DRAFT, RULES, TrigramTable, rule_drafts

from vllm_carryover.lookups.suffix import SuffixLookup
from vllm_carryover.lookups.texts import WholeTexts

if TYPE_CHECKING:
    import torch

POLICIES = ("drafter", "lookup", "both", *RULES)
LOOKUP_POLICIES = ("lookup", *RULES)  # the walks without a drafter
SLOT1_COLUMNS = ("slot1_copy_match", "slot1_no_match")  # the drafter's first draft right


def serving_suffix_lookup(answers: Sequence[Sequence[int]]) -> SuffixLookup:
    """The suffix lookup with vLLM's `suffix_decoding_*` defaults (as `"suffix_lookup":
    true` serves without them), its answer tree seeded with `answers` (as serving's from
    `suffix_seed.npz`), with room for them all (no walked request evicts one)."""
    import numpy as np
    from vllm.config import SpeculativeConfig

    defaults = {f.name: f.default for f in fields(SpeculativeConfig)}
    suffix = SuffixLookup(defaults["suffix_decoding_max_tree_depth"], -1,
                          defaults["suffix_decoding_max_spec_factor"],
                          defaults["suffix_decoding_min_token_prob"], 1 << 30)
    suffix.seed([np.asarray(a, dtype=np.int32) for a in answers])
    return suffix


def anchored_drafts(tokens: torch.Tensor, start: int, num_drafts: int,
                    suffix: SuffixLookup) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts [A, K] padded with NO_DRAFT, proposed [A] bool) of the suffix lookup for
    the blocks anchored at positions start .. T - 2 of `tokens` [T], walked as one
    served request whose prompt is `tokens[:start]`: at each anchor its trees have
    learned the text up to and including the anchor's token. The request leaves the
    trees afterwards, its answer too."""
    import numpy as np
    import torch

    ids = tokens.cpu().numpy().astype(np.int32)
    positions = range(start, len(ids) - 1)
    drafts = torch.full((len(positions), num_drafts), NO_DRAFT, dtype=torch.long)
    req = "heldout"  # vLLM's request ids are strings: never a seed answer's integer id
    for row, p in enumerate(positions):
        text = WholeTexts([ids[: p + 1]])
        suffix.learn([req], text, [start])
        found = np.asarray(suffix.propose([req], text, num_drafts)[0], dtype=np.int64)
        drafts[row, : len(found)] = torch.from_numpy(found)
    if len(positions):
        suffix.learn([], WholeTexts([]), [])  # the request finished
        suffix.cache.evict_cached_response(req)  # its answer drafts no other held-out one
    return drafts, (drafts != NO_DRAFT).any(-1)


def response_labels(tokens: torch.Tensor, start: int, num_drafts: int) -> torch.Tensor:
    """The labels [A, K] of the blocks anchored at positions start .. T - 2 of `tokens`
    [T]: the true tokens after each anchor, IGNORE past the end (as `greedy_blocks`)."""
    import torch
    from vllm_carryover.train.dflash_loss import make_blocks

    anchors = torch.arange(start, tokens.shape[0] - 1, device=tokens.device)
    return make_blocks(tokens, anchors, num_drafts + 1, mask_token_id=0).labels


def lookup_headroom(target: str, init: str | None, data: str, chunk: int = 64,
                    max_response_tokens: int | None = None, num_drafts: int = 7
                    ) -> dict[str, dict[str, float]]:
    """Per category (and "all"): each policy's walked tau, the lookup's share of the
    `both` walk's steps and the drafter's slot-1 accuracy where the copy rule matches and
    where it does not; `max_response_tokens`: walk only each response's first this many
    tokens. Without a drafter (`init` None) only the lookup's and the table rules'
    policies, `num_drafts` tokens per step."""
    import torch
    from tqdm import tqdm
    from vllm_carryover.train.baseline import greedy_blocks, load_sequences, sequence_feed
    from vllm_carryover.train.data import load_samples, suffix_seed
    from vllm_carryover.train.device import placement
    from vllm_carryover.train.dflash_loss import WalkStats
    from vllm_carryover.train.paths import data_dir
    from vllm_carryover.train.target_states import truncated_decoder

    policies = POLICIES if init else LOOKUP_POLICIES
    drafter, layer_ids = None, []
    if init:
        place = placement()  # the machine's fastest dtype, as training evaluates
        drafter, proposals = load_drafter(target, init, data)
        drafter = drafter.to(place.device)
        num_drafts = drafter.config.block_size - 1
        layer_ids = list(drafter.config.target_layer_ids)
        feed = sequence_feed(place, layer_ids, truncated_decoder(
            target, max(layer_ids), place.dtype, place.device))
    seqs = [seq if max_response_tokens is None else
            replace(seq, tokens=seq.tokens[: seq.response_start + max_response_tokens])
            for seq in load_sequences(data)["heldout"]]
    suffix = serving_suffix_lookup(suffix_seed(data_dir(data)))
    trigrams = TrigramTable.build((r["prompt_ids"], r["response_ids"])
                                  for r in load_samples(data_dir(data), "train"))
    walks: dict[str, dict[str, WalkStats]] = defaultdict(
        lambda: {p: WalkStats() for p in policies})
    lookup_steps: dict[str, int] = defaultdict(int)
    slot1: dict[str, dict[str, list[int]]] = defaultdict(  # [right, positions]
        lambda: {c: [0, 0] for c in SLOT1_COLUMNS})
    with torch.no_grad():
        for seq in tqdm(seqs, desc="lookup headroom", unit="seq"):
            start, t = seq.response_start, seq.tokens.shape[0]
            if t - 1 <= start:
                continue
            looked, proposed = anchored_drafts(seq.tokens, start, num_drafts, suffix)
            by_policy = {"lookup": looked}
            tabled, copy_matched = rule_drafts(seq.tokens.cpu().numpy(), start, num_drafts,
                                               trigrams)
            by_policy |= {rule: torch.from_numpy(d) for rule, d in tabled.items()}
            if drafter is None:
                label = response_labels(seq.tokens, start, num_drafts)
            else:
                with place.autocast():
                    model, label = greedy_blocks(drafter, proposals(feed(seq)), chunk)
                model = model.cpu()
                by_policy |= {"drafter": model,
                              "both": torch.where(proposed[:, None], looked, model)}
            label = label.cpu()
            groups = ("all", seq.category) if seq.category else ("all",)
            for name in groups:
                visits = {policy: walks[name][policy].add(drafts, label)
                          for policy, drafts in by_policy.items()}
                if "both" in visits:  # the steps of the `both` walk that used the lookup
                    both = visits["both"]
                    lookup_steps[name] += int((both & proposed[: len(both)]).sum())
            if drafter is not None:  # every response position's first draft
                right = (by_policy["drafter"][:, 0] == label[:, 0]).numpy()
                for name in groups:
                    for column, where in zip(SLOT1_COLUMNS, (copy_matched, ~copy_matched),
                                             strict=True):
                        slot1[name][column][0] += int(right[where].sum())
                        slot1[name][column][1] += int(where.sum())

    def row(name: str, w: dict[str, WalkStats]) -> dict[str, float]:
        out: dict[str, float] = {p: round(w[p].tau(), 4) for p in policies}
        if "both" in w:
            out["both_steps"] = w["both"].rounds
            out["lookup_share"] = round(lookup_steps[name] / max(w["both"].rounds, 1), 4)
            out |= {c: round(right / max(n, 1), 4) for c, (right, n) in slot1[name].items()}
        return out

    return {name: row(name, w) for name, w in walks.items()}


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lookup-headroom", help="what the suffix lookup and the drafter could do together, "
        "next to the copy / trigram table rules",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_drafter_options(p, init_required=False)
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
                                max_response_tokens=a.max_response_tokens, num_drafts=a.k),
                [*POLICIES, "both_steps", "lookup_share", *SLOT1_COLUMNS] if a.init
                else LOOKUP_POLICIES, a.out)
