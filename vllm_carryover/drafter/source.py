"""Where a drafter's files are: a local folder, or a Hugging Face hub snapshot.

vLLM accepts a hub id as the speculative config's "model". The plugin must read
and validate the drafter's files before any engine starts, so it resolves the id
as vLLM would (huggingface_hub's snapshot of `revision`, the local HF cache,
`HF_HUB_OFFLINE`) and hands vLLM the local snapshot folder it validated.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from vllm_carryover.errors import CarryoverConfigError

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's configured logger

# What a drafter checkpoint needs: config.json, the weights and a shard index.
HUB_PATTERNS = ["*.json", "*.safetensors"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(model: str) -> bool:
    """`owner/name` that is not an existing path (vLLM's rule for a model name)."""
    return _HUB_ID.fullmatch(model) is not None and not Path(model).exists()


def resolve_drafter(model: str, revision: str | None = None) -> Path:
    """The local folder holding drafter `model` (a path, or a hub id to snapshot).

    Raises CarryoverConfigError naming the id and the fix when the hub has no such
    repository or revision, or the files are neither cached nor downloadable.
    """
    if not is_hub_id(model):
        return Path(model).expanduser()
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{model}@{revision}" if revision else model
    try:
        folder = Path(snapshot_download(model, revision=revision, allow_patterns=HUB_PATTERNS))
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise CarryoverConfigError(
            f"drafter {at} is not a local folder and the Hugging Face hub has no such "
            f"{'revision' if isinstance(e, RevisionNotFoundError) else 'repository'} "
            "(or it is private: log in with `hf auth login`)") from e
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        cause = " ".join(str(e).split())
        cause = cause if len(cause) <= 240 else cause[:237] + "..."
        raise CarryoverConfigError(
            f"drafter {at} is not a local folder and its Hugging Face hub snapshot is "
            f"neither in the local cache nor downloadable ({type(e).__name__}: {cause}); "
            f"download it where the hub is reachable (`hf download {model}`) or pass a "
            "local folder") from e
    logger.info("Carryover drafter %s: Hugging Face snapshot %s", at, folder)
    return folder
