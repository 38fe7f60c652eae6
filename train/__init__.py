"""Training recipes for carryover drafters (first version: the plain DFlash baseline).

Subcommands (`python -m train ...`): `data` builds prompts and the target's own
greedy responses, `baseline` trains a plain DFlash drafter on them, `export`
writes the trained drafter as a servable checkpoint folder, and `eval-vllm`
measures the acceptance length in vLLM. Caches live under
`~/.cache/vllm-carryover/train/` (or `$VLLM_CARRYOVER_CACHE/train`).
"""
