"""The checkpoint format has one set of defaults, and they are the ones vLLM reads."""

from __future__ import annotations

from transformers import LlamaConfig, Qwen3Config

from vllm_carryover.drafter.format import DrafterConfig, make_config_dict


def minimal_drafter_config() -> dict:
    """A drafter config.json with only the fields the format requires."""
    return {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 4, "vocab_size": 100,
            "dflash_config": {"mask_token_id": 0, "target_layer_ids": [1]}}


def test_absent_fields_default_to_what_transformers_qwen3_config_assumes():
    """vLLM builds a `model_type: qwen3` drafter through Qwen3Config: our reading of
    a config without eps, RoPE base or length must agree with it."""
    ours = DrafterConfig.from_dict(minimal_drafter_config())
    theirs = Qwen3Config()
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.max_position_embeddings == theirs.max_position_embeddings


def test_a_written_config_reads_back_with_the_target_values():
    target = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, rms_norm_eps=1e-5,
                         max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e5}).to_dict()
    cfg = DrafterConfig.from_dict(make_config_dict(
        target, num_layers=1, block_size=8, target_layer_ids=[1], mask_token_id=3))
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.max_position_embeddings) == (1e-5, 5e5, 4096)
    assert (cfg.num_key_value_heads, cfg.block_size, cfg.mask_token_id) == (2, 8, 3)
