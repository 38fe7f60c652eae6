"""Plain DFlash baseline training of a block drafter on the target's own responses.

Per step: a few training sequences; per sequence the context K/V of all its
positions is projected once, then many anchors (blocks) are trained in parallel,
each seeing only context positions before its anchor. Only drafter weights train;
embeddings and LM head are the target's, frozen.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm
from vllm_carryover.train.data import load_samples
from vllm_carryover.train.device import Placement, placement
from vllm_carryover.train.dflash_loss import (
    IGNORE,
    BlockStats,
    WalkStats,
    sample_anchors,
    slot_weights,
    visit_weights,
    weighted_block_ce,
)
from vllm_carryover.train.draft_verify_draft import block_logits_over, context_kv
from vllm_carryover.train.options import BaselineArgs, TrainArgs
from vllm_carryover.train.paths import data_dir
from vllm_carryover.train.slot_proposals import proposal_feeds, with_slot_proposals
from vllm_carryover.train.state_cache import StateCache, dataset_cache
from vllm_carryover.train.target_states import stored_states, truncated_decoder
from vllm_carryover.train.trainer import (
    Feed,
    SeqResult,
    Sequence,
    Trainer,
    load_init,
    meta_args,
    portable,
)
from vllm_carryover.train.vocab_subset import (
    remap_labels,
    restricted_head,
    with_dataset_vocab,
)

from vllm_carryover.drafter.format import (
    REJECTED_EMBEDDING,
    DrafterConfig,
    default_target_layers,
    make_config_dict,
)
from vllm_carryover.drafter.format import random_state_dict as random_drafter_state
from vllm_carryover.drafter.markov_head import fresh_markov_state
from vllm_carryover.drafter.target_weights import target_embedding, target_final_norm
from vllm_carryover.drafter.torch_model import TorchDrafter

# The confidence-level embedding starts at zero on a continued drafter, as a new rejected
# embedding does: the same rate multiplier as `train carryover --rejected-lr-mult`'s default.
CONFIDENCE_LR_MULT = 10.0


def load_sequences(data: str) -> dict[str, list[Sequence]]:
    """Train / heldout sequences of a dataset, without their aux states (a `sequence_feed`
    gives them)."""
    out: dict[str, list[Sequence]] = {"train": [], "heldout": []}
    for i, r in enumerate(load_samples(data_dir(data))):
        if len(r["response_ids"]) >= 2:
            toks = torch.tensor(r["prompt_ids"] + r["response_ids"])
            out[r["split"]].append(Sequence(toks, len(r["prompt_ids"]), None,
                                            r.get("category", ""), row=i))
    return out


def sequence_feed(place: Placement, layer_ids: list[int], decoder: Any = None,
                  cache: StateCache | None = None) -> Feed:
    """Sequences moved to the device with their aux states: read from the state `cache`
    where an earlier visit stored them, else computed now by the target's truncated
    `decoder` (and stored, when there is a cache: the first epoch fills it)."""
    def feed(seq: Sequence) -> Sequence:
        aux = None if cache is None else cache.get(seq.row)
        if aux is None:
            aux = stored_states(decoder, [seq.tokens.tolist()], layer_ids)[0]
            if cache is not None:
                cache.put(seq.row, aux)
        return replace(seq, tokens=seq.tokens.to(place.device), aux=aux.to(place.device))

    return feed


def computed_once(feed: Feed) -> Feed:
    """`feed` that keeps what it made, for the held-out sequences: every evaluation visits
    the same ones, so their online states are computed once, not once per evaluation
    (a few hundred sequences: a few hundred MB of bf16 states)."""
    made: dict[int, Sequence] = {}

    def fed(seq: Sequence) -> Sequence:
        if id(seq) not in made:
            made[id(seq)] = feed(seq)
        return made[id(seq)]

    return fed


def target_decoder(a: TrainArgs, place: Placement, layer_ids: list[int]) -> Any:
    """The target's decoder up to the last drafter layer, frozen, in the training dtype on
    the training device (both as `device.placement` resolved them)."""
    decoder = truncated_decoder(a.target, max(layer_ids), place.dtype, place.device)
    for p in decoder.parameters():
        p.requires_grad_(False)
    return decoder


def block_logits(model: TorchDrafter, seq: Sequence, anchors: torch.Tensor,
                 ctx_kv: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft logits [A, K, V], labels [A, K]) of the blocks at `anchors` of `seq`, with
    the Markov bias of the true previous tokens. `ctx_kv`: the sequence's context K/V
    when the caller has projected it already (evaluation drafts it chunk by chunk)."""
    k, v = ctx_kv if ctx_kv is not None else context_kv(model, seq.aux)
    logits, blocks = block_logits_over(model, k, v, seq.tokens, anchors,
                                       proposals=seq.proposals)
    return model.teacher_forced(logits, blocks.prev_ids), blocks.labels


def greedy_blocks(model: TorchDrafter, seq: Sequence, chunk: int = 64
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy drafts [A, K], labels [A, K]) of the blocks anchored at every response
    position of `seq` (its target states fed), drafted `chunk` anchors at a time. With a
    Markov head each slot sees the true previous token, which gives the accepted prefix
    that left-to-right drafting would."""
    ctx = context_kv(model, seq.aux)
    everywhere = torch.arange(seq.response_start, seq.tokens.shape[0] - 1,
                              device=seq.tokens.device)
    drafts, labels = [], []
    for part in everywhere.split(chunk):
        logits, part_labels = block_logits(model, seq, part, ctx)
        drafts.append(logits.argmax(-1))
        labels.append(part_labels)
    return torch.cat(drafts), torch.cat(labels)


def evaluate(model: TorchDrafter, seqs: list[Sequence], anchors_per_seq: int, feed: Feed,
             seed: int = 1234, chunk: int = 64) -> tuple[BlockStats, WalkStats]:
    """Held-out greedy acceptance: top-1 accuracy per slot and tau on a fixed uniform
    anchor sample (response region), and tau along the anchors a speculative run visits
    (`WalkStats`). Every response position's block is drafted, in chunks of anchors."""
    gen = torch.Generator().manual_seed(seed)
    k = model.config.block_size - 1
    stats, walk = BlockStats.empty(k), WalkStats()
    model.eval()
    with torch.no_grad():
        for seq in tqdm(seqs, desc="eval", unit="seq", leave=False):
            t, start = seq.tokens.shape[0], seq.response_start
            sampled = sample_anchors(start, t - 1, anchors_per_seq, gen)
            if not sampled.numel():
                continue
            drafts, labels = greedy_blocks(model, feed(seq), chunk)
            rows = (sampled - start).to(drafts.device)
            stats.add_drafts(drafts[rows], labels[rows])
            walk.add(drafts, labels)
    model.train()
    return stats, walk


def fresh_drafter_state(d: DrafterConfig, target: str, seed: int) -> dict[str, torch.Tensor]:
    """A new drafter's weights: random, but every layer's residual branches (`o_proj`,
    `down_proj`) at zero and the final norm at the target's. Random full-size branches
    start the residual stream an order of magnitude above the token embedding it carries,
    and the shared LM head expects states normed as the target norms its own."""
    state = random_drafter_state(d, seed)
    for name in state:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name] = torch.zeros_like(state[name])
    state["norm.weight"] = target_final_norm(target)
    return state


def new_drafter_config(target: str, a: BaselineArgs) -> dict[str, Any]:
    target_cfg = json.loads((Path(target) / "config.json").read_text())
    layer_ids = a.target_layers or default_target_layers(target_cfg["num_hidden_layers"])
    return make_config_dict(target_cfg, num_layers=a.layers, block_size=a.block_size,
                            target_layer_ids=layer_ids, mask_token_id=0,
                            intermediate_size=a.intermediate_size)


def attach_markov_head(cfg: dict[str, Any], state: dict[str, torch.Tensor], rank: int,
                       seed: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config, state) with a fresh Markov head of `rank` when the drafter has none."""
    have = cfg.get("markov_rank") or 0
    if not rank or have == rank:
        return cfg, state
    if have:
        raise SystemExit(f"the init drafter already has a Markov head of rank {have}; "
                         f"drop --markov-rank or pass --markov-rank {have}")
    return dict(cfg, markov_rank=rank), state | fresh_markov_state(cfg["vocab_size"], rank, seed)


def param_groups(model: TorchDrafter, a: TrainArgs,
                 rejected_lr_mult: float | None = None) -> list[dict[str, Any]]:
    """AdamW groups: the backbone; the Markov head (new: --markov-lr-mult); the slots'
    confidence levels (small and starting at zero: `CONFIDENCE_LR_MULT`, no weight decay);
    the rejected embedding when it trains (new, zero: `rejected_lr_mult`, no weight
    decay)."""
    head = list(model.markov_head.parameters()) if model.markov_head is not None else []
    levels = [model.slot_confidence] if model.slot_confidence is not None else []
    special = {id(p) for p in head + levels} | {id(model.rejected_embedding)}
    groups = [{"params": [p for p in model.parameters()
                          if p.requires_grad and id(p) not in special], "lr_mult": 1.0}]
    if head:
        groups.append({"params": head, "lr_mult": a.markov_lr_mult})
    if levels:
        groups.append({"params": levels, "lr_mult": CONFIDENCE_LR_MULT, "weight_decay": 0.0})
    if rejected_lr_mult is not None:
        groups.append({"params": [model.rejected_embedding], "lr_mult": rejected_lr_mult,
                       "weight_decay": 0.0})
    return groups


def train_baseline(a: BaselineArgs) -> Path:
    """Train; save `final.pt` (config, float32 state, metadata) in the run folder.

    Returns the path of final.pt, or of last.pt when `--stop-after` ended this
    invocation before the run was complete.
    """
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    place = placement(a.device, a.dtype)
    prior: dict[str, Any] = {}
    if a.init_run:  # continue from a run, an export or a public DFlash drafter (its config wins)
        cfg, state, prior = load_init(a.init_run, a.target, "--init-run")
        if a.draft_vocab and cfg.get("draft_vocab_size") != a.draft_vocab:
            raise SystemExit(f"--draft-vocab {a.draft_vocab} gives a new drafter its head; "
                             f"the --init-run drafter has draft_vocab_size "
                             f"{cfg.get('draft_vocab_size')}: convert it first (`python -m "
                             "train draft-vocab`) or drop --draft-vocab")
    else:
        cfg = new_drafter_config(a.target, a)
        state = fresh_drafter_state(DrafterConfig.from_dict(cfg), a.target, a.seed)
        if a.draft_vocab:
            cfg, state = with_dataset_vocab(cfg, state, a.target, a.data, a.draft_vocab)
    cfg, state = attach_markov_head(cfg, state, a.markov_rank, a.seed)
    cfg = with_slot_proposals(cfg, a.slot_proposals, continued=bool(a.init_run))
    dcfg = DrafterConfig.from_dict(cfg)
    model = TorchDrafter(dcfg, target_embedding(a.target))
    model.load_checkpoint_state(state)
    model.to(place.device)
    model.rejected_embedding.requires_grad_(False)  # baseline: no carryover weight
    groups = param_groups(model, a)
    params = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)

    layer_ids = list(dcfg.target_layer_ids)
    seqs = load_sequences(a.data)
    cache = dataset_cache(a.target_states, data_dir(a.data), layer_ids,
                          len(layer_ids) * dcfg.target_hidden_size, place.dtype)
    # the target runs for the states not cached yet
    decoder = None if cache is not None and cache.complete() else target_decoder(
        a, place, layer_ids)
    feed = sequence_feed(place, layer_ids, decoder, cache)
    feed, heldout_feed = proposal_feeds(cfg, a.data, feed)
    heldout_feed = computed_once(heldout_feed) if cache is None else heldout_feed
    train, heldout = seqs["train"], seqs["heldout"]
    weights = slot_weights(dcfg.block_size - 1, a.gamma)
    loop = Trainer(a, "baseline", model, params, opt, cfg, train, {"trained_label_tokens": 0},
                   place, feed, lineage_steps=prior.get("steps", 0))

    def seq_loss(seq: Sequence, anchors: torch.Tensor, ids: torch.Tensor | None) -> SeqResult:
        with restricted_head(model, ids):
            k, v = context_kv(model, seq.aux)
            rows, blocks = block_logits_over(model, k, v, seq.tokens, anchors, with_bonus=True,
                                             proposals=seq.proposals)
            logits = model.teacher_forced(rows[:, 1:], blocks.prev_ids)
        labels = blocks.labels if ids is None else remap_labels(blocks.labels, ids,
                                                                 dcfg.vocab_size)
        visited = None if a.unvisited_weight == 1.0 else visit_weights(
            logits.detach().argmax(-1), labels, anchors, seq.response_start,
            a.unvisited_weight)
        loss, _ = weighted_block_ce(logits, labels, weights, visited)
        if a.bonus_weight:
            # the bonus row also predicts slot 1's token: in a drafter of two or more layers
            # the slots read the bonus token through that row's later-layer states, a path
            # the slots' own loss alone trains only indirectly
            loss = loss + a.bonus_weight * F.cross_entropy(rows[:, 0], labels[:, 0],
                                                           ignore_index=IGNORE)
        return SeqResult(loss, counts={"trained_label_tokens": int((labels != IGNORE).sum())})

    def heldout_eval() -> dict[str, Any]:
        with place.autocast():
            st, walk = evaluate(model, heldout, a.eval_anchors_per_seq, heldout_feed)
        return {"acc": st.accuracy(), "tau": st.tau(), "walk_tau": walk.tau()}

    if a.init_run and loop.main and "heldout_initial" not in loop.done.notes:
        loop.done.notes["heldout_initial"] = heldout_eval()  # where a continued run starts
        print("initial heldout " + json.dumps(loop.done.notes["heldout_initial"]))
    complete = loop.run(seq_loss, heldout_eval)
    if not complete or not loop.main:
        return loop.out / ("final.pt" if complete else "last.pt")
    final = heldout_eval()
    print(f"final heldout acc/slot {final['acc']} tau~{final['tau']:.3f} "
          f"(uniform anchors), {final['walk_tau']:.3f} (the anchors a run visits)")
    state = {k: v for k, v in model.checkpoint_state().items() if k != REJECTED_EMBEDDING}
    done = loop.done
    steps_done = done.step + prior.get("steps", 0)
    tokens_seen = done.counts["trained_label_tokens"] + prior.get("trained_label_tokens", 0)
    train_seconds = done.train_seconds + prior.get("train_seconds", 0.0)
    recipe = "dspark-baseline" if dcfg.markov_rank else "dflash-baseline"
    meta = {"recipe": recipe, "steps": steps_done,
            "trained_label_tokens": tokens_seen, "train_seconds": round(train_seconds, 1),
            "label_tokens_per_s": round(tokens_seen / max(train_seconds, 1e-9), 1),
            "continued_from": ([*prior.get("continued_from", []), portable(a.init_run)]
                               if a.init_run else []),
            "data": a.data, "data_manifest_sha256": loop.data_sha,
            "train_sequences": len(train), "heldout_sequences": len(heldout),
            "processes": loop.world, "heldout_accuracy_per_slot": final["acc"],
            "heldout_tau_estimate": round(final["tau"], 4),
            "heldout_walk_tau": round(final["walk_tau"], 4),
            "heldout_initial": done.notes.get("heldout_initial"), "evals": done.evals,
            "args": meta_args(a)}
    return loop.save_final(cfg, state, meta)
