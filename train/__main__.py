"""`python -m train` in the repository, `python -m vllm_carryover.train` anywhere.

Only a launcher: the package installs as `vllm_carryover.train`, so everything,
this entry included, imports it under that one name (see `main.py`).
"""

from vllm_carryover.train.main import main

main()
