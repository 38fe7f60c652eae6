"""`python -m benchmarks` in the repository, `python -m vllm_carryover.benchmarks` anywhere.

Only a launcher: the package installs as `vllm_carryover.benchmarks`, so everything,
this entry included, imports it under that one name (see `main.py`).
"""

from vllm_carryover.benchmarks.main import main

main()
