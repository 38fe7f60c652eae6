"""Plain DFlash baseline training of a block drafter on the target's own responses.

Per step: a few training sequences; per sequence the context K/V of all its
positions is projected once, then many anchors (blocks) are trained in parallel,
each seeing only context positions before its anchor. Only drafter weights train;
embeddings and LM head are the target's, frozen.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from train.data import load_manifest, load_samples
from train.dflash_loss import (
    BlockStats,
    cosine_lr,
    make_blocks,
    sample_anchors,
    slot_weights,
    weighted_block_ce,
)
from train.paths import data_dir, run_dir
from train.target_states import extract
from train.vocab_subset import remap_labels, restricted_head, step_vocab
from vllm_carryover.checkpoint import (
    REJECTED_EMBEDDING,
    DrafterConfig,
    make_config_dict,
)
from vllm_carryover.checkpoint import random_state_dict as random_drafter_state
from vllm_carryover.init_drafter import default_target_layers
from vllm_carryover.torch_drafter import TorchDrafter


@dataclass
class BaselineArgs:
    target: str = ""
    data: str = "smollm2-chat-v1"
    run: str = "smollm2-dflash-baseline"
    layers: int = 1
    block_size: int = 8
    intermediate_size: int = 1024
    target_layers: list[int] | None = None
    steps: int = 400
    minutes: float = 0.0
    seqs_per_step: int = 4
    anchors_per_seq: int = 32
    lr: float = 1e-3
    warmup: int = 20
    gamma: float = 4.0
    eval_every: int = 100
    eval_anchors_per_seq: int = 16
    vocab_subset: bool = True
    num_negatives: int = 4096
    init_run: str = ""
    seed: int = 0
    threads: int = 2
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sequence:
    """One training sequence: tokens, the first response position, aux states."""

    tokens: torch.Tensor  # [T]
    response_start: int
    aux: torch.Tensor  # [T, n_layers * H] bf16


def target_embedding(target: str) -> torch.Tensor:
    """The target's (tied) token embedding, float32."""
    from safetensors import safe_open

    with safe_open(str(Path(target) / "model.safetensors"), "pt") as f:
        name = next(k for k in f.keys() if k.endswith("embed_tokens.weight"))  # noqa: SIM118
        return f.get_tensor(name).float()


def load_sequences(target: str, data: str, layer_ids: list[int]) -> dict[str, list[Sequence]]:
    """Train / heldout sequences with their cached aux states."""
    folder = data_dir(data)
    sha = load_manifest(folder)["sha256"]
    rows = load_samples(folder)
    toks = [r["prompt_ids"] + r["response_ids"] for r in rows]
    tag = hashlib.sha256(f"{sha}:{layer_ids}".encode()).hexdigest()[:12]
    states = extract(target, toks, layer_ids, folder / f"states-{tag}.pt")
    out: dict[str, list[Sequence]] = {"train": [], "heldout": []}
    for r, t, s in zip(rows, toks, states, strict=True):
        if len(r["response_ids"]) >= 2:
            out[r["split"]].append(Sequence(torch.tensor(t), len(r["prompt_ids"]), s))
    return out


def block_logits(model: TorchDrafter, seq: Sequence, anchors: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft logits [A, K, V], labels [A, K]) of the blocks at `anchors` of `seq`."""
    d = model.config
    t = seq.tokens.shape[0]
    fused = model.fuse(seq.aux.float())
    k, v = model.context_kv(fused, torch.arange(t))  # [L, T, kv, hd]
    blocks = make_blocks(seq.tokens, anchors, d.block_size, d.mask_token_id)
    a = anchors.shape[0]
    ctx_k = k[:, None].expand(-1, a, -1, -1, -1)
    ctx_v = v[:, None].expand(-1, a, -1, -1, -1)
    logits = model(blocks.query_ids, blocks.query_pos, ctx_k, ctx_v, blocks.ctx_mask)
    return logits[:, 1:], blocks.labels


def evaluate(model: TorchDrafter, seqs: list[Sequence], anchors_per_seq: int,
             seed: int = 1234) -> BlockStats:
    """Held-out top-1 accuracy per slot on a fixed anchor sample (response region)."""
    gen = torch.Generator().manual_seed(seed)
    k = model.config.block_size - 1
    stats = BlockStats.empty(k)
    model.eval()
    with torch.no_grad():
        for seq in tqdm(seqs, desc="eval", unit="seq", leave=False):
            anchors = sample_anchors(seq.response_start, seq.tokens.shape[0] - 1,
                                     anchors_per_seq, gen)
            if anchors.numel():
                stats.add(*block_logits(model, seq, anchors))
    model.train()
    return stats


def new_drafter_config(target: str, a: BaselineArgs) -> dict[str, Any]:
    target_cfg = json.loads((Path(target) / "config.json").read_text())
    layer_ids = a.target_layers or default_target_layers(target_cfg["num_hidden_layers"])
    return make_config_dict(target_cfg, num_layers=a.layers, block_size=a.block_size,
                            target_layer_ids=layer_ids, mask_token_id=0,
                            intermediate_size=a.intermediate_size)


def train_baseline(a: BaselineArgs) -> Path:
    """Train and save `final.pt` (config, float32 state, metadata) in the run folder."""
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    cfg = new_drafter_config(a.target, a)
    dcfg = DrafterConfig.from_dict(cfg)
    model = TorchDrafter(dcfg, target_embedding(a.target))
    prior: dict[str, Any] = {}
    if a.init_run:  # continue from an earlier run (its config wins)
        saved = torch.load(run_dir(a.init_run) / "final.pt")
        cfg, prior = saved["config"], saved["meta"]
        dcfg = DrafterConfig.from_dict(cfg)
        model = TorchDrafter(dcfg, target_embedding(a.target))
        state = saved["state"]
    else:
        state = random_drafter_state(dcfg, a.seed)
    model.load_checkpoint_state(state)
    model.rejected_embedding.requires_grad_(False)  # baseline: no carryover weight
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)

    seqs = load_sequences(a.target, a.data, list(dcfg.target_layer_ids))
    train, heldout = seqs["train"], seqs["heldout"]
    weights = slot_weights(dcfg.block_size - 1, a.gamma)
    data_vocab = torch.unique(torch.cat([s.tokens for s in train])) if a.vocab_subset else None
    if data_vocab is not None:
        print(f"sampled softmax over {data_vocab.numel()} data tokens + "
              f"{a.num_negatives} random negatives per step")
    gen = torch.Generator().manual_seed(a.seed)
    out = run_dir(a.run)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "log.jsonl").open("w")
    evals: list[dict[str, Any]] = []
    tokens_seen = 0
    train_seconds = 0.0
    steps_done = 0
    bar = tqdm(total=a.steps, desc="baseline", unit="step")
    for step in range(a.steps):
        t0 = time.perf_counter()
        progress = step / a.steps
        if a.minutes > 0:
            progress = max(progress, train_seconds / (a.minutes * 60))
        if progress >= 1.0:
            break
        lr = cosine_lr(int(progress * a.steps), a.steps, a.warmup, a.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        picks = torch.randint(len(train), (a.seqs_per_step,), generator=gen).tolist()
        opt.zero_grad(set_to_none=True)
        total_loss = 0.0
        ids = None if data_vocab is None else step_vocab(data_vocab, dcfg.vocab_size,
                                                          a.num_negatives, gen)
        for i in picks:
            seq = train[i]
            anchors = sample_anchors(seq.response_start, seq.tokens.shape[0] - 1,
                                     a.anchors_per_seq, gen)
            with restricted_head(model, ids):
                logits, labels = block_logits(model, seq, anchors)
            if ids is not None:
                labels = remap_labels(labels, ids, dcfg.vocab_size)
            loss, _ = weighted_block_ce(logits, labels, weights)
            (loss / len(picks)).backward()
            total_loss += float(loss) / len(picks)
            tokens_seen += int((labels != -100).sum())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        steps_done += 1
        train_seconds += time.perf_counter() - t0
        log.write(json.dumps({"step": step, "loss": total_loss, "lr": lr,
                                  "seconds": train_seconds}) + "\n")
        bar.update(1)
        bar.set_postfix(loss=f"{total_loss:.3f}", lr=f"{lr:.1e}")
        if a.eval_every and (step + 1) % a.eval_every == 0:
            st = evaluate(model, heldout, a.eval_anchors_per_seq)
            evals.append({"step": step + 1, "acc": st.accuracy(), "tau": st.tau()})
            tqdm.write(f"step {step + 1}: heldout acc/slot {st.accuracy()} tau~{st.tau():.3f}")
            log.write(json.dumps(evals[-1]) + "\n")
        log.flush()
    bar.close()
    final = evaluate(model, heldout, a.eval_anchors_per_seq)
    print(f"final heldout acc/slot {final.accuracy()} tau~{final.tau():.3f}")
    state = {k: v for k, v in model.checkpoint_state().items() if k != REJECTED_EMBEDDING}
    steps_done += prior.get("steps", 0)
    tokens_seen += prior.get("trained_label_tokens", 0)
    train_seconds += prior.get("train_seconds", 0.0)
    meta = {"recipe": "dflash-baseline", "steps": steps_done,
                "trained_label_tokens": tokens_seen, "train_seconds": round(train_seconds, 1),
                "label_tokens_per_s": round(tokens_seen / max(train_seconds, 1e-9), 1),
                "continued_from": ([*prior.get("continued_from", []), a.init_run]
                                   if a.init_run else []),
                "data": a.data, "data_manifest_sha256": load_manifest(data_dir(a.data))["sha256"],
                "train_sequences": len(train), "heldout_sequences": len(heldout),
                "heldout_accuracy_per_slot": final.accuracy(),
                "heldout_tau_estimate": round(final.tau(), 4), "evals": evals,
                "args": {k: v for k, v in asdict(a).items() if k != "extra"}}
    path = out / "final.pt"
    torch.save({"config": cfg, "state": state, "meta": meta}, path)
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return path
