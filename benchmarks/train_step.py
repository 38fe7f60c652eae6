"""What one drafter training step costs on this machine, float32 against bf16 autocast.

`python -m train baseline/carryover --dtype auto` picks the compute dtype of the
drafter's forward passes; this measures the choice. It times the baseline
recipe's step (context projection of every position, one block per anchor,
cross-entropy over a sampled vocabulary, backward, AdamW) on a randomly
initialised drafter with SmolLM2's shapes and random target states, the dtypes
interleaved so that a noisy machine slows both alike, and prints a JSON line:

    python -m benchmarks.train_step                 # 1 layer, block 8, 2 threads
    python -m benchmarks.train_step --layers 3 --block-size 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from vllm_carryover.drafter_format import DrafterConfig, random_state_dict
from vllm_carryover.torch_drafter import TorchDrafter

# SmolLM2-135M: hidden 576, 9 heads / 3 KV heads, head_dim 64, 30 layers
TARGET = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
              num_key_value_heads=3, head_dim=64)


def drafter(layers: int, block_size: int, vocab: int) -> TorchDrafter:
    """A random drafter over a `vocab`-token head (training's sampled-softmax size)."""
    cfg = DrafterConfig(**TARGET, num_hidden_layers=layers, vocab_size=vocab,
                        rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=8192,
                        block_size=block_size, mask_token_id=0, target_layer_ids=(1, 14, 27),
                        target_hidden_size=576, causal=False)
    model = TorchDrafter(cfg, torch.randn(vocab, 576) * 0.02)
    model.load_checkpoint_state(random_state_dict(cfg))
    return model


def step(model: TorchDrafter, opt: torch.optim.Optimizer, aux: torch.Tensor,
         tokens: torch.Tensor, anchors: torch.Tensor, dtype: torch.dtype) -> None:
    """One optimizer step over `len(aux)` sequences, as the baseline recipe makes it."""
    d = model.config
    q = d.block_size
    opt.zero_grad(set_to_none=True)
    cast = nullcontext() if dtype == torch.float32 else torch.autocast("cpu", dtype=dtype)
    for seq_aux, seq_tokens in zip(aux, tokens, strict=True):
        t = seq_aux.shape[0]
        with cast:
            ctx_k, ctx_v = model.context_kv(model.fuse(seq_aux), torch.arange(t))
            pos = anchors[:, None] + torch.arange(q)[None]
            ids = torch.zeros_like(pos)
            ids[:, 0] = seq_tokens[anchors]
            mask = torch.arange(t)[None, :] < anchors[:, None]
            # one context for all anchors, as the recipe passes it
            logits = model(ids, pos, ctx_k[:, None], ctx_v[:, None], mask)[:, 1:]
            labels = seq_tokens[pos[:, 1:]]
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        (loss / len(aux)).backward()
    opt.step()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.train_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16384,
                   help="head tokens per step (sampled softmax; default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--seqs", type=int, default=4, help="sequences per step")
    p.add_argument("--anchors", type=int, default=32, help="anchors per sequence")
    p.add_argument("--steps", type=int, default=6, help="timed steps per dtype")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"),
                   default=["float32", "bfloat16"],
                   help="compute dtypes to time (bf16 is ~10x slower than fp32 on a CPU "
                   "without native bf16 matmuls; default: %(default)s)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = drafter(a.layers, a.block_size, a.vocab)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    aux = torch.randn(a.seqs, a.seq_len, 3 * 576)
    tokens = torch.randint(a.vocab, (a.seqs, a.seq_len))
    anchors = torch.randperm(a.seq_len - a.block_size)[: a.anchors].sort().values
    dtypes = {name: getattr(torch, name) for name in a.dtypes}
    times: dict[str, list[float]] = {name: [] for name in dtypes}
    for i in range(a.steps + 1):  # the first round warms up both
        for name, dtype in dtypes.items():
            start = time.perf_counter()
            step(model, opt, aux, tokens, anchors, dtype)
            if i:
                times[name].append(time.perf_counter() - start)
    ms = {name: round(statistics.median(t) * 1e3, 1) for name, t in times.items()}
    labels = a.seqs * a.anchors * (a.block_size - 1)
    print(json.dumps({"ms_per_step": ms,
                      "label_tokens_per_s": {n: round(labels / v * 1e3) for n, v in ms.items()},
                      "bf16_speedup": (round(ms["float32"] / ms["bfloat16"], 2)
                                       if len(ms) == 2 else None),
                      "native_bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                      "args": vars(a)}))


if __name__ == "__main__":
    main()
