"""Tiny random models for fast tests: a Llama target, a drafter for it, a dataset."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_carryover.drafter.checkpoint import load_drafter_state
from vllm_carryover.drafter.format import DrafterConfig
from vllm_carryover.drafter.init_drafter import init_drafter
from vllm_carryover.drafter.target_weights import target_embedding
from vllm_carryover.drafter.torch_model import TorchDrafter


def make_tiny_target(out: Path, vocab: int = 512, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=1024, rope_theta=10000.0,
                      tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def make_tiny_drafter(target: Path, out: Path, block_size: int = 5, seed: int = 0,
                      rejected_embedding_scale: float = 1.0, markov_rank: int = 0) -> Path:
    """A random drafter; a non-zero rejected embedding so that the mark matters."""
    from safetensors.torch import save_file

    init_drafter(target, out, block_size=block_size, seed=seed, markov_rank=markov_rank)
    cfg, state = load_drafter_state(out)
    gen = torch.Generator().manual_seed(seed + 1)
    state["rejected_embedding"] = rejected_embedding_scale * torch.randn(
        cfg["hidden_size"], generator=gen)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out


def torch_drafter_for(drafter: Path, target: Path) -> TorchDrafter:
    """The plain PyTorch twin of a drafter folder, with the target's embeddings."""
    cfg, state = load_drafter_state(drafter)
    model = TorchDrafter(DrafterConfig.from_dict(cfg), target_embedding(target))
    model.load_checkpoint_state(state)
    return model.eval()


def write_cached_dataset(target: Path, name: str, rows: list[dict]) -> None:
    """A training dataset in the cache folder, written directly (no Ray, no vLLM) the way
    `python -m train data` leaves it; its target states fill the state cache as the
    first run visits them."""
    from vllm_carryover.train.data import write_dataset
    from vllm_carryover.train.paths import data_dir

    write_dataset(data_dir(name), rows, {"target": str(target)})


def write_random_dataset(target: Path, name: str) -> None:
    """15 rows of random prompt and response tokens of the target's vocabulary (3 held
    out) as dataset `name` in the cache, for training runs of a few steps."""
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(15):
        n_prompt, n_resp = (int(x) for x in torch.randint(4, 9, (2,), generator=gen))
        toks = torch.randint(1, vocab, (n_prompt + 3 * n_resp,), generator=gen).tolist()
        rows.append({"id": f"r{i}", "group": f"g{i}", "category": "chat", "messages": [],
                     "prompt_ids": toks[:n_prompt], "response_ids": toks[n_prompt:],
                     "response": "", "split": "heldout" if i % 5 == 0 else "train"})
    write_cached_dataset(target, name, rows)
