"""Training recipes for carryover drafters: the plain DFlash baseline and carryover.

Subcommands (`python -m train ...`): `data` builds prompts in four categories,
the target's own greedy responses and its hidden states, `baseline` trains a plain
DFlash drafter on them, `carryover` fine-tunes one with parallel
draft-verify-draft (rejected states carried over), `export` writes the trained
drafter as a servable checkpoint folder, and `eval` measures the acceptance length
per category in vLLM. Caches live under
`~/.cache/vllm-carryover/train/` (or `$VLLM_CARRYOVER_CACHE/train`).
"""
