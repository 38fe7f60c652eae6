"""Benchmarks of carryover against what users would run instead, through real vLLM."""
