"""`method: "carryover"` in a vLLM speculative config: keys, validation, translation.

vLLM's `SpeculativeConfig.method` is a closed Literal, so a carryover config is
validated here and handed to vLLM as a DFlash config; the carryover settings
ride along on the drafter's `hf_config` (pickled to every worker with it), where
the proposer reads them.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_carryover.drafter.checkpoint import has_rejected_embedding
from vllm_carryover.drafter.source import resolve_drafter
from vllm_carryover.drafter.validation import validate_drafter
from vllm_carryover.errors import CarryoverConfigError
from vllm_carryover.lookups.slots import CONFIG_KEY as SLOTS_KEY

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's configured logger

METHOD = "carryover"
HF_ATTR = "carryover_runtime"

# Our own keys, with their meaning (shown in errors and the README).
GOODPUT = "goodput"  # num_speculative_tokens_per_batch_size: K by measured goodput
CARRYOVER_KEYS: dict[str, str] = {
    "carryover": "true: the next draft attends to the rejected states of the last "
    "verify step; false: plain DFlash drafting on the same weights; default: true if "
    "the drafter has a rejected_embedding (was trained to read carried states)",
    "suffix_lookup": "true: where arctic-inference's suffix trees of the request's own "
    "text and of the answers the server has written continue the request's text, draft "
    "that instead of the drafter's block, as vLLM's suffix method does (its "
    "suffix_decoding_* keys tune it; default: false)",
    "lookup_drafter_k": "with suffix_lookup, how many of the drafter's tokens a request "
    "without a match drafts (0: none, and the drafter never runs; default: "
    "num_speculative_tokens)",
    "drafter_gate": "with a lookup and K by goodput "
    "(num_speculative_tokens_per_batch_size \"goodput\"), true: per batch size, whether "
    "requests without a match draft the drafter's tokens is decided by each choice's "
    "measured tokens/s; false: they always do (default: true)",
}
# Keys of earlier versions, each with what replaced it (an error at startup names it).
_SUFFIX_INSTEAD = ("was replaced by \"suffix_lookup\": true, whose trees hold the request's "
                   "own text and the server's past answers")
RETIRED_KEYS: dict[str, str] = {
    "prompt_lookup": _SUFFIX_INSTEAD,
    "corpus_lookup": _SUFFIX_INSTEAD,
    "prompt_lookup_min": "went with 'prompt_lookup' (vLLM's n-gram matcher); "
    "\"suffix_lookup\": true matches as long a suffix as its trees hold "
    "(suffix_decoding_max_tree_depth)",
    "prompt_lookup_max": "went with 'prompt_lookup' (vLLM's n-gram matcher); "
    "\"suffix_lookup\": true matches as long a suffix as its trees hold "
    "(suffix_decoding_max_tree_depth)",
    "prompt_lookup_drafter_k": "is now 'lookup_drafter_k' (same meaning)",
}
# vLLM's suffix method's knobs, which suffix_lookup reads with vLLM's defaults: each
# key's type and range (least, most; None: no bound), as vLLM checks its own method's.
SUFFIX_KEYS: dict[str, tuple[type, float, float | None]] = {
    "suffix_decoding_max_tree_depth": (int, 1, None),
    "suffix_decoding_max_cached_requests": (int, 0, None),
    "suffix_decoding_max_spec_factor": (float, 0, None),
    "suffix_decoding_min_token_prob": (float, 0, 1),
}
# vLLM's keys that make sense for a carryover drafter.
VLLM_KEYS: tuple[str, ...] = (
    "method",
    "model",
    "num_speculative_tokens",
    "num_speculative_tokens_per_batch_size",
    "draft_tensor_parallel_size",
    "max_model_len",
    "revision",
    "attention_backend",
    "draft_sample_method",
    "rejection_sample_method",
    "disable_padded_drafter_batch",
    "disable_eagle_block_drop",
    "enforce_eager",
    *SUFFIX_KEYS,
)
ALLOWED_KEYS: tuple[str, ...] = VLLM_KEYS + tuple(CARRYOVER_KEYS)


@dataclass(frozen=True)
class CarryoverSettings:
    """What the proposer needs to know beyond vLLM's DFlash settings."""

    enabled: bool = True
    goodput_k: bool = False  # K per step by measured goodput (`goodput_k`)
    suffix_lookup: bool = False  # the suffix trees' drafts where they have some
    lookup_drafter_k: int | None = None  # None: all K
    drafter_gate: bool = True  # with K by goodput: the drafter's tokens only where they pay

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> CarryoverSettings:
        return cls(**(getattr(hf_config, HF_ATTR, None) or {}))


def is_carryover(spec: dict[str, Any] | None) -> bool:
    return isinstance(spec, dict) and spec.get("method") == METHOD


def translate(spec: dict[str, Any], target_hf_config: Any) -> tuple[dict[str, Any],
                                                                     CarryoverSettings]:
    """Validate a carryover speculative config; return vLLM's DFlash config + settings.

    Raises CarryoverConfigError with the cause and the fix.
    """
    spec = {k.replace("-", "_"): v for k, v in spec.items()}
    retired = [key for key in RETIRED_KEYS if key in spec]
    if retired:
        raise CarryoverConfigError("; ".join(f"'{key}' {RETIRED_KEYS[key]}" for key in retired))
    unknown = sorted(set(spec) - set(ALLOWED_KEYS))
    if unknown:
        raise CarryoverConfigError(
            f"unknown key(s) {unknown} in the carryover speculative config; "
            f"allowed keys: {', '.join(ALLOWED_KEYS)}"
        )
    enabled = spec.pop("carryover", None)
    lookup = lookup_settings(spec.pop("suffix_lookup", False),
                             spec.pop("lookup_drafter_k", None),
                             spec.pop("drafter_gate", True))
    check_suffix_keys(spec, lookup["suffix_lookup"])
    schedule = spec.get("num_speculative_tokens_per_batch_size")
    if isinstance(schedule, str) and schedule != GOODPUT:
        raise CarryoverConfigError(
            f"'num_speculative_tokens_per_batch_size' must be \"{GOODPUT}\" or a list of "
            f"[first batch size, last batch size, K], got {schedule!r}")
    goodput_k = schedule == GOODPUT
    if enabled is not None and not isinstance(enabled, bool):
        raise CarryoverConfigError(
            f"'carryover' must be true or false, got {enabled!r}")
    if spec.get("disable_padded_drafter_batch"):
        raise CarryoverConfigError(
            "carryover needs vLLM's padded drafter batch, where rejected rows reach the "
            "drafter; remove 'disable_padded_drafter_batch'")
    model = spec.get("model")
    if not isinstance(model, str) or not model:
        raise CarryoverConfigError(
            "the carryover speculative config needs 'model': the path of a drafter folder "
            "or a Hugging Face hub id")
    k = spec.get("num_speculative_tokens")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
        raise CarryoverConfigError(
            f"'num_speculative_tokens' must be an integer, got {k!r}")
    if k is not None and k < 1:
        raise CarryoverConfigError(
            f"'num_speculative_tokens' must be at least 1, got {k}; leave it out to draft "
            "block_size - 1 tokens per step, or drop the speculative config to turn "
            "speculation off")
    # vLLM gets the folder that was validated: a hub id becomes its local snapshot.
    folder = resolve_drafter(model, spec.get("revision"))
    spec["model"] = str(folder)
    drafter = validate_drafter(folder, target_hf_config, k)
    if k is None:
        spec["num_speculative_tokens"] = drafter.block_size - 1
    check_slot_proposals(folder, spec, lookup)
    drafter_k = lookup["lookup_drafter_k"]
    if drafter_k is not None and drafter_k > spec["num_speculative_tokens"]:
        raise CarryoverConfigError(
            f"'lookup_drafter_k' ({drafter_k}) is above num_speculative_tokens "
            f"({spec['num_speculative_tokens']}); use 0..{spec['num_speculative_tokens']}")
    if enabled is None:
        enabled = default_enabled(folder)
    if goodput_k:  # vLLM's dynamic K on; patches.goodput_scheduler replaces its lookup
        spec["num_speculative_tokens_per_batch_size"] = [[1, 1, spec["num_speculative_tokens"]]]
    # vLLM drops the last matched block of every prefix-cache hit for methods that
    # draft from target states, because an EAGLE drafter's K/V at a position also
    # holds the next token, which a chunk boundary can leave wrong. A DFlash-style
    # drafter's context K/V at a position comes from that position's target state
    # alone, written in the step that computes it, and the query block and carried
    # rows only ever land past the computed tokens, in blocks not yet cached
    # (tests/test_carryover_path.py checks drafts after hits). So the drop only
    # costs recomputation: at concurrency 16 with repeated prompts it cost a third
    # of the hits and 1.4x the time to first token (docs/results.md, Behind the defaults).
    spec.setdefault("disable_eagle_block_drop", True)
    spec["method"] = "dflash"
    return spec, CarryoverSettings(enabled=enabled, goodput_k=goodput_k, **lookup)


def lookup_settings(suffix: Any, drafter_k: Any, gate: Any) -> dict[str, Any]:
    """The lookup keys, checked (CarryoverConfigError with the fix)."""
    for key, value in (("suffix_lookup", suffix), ("drafter_gate", gate)):
        if not isinstance(value, bool):
            raise CarryoverConfigError(f"'{key}' must be true or false, got {value!r}")
    if drafter_k is not None:
        _check_count("lookup_drafter_k", drafter_k, least=0)
    return {"suffix_lookup": suffix, "lookup_drafter_k": drafter_k, "drafter_gate": gate}


def check_suffix_keys(spec: dict[str, Any], suffix: bool) -> None:
    """vLLM's suffix_decoding_* keys (left in `spec` for vLLM's config, where the
    proposer reads them): only with suffix_lookup, in vLLM's ranges, and arctic-inference
    importable (CarryoverConfigError with the fix)."""
    given = [key for key in SUFFIX_KEYS if key in spec]
    if given and not suffix:
        raise CarryoverConfigError(
            f"{given} tune 'suffix_lookup', which is off; add \"suffix_lookup\": true or "
            "remove them")
    for key in given:
        kind, least, most = SUFFIX_KEYS[key]
        value = spec[key]
        number = isinstance(value, int if kind is int else (int, float))
        if (isinstance(value, bool) or not number or value < least
                or (most is not None and value > most)):
            what = "an integer" if kind is int else "a number"
            bound = f"of at least {least}" if most is None else f"in [{least}, {most}]"
            raise CarryoverConfigError(f"'{key}' must be {what} {bound}, got {value!r}")
    if suffix:
        _need_arctic("'suffix_lookup'", "remove 'suffix_lookup'")


def check_slot_proposals(folder: Path, spec: dict[str, Any], lookup: dict[str, Any]) -> None:
    """A drafter trained on the suffix lookup's proposals in its slots
    (`lookups.slots`) brings that lookup, asked as its training asked: the keys that
    put the lookup beside a drafter do not apply (CarryoverConfigError with the fix)."""
    import json

    slots = json.loads((folder / "config.json").read_text()).get(SLOTS_KEY)
    if not slots:
        return
    given = [key for key, off in (("suffix_lookup", False), ("lookup_drafter_k", None))
             if lookup[key] != off] + [key for key in SUFFIX_KEYS if key in spec]
    if given:
        raise CarryoverConfigError(
            f"the drafter {folder} reads the suffix lookup's proposals in its draft slots "
            f"({SLOTS_KEY} in its config.json), with the settings it was trained with; "
            f"remove {given}")
    _need_arctic(f"the drafter's {SLOTS_KEY}", "use a drafter without them")


def _need_arctic(what: str, instead: str) -> None:
    try:
        import arctic_inference.suffix_decoding  # noqa: F401  (its compiled trees)
    except ImportError as e:
        raise CarryoverConfigError(
            f"{what} needs the arctic-inference package, which does not import here ({e}); "
            f"run scripts/setup.sh, which builds arctic-inference 0.3.0 against this "
            f"Python, or {instead}") from None


def _check_count(key: str, n: Any, least: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < least:
        raise CarryoverConfigError(f"'{key}' must be an integer of at least {least}, got {n!r}")


def default_enabled(folder: Path) -> bool:
    """Carryover on by default only for a drafter trained to read carried states.

    A checkpoint without `rejected_embedding` (plain DFlash, or trained without
    carried states) would read rejected keys it never saw in training, unmarked:
    measured on the shipped baselines, tau with carryover on is 0.995-0.998x off
    (docs/results.md), so off is the default there.
    """
    if has_rejected_embedding(folder):
        logger.info("Carryover on by default: the drafter has a rejected_embedding; set "
                    "\"carryover\": false in the speculative config to turn it off")
        return True
    logger.info("Carryover off by default: the drafter has no rejected_embedding (it was "
                "not trained to read carried states); set \"carryover\": true in the "
                "speculative config to turn it on")
    return False


def short_drafter_warning(drafter_len: int, serving_len: int, k: int) -> str | None:
    """Why a drafter whose length limit is below the serving `max_model_len` hurts: every
    request longer than limit - K - 1 tokens gets no drafts (`length_limit`)."""
    if drafter_len >= serving_len:
        return None
    return (
        f"the carryover drafter's length limit ({drafter_len} tokens, its config.json "
        f"max_position_embeddings) is below the serving max_model_len ({serving_len}): "
        f"requests past {drafter_len - k - 1} tokens get no drafts (no speedup for them); "
        f"export the drafter with the target's limit or serve with --max-model-len "
        f"{drafter_len}")


def vllm_refusal(error: Any) -> CarryoverConfigError:
    """One-line CarryoverConfigError for vLLM's pydantic refusal of the translated config.

    vLLM checks the types of its own keys (e.g. `max_model_len: "x"`) when it builds
    `SpeculativeConfig`; its multi-line ValidationError becomes `key: problem (got value)`.
    """
    problems = []
    for e in error.errors(include_url=False):
        where = ".".join(str(part) for part in e.get("loc", ()))
        got = repr(e.get("input"))
        got = got if len(got) <= 60 else got[:57] + "..."
        problem = " ".join(str(e.get("msg", "")).split())
        problems.append(f"{where}: {problem} (got {got})" if where else problem)
    return CarryoverConfigError(
        f"vLLM refused the carryover speculative config: {'; '.join(problems)}")


def attach(spec_config: Any, settings: CarryoverSettings) -> None:
    """Store the settings on the drafter's hf_config, which reaches every worker."""
    setattr(spec_config.draft_model_config.hf_config, HF_ATTR, asdict(settings))


def runtime_settings(vllm_config: Any) -> CarryoverSettings | None:
    """The carryover settings of an engine's config; None for any other config."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    if draft is None or getattr(draft.hf_config, HF_ATTR, None) is None:
        return None
    return CarryoverSettings.from_hf_config(draft.hf_config)


def wants_carryover(vllm_config: Any) -> bool:
    return runtime_settings(vllm_config) is not None
