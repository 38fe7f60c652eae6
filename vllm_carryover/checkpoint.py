"""Drafter checkpoints: the folder format, its validation against a target, and IO.

A drafter folder is a vLLM DFlash checkpoint (`config.json` with
`architectures: ["DFlashDraftModel"]`, `model.safetensors` without embeddings or
LM head) plus, optionally, the carryover weight `rejected_embedding` [hidden] and
a `carryover_config` block in `config.json` with training metadata. A
`markov_rank` r > 0 in `config.json` makes it the semi-autoregressive variant:
the weights then also hold the Markov head (`markov_head.py`), [V, r] twice.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_carryover.markov_head import MARKOV_W1, MARKOV_W2

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded checkpoint
REJECTED_EMBEDDING = "rejected_embedding"
# The one set of defaults of the format: what transformers' Qwen3Config, and so
# vLLM, assumes for a drafter `config.json` (model_type qwen3) without the field.
# `make_config_dict` falls back to the same values for a target that lacks one.
FORMAT_DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                                   "max_position_embeddings": 32768}
DEFAULT_BLOCK_SIZE = 16  # vLLM's DFlash default when `block_size` is absent


class CarryoverConfigError(ValueError):
    """A speculative config or drafter checkpoint that cannot work, with the fix."""


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


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """Tensor names, dtypes and shapes of a safetensors file, without loading it.

    Raises CarryoverConfigError naming the file when it is truncated or corrupt.
    """
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError(f"header length {header_len} exceeds file size {size}")
            header = json.loads(f.read(header_len))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
                  default=0)
        if 8 + header_len + end > size:
            raise ValueError(f"tensor data ends at byte {8 + header_len + end}, file has {size}")
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise CarryoverConfigError(
            f"drafter weights file {path} is truncated or corrupt ({e}); "
            "re-export or re-download the checkpoint"
        ) from e
    header.pop("__metadata__", None)
    return header


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a drafter folder: `model.safetensors`, or the shards
    that `model.safetensors.index.json` names (as vLLM and transformers read them)."""
    if (path / WEIGHTS_FILE).is_file():
        return [path / WEIGHTS_FILE]
    index = path / WEIGHTS_INDEX
    if not index.is_file():
        raise CarryoverConfigError(
            f"drafter folder {path} has no {WEIGHTS_FILE} (nor a sharded checkpoint's "
            f"{WEIGHTS_INDEX})")
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CarryoverConfigError(
            f"{index} is not a safetensors index ({type(e).__name__}: {e}); it needs a "
            "\"weight_map\" from tensor names to shard files") from e
    missing = [name for name in shards if not (path / name).is_file()]
    if missing:
        raise CarryoverConfigError(
            f"drafter folder {path} lacks {len(missing)} of the {len(shards)} shards its "
            f"{WEIGHTS_INDEX} names (first: {missing[0]}); download the whole checkpoint")
    return [path / name for name in shards]


def read_weights_header(path: Path) -> dict[str, Any]:
    """Tensor names, dtypes and shapes over every weights file of a drafter folder."""
    header: dict[str, Any] = {}
    for file in weight_files(path):
        header |= read_safetensors_header(file)
    return header


def _target_dims(target_cfg: Any) -> tuple[int, int, int]:
    """(hidden size, vocab size, number of layers) of a target HF config."""
    text = getattr(target_cfg, "get_text_config", lambda: target_cfg)()
    return text.hidden_size, text.vocab_size, text.num_hidden_layers


def validate_drafter(path: str | Path, target_cfg: Any, num_speculative_tokens: int | None
                     ) -> DrafterConfig:
    """Check that the drafter folder at `path` can serve `target_cfg`.

    Every failure names the problem and the fix, so that `vllm serve` stops at
    startup instead of failing inside a worker on the first request.
    """
    path = Path(path)
    if not path.is_dir():
        raise CarryoverConfigError(
            f"drafter folder {path} does not exist; pass a local folder made by "
            "`python -m vllm_carryover.init_drafter` or by `python -m train export`, or a "
            "Hugging Face hub id (owner/name)"
        )
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CarryoverConfigError(f"drafter folder {path} has no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
        drafter = DrafterConfig.from_dict(raw)
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CarryoverConfigError(
            f"{cfg_file} is not a DFlash drafter config ({type(e).__name__}: {e}); it needs "
            "hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, "
            "vocab_size and dflash_config.{mask_token_id,target_layer_ids}"
        ) from e
    header = read_weights_header(path)

    hidden, vocab, depth = _target_dims(target_cfg)
    if drafter.target_hidden_size != hidden or drafter.hidden_size != hidden:
        raise CarryoverConfigError(
            f"drafter {path} was built for hidden size {drafter.hidden_size} "
            f"(target features {drafter.target_hidden_size}) but the target's hidden size "
            f"is {hidden}; use a drafter made for this target"
        )
    if drafter.vocab_size != vocab:
        raise CarryoverConfigError(
            f"drafter {path} has vocabulary size {drafter.vocab_size} but the target has "
            f"{vocab}; the drafter must share the target's tokenizer"
        )
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < depth - 1]
    if bad:
        raise CarryoverConfigError(
            f"drafter {path} reads target layers {bad}, outside 0..{depth - 2} of a "
            f"{depth}-layer target; use a drafter made for this target"
        )
    if not 0 <= drafter.mask_token_id < vocab:
        raise CarryoverConfigError(
            f"drafter {path} has mask_token_id {drafter.mask_token_id} outside the vocabulary"
        )
    if isinstance(drafter.markov_rank, bool) or not isinstance(drafter.markov_rank, int) \
            or drafter.markov_rank < 0:
        raise CarryoverConfigError(
            f"drafter {path} has markov_rank {drafter.markov_rank!r}; it must be a "
            "non-negative integer (0 or absent: no Markov head)"
        )
    if drafter.causal:
        raise CarryoverConfigError(
            f"drafter {path} is causal; carryover places rejected states after the query "
            "block, so it needs a non-causal (bidirectional) block drafter"
        )
    max_k = drafter.block_size - 1
    if num_speculative_tokens is not None and not 1 <= num_speculative_tokens <= max_k:
        raise CarryoverConfigError(
            f"num_speculative_tokens={num_speculative_tokens} but drafter {path} has "
            f"block_size {drafter.block_size}, so it drafts at most {max_k} tokens; "
            f"use 1..{max_k}"
        )
    _check_shapes(path, header, drafter)
    return drafter


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
    return shapes


def _check_shapes(path: Path, header: dict[str, Any], d: DrafterConfig) -> None:
    want = expected_shapes(d)
    missing = sorted(set(want) - set(header))
    if missing:
        raise CarryoverConfigError(
            f"drafter weights in {path} lack {len(missing)} tensors "
            f"(first: {missing[0]}); the file does not match its config.json"
        )
    stray = sorted(n for n in (MARKOV_W1, MARKOV_W2) if n in header and n not in want)
    if stray:
        raise CarryoverConfigError(
            f"drafter weights in {path} hold a Markov head ({stray[0]}) but "
            "config.json has no markov_rank; add \"markov_rank\": R (the head's second "
            "dimension) to config.json"
        )
    for name, shape in want.items():
        got = tuple(header[name]["shape"])
        if got != shape:
            raise CarryoverConfigError(
                f"drafter tensor {name} has shape {list(got)} but config.json implies "
                f"{list(shape)}; the checkpoint does not match its config"
            )
    if REJECTED_EMBEDDING in header and tuple(header[REJECTED_EMBEDDING]["shape"]) != (
        d.hidden_size,
    ):
        raise CarryoverConfigError(
            f"drafter tensor {REJECTED_EMBEDDING} has shape "
            f"{header[REJECTED_EMBEDDING]['shape']}, expected [{d.hidden_size}]"
        )


def has_rejected_embedding(path: str | Path) -> bool:
    return REJECTED_EMBEDDING in read_weights_header(Path(path))


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


def save_drafter(out_dir: str | Path, config: dict[str, Any],
                 state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> Path:
    """Write `config.json` and `model.safetensors` into `out_dir`."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(config, torch_dtype=str(dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.detach().to(dtype).contiguous() for k, v in state.items()},
              str(out / WEIGHTS_FILE))
    return out


def load_drafter_state(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, state dict) of a drafter folder; a missing rejected
    embedding is returned as zeros, as the vLLM loader does."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        state |= load_file(str(file))
    if REJECTED_EMBEDDING not in state:
        state[REJECTED_EMBEDDING] = torch.zeros(cfg["hidden_size"])
    return cfg, state
