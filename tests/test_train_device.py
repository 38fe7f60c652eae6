"""`--device`, `--dtype` and `--target-states` of the training recipes, on the CPU and CUDA.

Online target states (the target inside the training loop) must be the tensors
the state cache gives back for the same sequences, and short runs on the default
device must train: online and under bfloat16 autocast. On a machine with CUDA
(`scripts/gpu_checks.sh` on a lent GPU), both recipes also run there and must take the
CPU's steps; NCCL is not run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from support.tiny_models import make_tiny_drafter, make_tiny_target, write_random_dataset
from test_train_loop import DATA, recipe_argv
from vllm_carryover.train import state_cache, target_states
from vllm_carryover.train.baseline import Sequence, sequence_feed
from vllm_carryover.train.device import placement, resolve_device
from vllm_carryover.train.main import main
from vllm_carryover.train.paths import run_dir
from vllm_carryover.train.state_cache import StateCache

from vllm_carryover.drafter.format import default_target_layers
from vllm_carryover.dtype import cpu_has_native_bf16, fastest_dtype

LAYERS = default_target_layers(4)  # make_tiny_target has 4 layers


def test_auto_is_the_local_rank_gpu_else_the_cpu_in_bf16_where_native(
        monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():  # the CPU, in bf16 only where its matmuls are native
        assert resolve_device("auto") == torch.device("cpu")
        native = cpu_has_native_bf16()
        assert placement().dtype == (torch.bfloat16 if native else torch.float32)
        with pytest.raises(SystemExit, match="no CUDA device"):
            resolve_device("cuda")
    monkeypatch.setattr("vllm_carryover.train.device.cpu_has_native_bf16", lambda: False)
    assert placement("cpu").dtype == torch.float32  # an AVX2-only CPU: bf16 is emulated
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")  # as torchrun sets it for its second process
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert placement().dtype == torch.bfloat16
    assert placement("cuda", "float32").dtype == torch.float32
    assert placement("cpu", "bfloat16").dtype == torch.bfloat16


def test_cached_states_are_the_online_tensors(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipes' feed over the state cache: the first visit computes a sequence's
    states and stores them, and what the cache gives back (reopened from disk) is the
    online tensor bit for bit, in the fastest dtype on the default device. A put cut off
    before its flag leaves the row unfilled; another layout starts an empty cache."""
    target = str(make_tiny_target(tmp_path / "target"))
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 512, (int(n),), generator=gen).tolist()
            for n in torch.randint(6, 40, (6,), generator=gen)]
    decoder = target_states.truncated_decoder(target, max(LAYERS),
                                              getattr(torch, fastest_dtype()))
    place = placement(str(torch.get_default_device()))
    lengths, feature, folder = [len(s) for s in seqs], 128 * len(LAYERS), tmp_path / "states"
    cache = StateCache.open(folder, lengths, feature, LAYERS, decoder.dtype)
    online, cached = sequence_feed(place, LAYERS, decoder), sequence_feed(
        place, LAYERS, decoder, cache)
    first = [cached(Sequence(torch.tensor(s), 0, None, row=i)).aux for i, s in enumerate(seqs)]
    reopened = StateCache.open(folder, lengths, feature, LAYERS, decoder.dtype)
    assert reopened.complete()
    batched = target_states.stored_states(decoder, seqs, LAYERS)
    for i, (s, in_batch) in enumerate(zip(seqs, batched, strict=True)):
        want = online(Sequence(torch.tensor(s), 0, None)).aux
        assert want.dtype == torch.bfloat16 and not want.is_inference()
        assert torch.equal(first[i], want)
        assert torch.equal(reopened.get(i), want.cpu())
        # a padded batch changes the matmul shapes and so the rounding: in float32 compute
        # in the last bits (one bf16 step once stored); in bf16 compute (the fastest dtype
        # on a CPU with AMX) in bf16's own rounding of the sums, one bf16 step at the
        # states' scale; a padding leak would move them by their whole size
        scale = 1e-6 if decoder.dtype == torch.float32 else 2 ** -7 * float(
            in_batch.float().abs().max())
        torch.testing.assert_close(want, in_batch, rtol=2 ** -7, atol=scale)

    fresh = StateCache.open(folder, lengths, feature, LAYERS, torch.float64)  # another key
    assert fresh.filled() == 0 and fresh.get(0) is None

    def killed(fd: int) -> None:
        raise KeyboardInterrupt  # the run stops after the rows, before their flag

    with monkeypatch.context() as mp:
        mp.setattr(state_cache.os, "fdatasync", killed)
        with pytest.raises(KeyboardInterrupt):
            fresh.put(0, first[0].cpu())
    assert fresh.get(0) is None
    fresh.put(0, first[0].cpu())
    assert torch.equal(fresh.get(0), first[0].cpu()) and fresh.filled() == 1
    with pytest.raises(ValueError, match="bf16 states of shape"):
        fresh.put(1, first[1].float())


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("train_device")
    target = make_tiny_target(tmp / "target")
    drafter = make_tiny_drafter(target, tmp / "drafter", block_size=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CARRYOVER_CACHE", str(tmp / "cache"))
        write_random_dataset(target, DATA)
    return {"target": target, "drafter": drafter, "cache": tmp / "cache"}


@pytest.mark.parametrize(("recipe", "extra"), [
    ("baseline", ["--target-states", "online"]),
    ("baseline", ["--dtype", "bfloat16"]),
    ("carryover", ["--target-states", "online", "--dtype", "bfloat16"]),
], ids=["baseline-online", "baseline-bf16", "carryover-online-bf16"])
def test_short_run_on_the_default_device_trains(tiny_setup: dict[str, Path],
                                                monkeypatch: pytest.MonkeyPatch,
                                                recipe: str, extra: list[str]) -> None:
    monkeypatch.setenv("VLLM_CARRYOVER_CACHE", str(tiny_setup["cache"]))
    if "online" in extra:  # the state cache is never opened

        def no_cache(*args: Any) -> None:
            raise AssertionError("online training opened the state cache")

        monkeypatch.setattr(StateCache, "open", no_cache)
    run = f"{recipe}-{'-'.join(x.strip('-') for x in extra)}"
    main(recipe_argv(recipe, tiny_setup, run, "--steps", "2", "--eval-every", "0",
                     "--device", str(torch.get_default_device()), *extra))
    steps = [json.loads(x) for x in (run_dir(run) / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in steps] == [0, 1]
    assert all(math.isfinite(x["loss"]) for x in steps)
    final = torch.load(run_dir(run) / "final.pt")
    assert final["meta"]["steps"] == 2
    assert all(v.device.type == "cpu" and v.isfinite().all() for v in final["state"].values())


def test_auto_target_states_cache_what_fits_on_disk_and_compute_the_rest_online(
        tiny_setup: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`--target-states auto`: a dataset whose bf16 states fit on the disk under the cache
    folder, a margin kept free, is cached; one whose states would not (smollm2-mix-v2's
    23.6 GiB beside a nearly full disk) runs the target online; an explicit choice
    stands."""
    from vllm_carryover.train.paths import data_dir

    monkeypatch.setenv("VLLM_CARRYOVER_CACHE", str(tiny_setup["cache"]))
    folder, feature = data_dir(DATA), 128 * len(LAYERS)

    def cache(mode: str) -> StateCache | None:
        return state_cache.dataset_cache(mode, folder, LAYERS, feature, torch.float32)

    assert state_cache.states_gib(folder, feature) < 0.01
    assert isinstance(cache("auto"), StateCache)
    assert "target states: cached" in capsys.readouterr().out
    assert cache("online") is None
    monkeypatch.setattr(state_cache, "states_gib", lambda data, size: 1e6)
    assert cache("auto") is None
    assert "target states: online" in capsys.readouterr().out
    assert isinstance(cache("cached"), StateCache)
    monkeypatch.undo()
    monkeypatch.setenv("VLLM_CARRYOVER_CACHE", str(tiny_setup["cache"]))
    monkeypatch.setattr(state_cache, "disk_room_gib", lambda folder: 1e-6)
    assert cache("auto") is None


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (scripts/gpu_checks.sh runs it)")


def run_losses(setup: dict[str, Path], recipe: str, run: str, *extra: str) -> list[float]:
    """The per-step training losses of a 12-step run of `recipe` at a learning rate high
    enough for the loss to fall within it, evaluation off."""
    main(recipe_argv(recipe, setup, run, "--steps", "12", "--lr", "1e-2", "--eval-every", "0",
                     "--save-every", "0", *extra))
    lines = (run_dir(run) / "log.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in lines]


@needs_cuda
@pytest.mark.parametrize("recipe", ["baseline", "carryover"])
def test_a_float32_run_on_cuda_takes_the_cpu_runs_steps_and_its_loss_falls(
        tiny_setup: dict[str, Path], monkeypatch: pytest.MonkeyPatch, recipe: str) -> None:
    """Every random choice of the recipes (sequences, anchors, negatives) comes from seeded
    CPU generators and the drafter is initialised on the CPU, so a float32 run on the GPU
    takes the CPU run's steps: its losses differ only by float32 rounding. bf16 autocast,
    the GPU default, must train too."""
    monkeypatch.setenv("VLLM_CARRYOVER_CACHE", str(tiny_setup["cache"]))
    cpu = run_losses(tiny_setup, recipe, f"{recipe}-cpu-fp32", "--device", "cpu",
                     "--dtype", "float32")
    cuda = run_losses(tiny_setup, recipe, f"{recipe}-cuda-fp32", "--device", "cuda",
                      "--dtype", "float32")
    torch.testing.assert_close(cuda, cpu, rtol=1e-3, atol=1e-4)
    bf16 = run_losses(tiny_setup, recipe, f"{recipe}-cuda-bf16", "--device", "cuda",
                      "--dtype", "bfloat16", "--target-states", "online")
    for losses in (cpu, bf16):
        assert all(math.isfinite(x) for x in losses)
        assert sum(losses[-3:]) < sum(losses[:3]), losses
