"""The drafter: its vLLM model, the PyTorch reference, the Markov head, the folder
format, checkpoints and where they come from, startup validation, the draft vocabulary,
and `init-drafter`."""
