"""Training recipes for carryover drafters: the plain DFlash baseline and carryover.

Subcommands (`python -m train ...`): `data` builds prompts in five categories
and the target's own greedy responses (resumable shards), `baseline` trains a
plain DFlash drafter on them (the target's hidden states cached on first use),
`carryover` fine-tunes one with parallel draft-verify-draft (rejected states
carried over), `export` writes the trained drafter as a servable checkpoint
folder, `eval` measures the acceptance length per category in vLLM, and
`headroom` what rejected states could add. Caches live under
`~/.cache/vllm-carryover/train/` (or `$VLLM_CARRYOVER_CACHE/train`).
"""
