"""Carryover speculative decoding for vLLM: drafts that reuse rejected target states.

vLLM loads `register` through the `vllm.general_plugins` entry point in every
process it starts; after that, `method: "carryover"` is a speculative method.
"""

__version__ = "0.1.0"


def register() -> None:
    """vLLM general-plugin entry point (idempotent)."""
    from vllm_carryover import patches

    patches.apply()
