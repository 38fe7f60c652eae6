"""The drafter checkpoint format: what a folder holds, its defaults and its shapes.

A drafter folder is a vLLM DFlash checkpoint (`config.json` with
`architectures: ["DFlashDraftModel"]`, `model.safetensors` without embeddings or
LM head) plus, optionally, the carryover weight `rejected_embedding` [hidden] and
a `carryover_config` block in `config.json` with training metadata. A
`markov_rank` r > 0 in `config.json` makes it the semi-autoregressive variant:
the weights then also hold the Markov head (`markov_head.py`), [V, r] twice. A
drafter that reads lookup proposals in its slots has `slot_proposals` settings in
`config.json` (`lookups.slots`); where they hold `confidence_levels` L, the weights
also hold `slot_confidence` [L, hidden], the embedding of each slot's confidence level.
Reading and writing folders is `checkpoint`; checking one against a target is
`drafter.validation`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from vllm_carryover.drafter.markov_head import MARKOV_W1, MARKOV_W2
from vllm_carryover.lookups.slots import CONFIG_KEY as SLOTS_KEY
from vllm_carryover.lookups.slots import levels_of

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded checkpoint
REJECTED_EMBEDDING = "rejected_embedding"
SLOT_CONFIDENCE = "slot_confidence"
# A draft vocabulary (EAGLE-3's convention, which vLLM's DFlash loader reads): the
# drafter's own LM head over `draft_vocab_size` target tokens, and `d2t`, the offset
# from draft id i to its target id (target id = i + d2t[i]).
LM_HEAD = "lm_head.weight"
D2T = "d2t"
# The one set of defaults of the format: what transformers' Qwen3Config, and so
# vLLM, assumes for a drafter `config.json` (model_type qwen3) without the field.
# `make_config_dict` falls back to the same values for a target that lacks one.
FORMAT_DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                                   "max_position_embeddings": 32768}
DEFAULT_BLOCK_SIZE = 16  # vLLM's DFlash default when `block_size` is absent



@dataclass(frozen=True)
class DrafterConfig:
    """The architecture facts of a drafter, read from its `config.json`."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    causal: bool
    markov_rank: int = 0  # 0: DFlash-style parallel drafter; r > 0: with a Markov head
    draft_vocab_size: int = 0  # 0: the LM head covers the whole vocabulary (shared)
    confidence_levels: int = 0  # > 0: its slots' proposals carry levels (`lookups.slots`)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DrafterConfig:
        dflash = cfg.get("dflash_config") or {}
        heads = cfg["num_attention_heads"]
        layer_types = cfg.get("layer_types") or []
        causal = bool(dflash.get("causal", False)) or (
            bool(layer_types) and all(t == "sliding_attention" for t in layer_types)
        )
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", FORMAT_DEFAULTS["rms_norm_eps"]),
            rope_theta=rope_theta_of(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings",
                                            FORMAT_DEFAULTS["max_position_embeddings"]),
            block_size=cfg.get("block_size", DEFAULT_BLOCK_SIZE),
            mask_token_id=dflash["mask_token_id"],
            target_layer_ids=tuple(dflash["target_layer_ids"]),
            target_hidden_size=cfg.get("target_hidden_size") or cfg["hidden_size"],
            causal=causal,
            markov_rank=cfg.get("markov_rank") or 0,
            draft_vocab_size=(0 if cfg.get("draft_vocab_size") in (None, cfg["vocab_size"])
                              else cfg["draft_vocab_size"]),
            confidence_levels=levels_of(cfg.get(SLOTS_KEY)),
        )


def rope_theta_of(cfg: dict[str, Any]) -> float:
    """RoPE base of a config in either transformers layout (`rope_parameters` or
    the older top-level `rope_theta`)."""
    rope = cfg.get("rope_parameters") or {}
    return rope.get("rope_theta", cfg.get("rope_theta", FORMAT_DEFAULTS["rope_theta"]))


def default_target_layers(depth: int, count: int = 3) -> list[int]:
    """`count` target layers spread from the second to the third-to-last."""
    if count == 1:
        return [depth // 2]
    lo, hi = 1, max(1, depth - 3)
    return sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)})


def make_config_dict(
    target_cfg: dict[str, Any],
    *,
    num_layers: int,
    block_size: int,
    target_layer_ids: list[int],
    mask_token_id: int,
    intermediate_size: int | None = None,
    markov_rank: int = 0,
    carryover_meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A DFlash `config.json` for a drafter that shares a Llama-like target's shapes
    (with a Markov head of rank `markov_rank` when it is > 0)."""
    heads = target_cfg["num_attention_heads"]
    hidden = target_cfg["hidden_size"]
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": intermediate_size or target_cfg["intermediate_size"],
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": target_cfg.get("num_key_value_heads", heads),
        "head_dim": target_cfg.get("head_dim") or hidden // heads,
        "hidden_act": "silu",
        "vocab_size": target_cfg["vocab_size"],
        "rms_norm_eps": target_cfg.get("rms_norm_eps", FORMAT_DEFAULTS["rms_norm_eps"]),
        "rope_theta": rope_theta_of(target_cfg),
        "max_position_embeddings": target_cfg.get("max_position_embeddings",
                                                  FORMAT_DEFAULTS["max_position_embeddings"]),
        "attention_bias": False,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "block_size": block_size,
        "layer_types": ["full_attention"] * num_layers,
        "dflash_config": {
            "mask_token_id": mask_token_id,
            "target_layer_ids": list(target_layer_ids),
            "use_aux_hidden_state": True,
        },
        **({"markov_rank": markov_rank} if markov_rank else {}),
        "carryover_config": carryover_meta or {},
    }


def expected_shapes(d: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a drafter checkpoint holds, with its shape."""
    h, hd = d.hidden_size, d.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, d.target_hidden_size * len(d.target_layer_ids)),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(d.num_hidden_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (d.num_attention_heads * hd, h),
            p + "self_attn.k_proj.weight": (d.num_key_value_heads * hd, h),
            p + "self_attn.v_proj.weight": (d.num_key_value_heads * hd, h),
            p + "self_attn.o_proj.weight": (h, d.num_attention_heads * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (d.intermediate_size, h),
            p + "mlp.up_proj.weight": (d.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, d.intermediate_size),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    if d.markov_rank:
        shapes |= {MARKOV_W1: (d.vocab_size, d.markov_rank),
                   MARKOV_W2: (d.vocab_size, d.markov_rank)}
    if d.draft_vocab_size:
        shapes |= {LM_HEAD: (d.draft_vocab_size, h), D2T: (d.draft_vocab_size,)}
    if d.confidence_levels:
        shapes |= {SLOT_CONFIDENCE: (d.confidence_levels, h)}
    return shapes


def random_state_dict(d: DrafterConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A randomly initialised drafter (norms at one, matrices scaled by fan-in); it has
    no rejected embedding, so without a Markov head vLLM's in-tree DFlash loads it too."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(d).items():
        if len(shape) == 1:
            state[name] = torch.ones(shape)
        else:
            state[name] = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
    return state
