"""A carryover speculative config that cannot work stops vLLM at startup, saying why.

One table, `BAD_INPUTS`, holds every bad input with the words its error must
contain. The plugin's validator (`speculative_config.translate`, which vLLM
calls from `EngineArgs.create_speculative_config` in the main process before
any engine starts) is checked on each of them against a small target stub, in
milliseconds. The inputs marked `cli` also run through the real `vllm serve`
CLI: it must exit non-zero at startup with a one-line cause, no traceback, its
port closed and no process of its group left behind. A few cases build vLLM's
whole engine config in-process: the valid ones, and the one only vLLM's own
type checks catch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
from support.checkpoint_layouts import TARGET_STUB, shard_drafter

from vllm_carryover.config import translate
from vllm_carryover.drafter.format import REJECTED_EMBEDDING, WEIGHTS_FILE, WEIGHTS_INDEX
from vllm_carryover.drafter.init_drafter import init_drafter
from vllm_carryover.errors import CarryoverConfigError
from vllm_carryover.patches import user_experience
from vllm_carryover.tools.run_settings import KV_CACHE_BYTES
from vllm_carryover.tools.server_process import VllmServer


def carryover(drafter: Path, **extra: Any) -> dict[str, Any]:
    return {"method": "carryover", "model": str(drafter), "num_speculative_tokens": 4,
            "carryover": True, **extra}


def edit_config(drafter: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    cfg_file = drafter / "config.json"
    cfg = json.loads(cfg_file.read_text())
    edit(cfg)
    cfg_file.write_text(json.dumps(cfg))


def edit_weights(drafter: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    from safetensors.torch import load_file, save_file

    weights = str(drafter / WEIGHTS_FILE)
    state = load_file(weights)
    edit(state)
    save_file(state, weights)


# Ways to break a drafter folder in place (the table's `break_drafter`).


def truncate_weights(drafter: Path) -> None:
    weights = drafter / WEIGHTS_FILE
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(size // 2)


def corrupt_weights_header(drafter: Path) -> None:
    with (drafter / WEIGHTS_FILE).open("r+b") as f:
        f.write(b"\xff" * 8)


def rebuild_for_hidden_size_128(drafter: Path) -> None:
    """Replace the drafter with one made for a target of hidden size 128."""
    tiny_target = drafter.parent / "tiny_target"
    tiny_target.mkdir()
    (tiny_target / "config.json").write_text(json.dumps(
        {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "vocab_size": 49152}))
    shutil.rmtree(drafter)
    init_drafter(tiny_target, drafter, block_size=8)


def add_markov_head(drafter: Path, rank: int = 4) -> None:
    from vllm_carryover.drafter.markov_head import fresh_markov_state

    edit_weights(drafter, lambda state: state.update(fresh_markov_state(49152, rank)))


def add_confidence_levels(drafter: Path, levels: int = 9) -> None:
    import torch

    edit_weights(drafter, lambda state: state.update(slot_confidence=torch.zeros(levels, 576)))


def add_draft_vocab(ids: list[int], d2t_dtype: str = "int64", size_in_config: bool = True
                    ) -> Callable[[Path], None]:
    """A draft vocabulary over target ids `ids` (as given: possibly out of order)."""
    import torch

    from vllm_carryover.drafter.format import D2T, LM_HEAD
    from vllm_carryover.drafter.vocab import to_offsets

    def add(drafter: Path) -> None:
        edit_weights(drafter, lambda state: state.update({
            LM_HEAD: torch.zeros(len(ids), 576),
            D2T: to_offsets(torch.tensor(ids)).to(getattr(torch, d2t_dtype))}))
        if size_in_config:
            set_config(draft_vocab_size=len(ids))(drafter)
    return add


def set_config(**values: Any) -> Callable[[Path], None]:
    return lambda drafter: edit_config(drafter, lambda cfg: cfg.update(values))


def set_dflash_config(**values: Any) -> Callable[[Path], None]:
    return lambda drafter: edit_config(drafter, lambda cfg: cfg["dflash_config"].update(values))


SLOTS = {"source": "suffix", "max_tree_depth": 24, "max_cached_requests": 10000,
         "min_token_prob": 0.0, "max_spec_factor": 8.0}  # a slot drafter's settings


@dataclass(frozen=True)
class BadInput:
    """One bad input: how to make it, and the words its one-line error must contain.

    `spec` is merged into a valid carryover config (a str is passed to the CLI as it
    is); `break_drafter` edits a private copy of a valid drafter; `cli` also runs the
    case through the real `vllm serve`; `vllm_only` marks a refusal that comes from
    vLLM's own checks, which the plugin's validator alone cannot see.
    """

    expected: tuple[str, ...]
    spec: dict[str, Any] | str = field(default_factory=dict)
    break_drafter: Callable[[Path], None] | None = None
    cli: bool = False
    vllm_only: bool = False


LOOKUP_OFF = {"suffix_lookup": False, "lookup_drafter_k": None, "drafter_gate": True}

BAD_INPUTS: dict[str, BadInput] = {
    # the speculative config itself
    "malformed_json": BadInput(("argument --speculative-config/-sc: Value {",),
                               spec='{"method": "carryover", "model": ', cli=True,
                               vllm_only=True),
    "unknown_key": BadInput(("unknown key(s) ['bogus']", "allowed keys: method, model, "
                             "num_speculative_tokens", "carryover"),
                            spec={"bogus": 1}, cli=True),
    "no_model": BadInput(("needs 'model': the path of a drafter folder",), spec={"model": ""}),
    "wrong_type_ours": BadInput(("'num_speculative_tokens' must be an integer, got '4'",),
                                spec={"num_speculative_tokens": "4"}, cli=True),
    "k_fractional": BadInput(("'num_speculative_tokens' must be an integer, got 2.5",),
                             spec={"num_speculative_tokens": 2.5}),
    "wrong_type_vllm": BadInput(("vLLM refused the carryover speculative config: "
                                 "max_model_len: Input should be a valid integer",),
                                spec={"max_model_len": "x"}, cli=True, vllm_only=True),
    "k_zero": BadInput(("'num_speculative_tokens' must be at least 1, got 0; leave it out",),
                       spec={"num_speculative_tokens": 0}, cli=True),
    "k_negative": BadInput(("'num_speculative_tokens' must be at least 1, got -1",),
                           spec={"num_speculative_tokens": -1}),
    "k_beyond_block": BadInput(("num_speculative_tokens=8 but drafter",
                                "has block_size 8, so it drafts at most 7 tokens; use 1..7"),
                               spec={"num_speculative_tokens": 8}, cli=True),
    "carryover_not_bool": BadInput(("'carryover' must be true or false, got 'yes'",),
                                   spec={"carryover": "yes"}),
    "k_schedule_unknown_word": BadInput(("'num_speculative_tokens_per_batch_size' must be "
                                         "\"goodput\" or a list", "got 'auto'"),
                                        spec={"num_speculative_tokens_per_batch_size": "auto"}),
    # the keys of the lookups the suffix lookup replaced: each names its replacement
    "prompt_lookup_replaced": BadInput(
        ("'prompt_lookup' was replaced by \"suffix_lookup\": true, whose trees hold the "
         "request's own text and the server's past answers",), spec={"prompt_lookup": True}),
    "corpus_lookup_replaced": BadInput(
        ("'corpus_lookup' was replaced by \"suffix_lookup\": true",),
        spec={"corpus_lookup": True}),
    "prompt_lookup_ngram_lengths_gone": BadInput(
        ("'prompt_lookup_min' went with 'prompt_lookup'",
         "'prompt_lookup_max' went with 'prompt_lookup'", "suffix_decoding_max_tree_depth"),
        spec={"prompt_lookup_min": 2, "prompt_lookup_max": 4}),
    "prompt_lookup_drafter_k_renamed": BadInput(
        ("'prompt_lookup_drafter_k' is now 'lookup_drafter_k'",),
        spec={"suffix_lookup": True, "prompt_lookup_drafter_k": 1}),
    "lookup_drafter_k_above_k": BadInput(
        ("'lookup_drafter_k' (5) is above num_speculative_tokens (4); use 0..4",),
        spec={"suffix_lookup": True, "lookup_drafter_k": 5}),
    "drafter_gate_not_bool": BadInput(("'drafter_gate' must be true or false, got 0",),
                                      spec={"drafter_gate": 0}),
    "suffix_lookup_not_bool": BadInput(("'suffix_lookup' must be true or false, got 1",),
                                       spec={"suffix_lookup": 1}),
    "suffix_key_without_suffix_lookup": BadInput(
        ("['suffix_decoding_max_tree_depth'] tune 'suffix_lookup', which is off",),
        spec={"suffix_decoding_max_tree_depth": 16}),
    "suffix_min_token_prob_above_one": BadInput(
        ("'suffix_decoding_min_token_prob' must be a number in [0, 1], got 1.5",),
        spec={"suffix_lookup": True, "suffix_decoding_min_token_prob": 1.5}),
    "suffix_tree_depth_fractional": BadInput(
        ("'suffix_decoding_max_tree_depth' must be an integer of at least 1, got 2.5",),
        spec={"suffix_lookup": True, "suffix_decoding_max_tree_depth": 2.5}),
    "lookup_drafter_k_negative": BadInput(
        ("'lookup_drafter_k' must be an integer of at least 0, got -1",),
        spec={"lookup_drafter_k": -1}),
    "suffix_lookup_beside_a_slot_proposal_drafter": BadInput(
        ("reads the suffix lookup's proposals in its draft slots (slot_proposals in its "
         "config.json)", "remove ['suffix_lookup', 'suffix_decoding_min_token_prob']"),
        spec={"suffix_lookup": True, "suffix_decoding_min_token_prob": 0.5},
        break_drafter=set_config(slot_proposals=SLOTS)),
    "unpadded_drafter_batch": BadInput(("needs vLLM's padded drafter batch",
                                        "remove 'disable_padded_drafter_batch'"),
                                       spec={"disable_padded_drafter_batch": True}),
    # a drafter that does not fit the target
    "other_hidden_size": BadInput(("built for hidden size 128",
                                   "but the target's hidden size is 576"),
                                  break_drafter=rebuild_for_hidden_size_128),
    "other_vocabulary": BadInput(("vocabulary size 32000 but the target has 49152",),
                                 break_drafter=set_config(vocab_size=32000), cli=True),
    "layer_beyond_depth": BadInput(("reads target layers [40], outside 0..28 of a 30-layer",),
                                   break_drafter=set_dflash_config(target_layer_ids=[1, 14, 40]),
                                   cli=True),
    "mask_token_outside_vocabulary": BadInput(
        ("has mask_token_id 49152 outside the vocabulary",),
        break_drafter=set_dflash_config(mask_token_id=49152)),
    "causal_drafter": BadInput(("is causal; carryover places rejected states after the query",),
                               break_drafter=set_dflash_config(causal=True)),
    # a broken drafter folder
    "missing_folder": BadInput(("does not exist; pass a local folder made by",),
                               break_drafter=shutil.rmtree),
    "missing_config": BadInput(("has no config.json",),
                               break_drafter=lambda d: (d / "config.json").unlink()),
    "config_not_a_drafter": BadInput(("is not a DFlash drafter config (KeyError",),
                                     break_drafter=lambda d: edit_config(
                                         d, lambda cfg: cfg.pop("dflash_config"))),
    "sharded_without_a_shard": BadInput(
        ("lacks 1 of the 2 shards its model.safetensors.index.json names (first: "
         "model-00002-of-00002.safetensors)",),
        break_drafter=lambda d: (d / shard_drafter(d)[1]).unlink()),
    "shard_index_without_weight_map": BadInput(
        ("model.safetensors.index.json is not a safetensors index (KeyError",),
        break_drafter=lambda d: (shard_drafter(d), (d / WEIGHTS_INDEX).write_text("{}"))),
    "missing_weights": BadInput((f"has no {WEIGHTS_FILE}",),
                                break_drafter=lambda d: (d / WEIGHTS_FILE).unlink(), cli=True),
    "truncated_weights": BadInput(("is truncated or corrupt (tensor data ends",),
                                  break_drafter=truncate_weights, cli=True),
    "corrupt_header": BadInput(("is truncated or corrupt (header length",),
                               break_drafter=corrupt_weights_header, cli=True),
    "wrong_shape": BadInput(("tensor norm.weight has shape [575] but config.json implies [576]",),
                            break_drafter=lambda d: edit_weights(d, lambda s: s.update(
                                {"norm.weight": s["norm.weight"][:-1].clone()})),
                            cli=True),
    "rejected_embedding_wrong_shape": BadInput(
        (f"tensor {REJECTED_EMBEDDING} has shape [8], expected [576]",),
        break_drafter=lambda d: edit_weights(d, lambda s: s.update(
            {REJECTED_EMBEDDING: s["norm.weight"][:8].clone()}))),
    # the Markov head (the semi-autoregressive drafter)
    "markov_head_without_rank": BadInput(("hold a Markov head", "config.json has no "
                                          "markov_rank; add \"markov_rank\": R"),
                                         break_drafter=add_markov_head),
    "markov_rank_without_head": BadInput(("lack 2 tensors (first: markov_head.markov_w1.weight)",),
                                         break_drafter=set_config(markov_rank=4)),
    "markov_head_of_other_rank": BadInput(
        ("markov_head.markov_w1.weight has shape [49152, 4] but config.json implies "
         "[49152, 8]",),
        break_drafter=lambda d: (add_markov_head(d, rank=4), set_config(markov_rank=8)(d))),
    "markov_rank_negative": BadInput(("has markov_rank -1; it must be a non-negative integer",),
                                     break_drafter=set_config(markov_rank=-1)),
    "markov_rank_fractional": BadInput(("has markov_rank 2.5; it must be a non-negative",),
                                       break_drafter=set_config(markov_rank=2.5)),
    "markov_rank_string": BadInput(("has markov_rank '8'; it must be a non-negative",),
                                   break_drafter=set_config(markov_rank="8")),
    # the slots' confidence levels (a drafter reading lookup proposals in its slots)
    "confidence_levels_without_embedding": BadInput(
        ("lack 1 tensors (first: slot_confidence)",),
        break_drafter=set_config(slot_proposals=SLOTS | {"confidence_levels": 9})),
    "confidence_embedding_without_levels": BadInput(
        ("hold the slots' confidence levels (slot_confidence)", "add \"confidence_levels\": L"),
        break_drafter=lambda d: (set_config(slot_proposals=SLOTS)(d), add_confidence_levels(d))),
    # a draft vocabulary (the LM head over a subset of the target's tokens)
    "draft_vocab_without_size": BadInput(
        ("hold a draft vocabulary (d2t) but config.json has no draft_vocab_size",),
        break_drafter=add_draft_vocab([0, 5, 9], size_in_config=False)),
    "draft_vocab_size_without_map": BadInput(("lack 2 tensors (first: d2t)",),
                                             break_drafter=set_config(draft_vocab_size=3)),
    "draft_vocab_map_not_integer": BadInput(
        ("tensor d2t in", "is F32; it must be an integer tensor"),
        break_drafter=add_draft_vocab([0, 5, 9], d2t_dtype="float32"), cli=True),
    "draft_vocab_map_out_of_order": BadInput(
        ("does not map its 3 ids onto distinct target ids in 0..49151 in order",),
        break_drafter=add_draft_vocab([0, 9, 5])),
    "draft_vocab_map_outside_vocabulary": BadInput(
        ("does not map its 3 ids onto distinct target ids in 0..49151",),
        break_drafter=add_draft_vocab([0, 5, 49152])),
}
CLI_CASES = [name for name, case in BAD_INPUTS.items() if case.cli]


def make_bad_input(case: BadInput, valid_drafter: Path, work: Path) -> str | dict[str, Any]:
    """The speculative config of `case`, its drafter a broken copy of `valid_drafter`."""
    drafter = valid_drafter
    if case.break_drafter is not None:
        drafter = Path(shutil.copytree(valid_drafter, work / "drafter"))
        case.break_drafter(drafter)
    return case.spec if isinstance(case.spec, str) else carryover(drafter, **case.spec)


# -- the validator, on a target stub ------------------------------------------------------


def test_validator_accepts_the_valid_drafter(stub_drafter):
    spec, settings = translate(carryover(stub_drafter), SimpleNamespace(**TARGET_STUB))
    assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == 4
    assert settings.enabled


@pytest.mark.parametrize("asked, expected", [(None, True), (False, False), (True, True)])
def test_prefix_cache_hits_keep_their_last_block_unless_asked(stub_drafter, asked, expected):
    """vLLM's EAGLE last-block drop is off by default for carryover (a drafter's
    context K/V at a position needs nothing past it); a user can still ask for it."""
    extra = {} if asked is None else {"disable_eagle_block_drop": asked}
    spec, _ = translate(carryover(stub_drafter, **extra), SimpleNamespace(**TARGET_STUB))
    assert spec["disable_eagle_block_drop"] is expected


@pytest.mark.parametrize("case", [n for n, c in BAD_INPUTS.items() if not c.vllm_only])
def test_validator_refuses_bad_input_in_one_line_naming_the_fix(stub_drafter, tmp_path, case):
    spec = make_bad_input(BAD_INPUTS[case], stub_drafter, tmp_path)
    with pytest.raises(CarryoverConfigError) as info:
        translate(spec, SimpleNamespace(**TARGET_STUB))
    message = str(info.value)
    assert "\n" not in message
    for words in BAD_INPUTS[case].expected:
        assert words in message


# -- vLLM's engine config, in-process -----------------------------------------------------


def engine_config(target: Path, spec: dict[str, Any]) -> Any:
    """Build vLLM's engine config for `target` with speculative config `spec` (no engine)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(target),
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        speculative_config=spec,
    ).create_engine_config()


def test_valid_config_becomes_dflash_with_carryover_enabled(smollm2, random_drafter):
    config = engine_config(smollm2, carryover(random_drafter))
    spec = config.speculative_config
    assert spec.method == "dflash"
    assert spec.num_speculative_tokens == 4
    assert spec.draft_model_config.hf_config.carryover_runtime == {
        "enabled": True, "goodput_k": False, **LOOKUP_OFF}


def test_carryover_false_keeps_dflash_with_carryover_disabled(smollm2, random_drafter):
    config = engine_config(smollm2, carryover(random_drafter, carryover=False))
    assert config.speculative_config.method == "dflash"
    assert config.speculative_config.draft_model_config.hf_config.carryover_runtime == {
        "enabled": False, "goodput_k": False, **LOOKUP_OFF}


def test_goodput_k_turns_on_vllms_dynamic_k_and_tells_the_scheduler(smollm2, random_drafter):
    config = engine_config(smollm2, carryover(random_drafter,
                                              num_speculative_tokens_per_batch_size="goodput"))
    spec = config.speculative_config
    assert spec.num_speculative_tokens_per_batch_size == [(1, 1, 4)]
    assert spec.draft_model_config.hf_config.carryover_runtime == {
        "enabled": True, "goodput_k": True, **LOOKUP_OFF}


def test_lookup_drafter_k_reaches_the_workers_with_the_suffix_lookup(smollm2, random_drafter):
    config = engine_config(smollm2, carryover(random_drafter, suffix_lookup=True,
                                              lookup_drafter_k=1))
    assert config.speculative_config.draft_model_config.hf_config.carryover_runtime == {
        "enabled": True, "goodput_k": False, "suffix_lookup": True, "lookup_drafter_k": 1,
        "drafter_gate": True}


def test_suffix_lookup_reaches_the_workers_with_vllms_suffix_keys(smollm2, random_drafter):
    """The suffix_decoding_* keys stay in vLLM's config (the proposer reads them there):
    as given, else vLLM's defaults."""
    config = engine_config(smollm2, carryover(random_drafter, suffix_lookup=True,
                                              suffix_decoding_max_tree_depth=16))
    spec = config.speculative_config
    assert spec.draft_model_config.hf_config.carryover_runtime == {
        "enabled": True, "goodput_k": False, **LOOKUP_OFF, "suffix_lookup": True}
    assert spec.suffix_decoding_max_tree_depth == 16
    assert (spec.suffix_decoding_max_cached_requests, spec.suffix_decoding_max_spec_factor,
            spec.suffix_decoding_min_token_prob) == (10000, 1.0, 0.1)


def test_wrong_type_for_a_vllm_key_is_refused_in_one_line(smollm2, random_drafter):
    expected = BAD_INPUTS["wrong_type_vllm"].expected[0]
    with pytest.raises(CarryoverConfigError) as info:
        engine_config(smollm2, carryover(random_drafter, max_model_len="x"))
    assert str(info.value).startswith(expected)
    assert str(info.value).endswith("(got 'x')")
    assert "\n" not in str(info.value)


def test_engine_config_refuses_what_the_validator_refuses(smollm2, random_drafter):
    with pytest.raises(CarryoverConfigError, match=r"unknown key\(s\) \['bogus'\]"):
        engine_config(smollm2, carryover(random_drafter, bogus=1))


def test_drafter_shorter_than_the_serving_length_is_warned_about_at_startup(
        smollm2, random_drafter, tmp_path, monkeypatch):
    from vllm_carryover import config as sc

    short = Path(shutil.copytree(random_drafter, tmp_path / "short"))
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 512}))
    warned: list[str] = []
    monkeypatch.setattr(sc.logger, "warning", lambda fmt, *args: warned.append(fmt % args))
    engine_config(smollm2, carryover(random_drafter))
    assert warned == []
    engine_config(smollm2, carryover(short))
    assert len(warned) == 1
    assert "length limit (512 tokens" in warned[0] and "max_model_len (1024)" in warned[0]
    assert "--max-model-len 512" in warned[0]


# -- the CLI exception hook --------------------------------------------------------------


@pytest.fixture
def cli_process(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Pretend to be `vllm serve` with a recording excepthook; returns what it records."""
    seen: list[tuple[Any, ...]] = []
    monkeypatch.setattr(sys, "argv", ["/usr/bin/vllm", "serve", "model"])
    monkeypatch.setattr(sys, "excepthook", lambda *exc: seen.append(exc))
    return seen


def test_cli_hook_turns_carryover_error_into_one_line_and_exit_2(cli_process, capsys):
    user_experience._install_cli_excepthook()
    with pytest.raises(SystemExit) as info:
        sys.excepthook(CarryoverConfigError, CarryoverConfigError("bad\ndrafter"), None)
    assert info.value.code == 2
    assert capsys.readouterr().err == "vllm serve: error: bad drafter\n"
    assert cli_process == []


def test_cli_hook_leaves_other_exceptions_to_the_previous_hook(cli_process, capsys):
    user_experience._install_cli_excepthook()
    error = RuntimeError("not ours")
    sys.excepthook(RuntimeError, error, None)
    assert cli_process == [(RuntimeError, error, None)]
    assert capsys.readouterr().err == ""


def test_cli_hook_is_not_installed_for_library_users(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/usr/bin/python", "my_script.py"])
    hook = sys.excepthook
    user_experience._install_cli_excepthook()
    assert sys.excepthook is hook


# -- the real CLI ------------------------------------------------------------------------

CLI_TIMEOUT_S = 240
CLI_WORKERS = 3


@dataclass(frozen=True)
class CliRun:
    """What one `vllm serve` run left behind."""

    returncode: int | None
    seconds: float
    stdout: str
    stderr: str
    port_open: bool
    survivors: list[str]


def port_is_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def group_members(pgid: int) -> list[str]:
    """Live processes of process group `pgid`, as "pid name"."""
    members = []
    for proc in psutil.process_iter(["pid", "name"]):
        try:
            if os.getpgid(proc.info["pid"]) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(f"{proc.info['pid']} {proc.info['name']}")
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def run_vllm_serve(target: Path, spec_arg: str, log_dir: Path) -> CliRun:
    """Run `vllm serve` in its own session until it exits (or CLI_TIMEOUT_S passes)."""
    # the package's server command (not started through VllmServer: this run is meant
    # to exit at startup, with its stdout and stderr kept apart)
    server = VllmServer(target, log_dir / "server.log", dtype="float32", max_model_len=1024,
                        kv_cache_bytes=KV_CACHE_BYTES,
                        extra_args=["--speculative-config", spec_arg])
    port, command = server.port, server.cmd
    out_file, err_file = log_dir / "stdout.log", log_dir / "stderr.log"
    with out_file.open("wb") as out, err_file.open("wb") as err:
        started = time.monotonic()
        proc = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            returncode: int | None = proc.wait(timeout=CLI_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            returncode = None
        seconds = time.monotonic() - started
    port_open = port_is_open(port)
    survivors = group_members(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return CliRun(returncode, seconds, out_file.read_text(errors="replace"),
                  err_file.read_text(errors="replace"), port_open, survivors)


@pytest.fixture(scope="module")
def cli_runs(smollm2: Path, random_drafter: Path,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, CliRun]:
    """Every CLI case, CLI_WORKERS at a time: each run spends ~15 s importing vLLM."""
    root = tmp_path_factory.mktemp("bad_cli")
    args: dict[str, tuple[str, Path]] = {}
    for name in CLI_CASES:
        case_dir = root / name
        case_dir.mkdir()
        spec = make_bad_input(BAD_INPUTS[name], random_drafter, case_dir)
        args[name] = (spec if isinstance(spec, str) else json.dumps(spec), case_dir)
    started = time.monotonic()
    with ThreadPoolExecutor(CLI_WORKERS) as pool:
        futures = {name: pool.submit(run_vllm_serve, smollm2, spec_arg, case_dir)
                   for name, (spec_arg, case_dir) in args.items()}
        runs = {name: future.result() for name, future in futures.items()}
    timings = ", ".join(f"{name} {run.seconds:.0f}s" for name, run in runs.items())
    print(f"\n{len(runs)} vllm serve runs in {time.monotonic() - started:.0f} s "
          f"({CLI_WORKERS} at a time): {timings}")
    return runs


@pytest.mark.parametrize("case", CLI_CASES)
def test_vllm_serve_stops_at_startup_with_a_one_line_cause(cli_runs, case):
    run = cli_runs[case]
    expected, *more = BAD_INPUTS[case].expected
    output = run.stdout + run.stderr
    assert run.returncode is not None, f"still running after {CLI_TIMEOUT_S} s:\n{output}"
    assert run.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    stderr_lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert stderr_lines, output[-3000:]
    assert stderr_lines[-1].startswith("vllm serve: error: "), run.stderr[-3000:]
    assert all(words in stderr_lines[-1] for words in (expected, *more)), run.stderr[-3000:]
    assert sum(expected in line for line in output.splitlines()) == 1, output[-3000:]
    assert not run.port_open
    assert run.survivors == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
