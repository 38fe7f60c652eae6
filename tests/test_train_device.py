"""`--device`, `--dtype` and `--target-states` of the training recipes, on the CPU and CUDA.

Online target states (the target inside the training loop) must be the tensors
the state cache holds for the same sequences, and short runs on the default
device must train: online, under bfloat16 autocast, and distilling the target's
own distribution (`--distill`). On a machine with CUDA (`scripts/gpu_checks.sh` on a
lent GPU), both recipes also run there and must take the CPU's steps; NCCL is not run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train_loop import DATA, recipe_argv, write_tiny_dataset
from tiny_models import make_tiny_drafter, make_tiny_target
from vllm_carryover.train import baseline, target_states
from vllm_carryover.train.baseline import Sequence, sequence_feed
from vllm_carryover.train.device import placement, resolve_device
from vllm_carryover.train.dflash_loss import IGNORE, block_teacher_logits, weighted_block_ce
from vllm_carryover.train.main import main
from vllm_carryover.train.paths import run_dir

from vllm_carryover.drafter_format import default_target_layers
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


def test_online_states_are_the_cached_tensors(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache through `extract` (its Ray map run in-process), the online states through
    the recipes' feed, the target in the cache's dtype on the CPU."""
    target = str(make_tiny_target(tmp_path / "target"))
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 512, (int(n),), generator=gen).tolist()
            for n in torch.randint(6, 40, (6,), generator=gen)]

    def in_process(fn: Any, items: list[Any], *, workers: int, cpus_per_worker: int,
                   address: str | None, desc: str, **kwargs: Any) -> list[Any]:
        return fn(items, **kwargs)

    monkeypatch.setattr(target_states, "map_shards", in_process)
    alone = target_states.extract(target, seqs, LAYERS, tmp_path / "alone.pt", batch_size=1)
    batched = target_states.extract(target, seqs, LAYERS, tmp_path / "batched.pt")
    decoder = target_states.truncated_decoder(target, max(LAYERS),
                                              getattr(torch, fastest_dtype()))
    feed = sequence_feed(placement(str(torch.get_default_device())), LAYERS, decoder)
    for s, one, in_batch in zip(seqs, alone, batched, strict=True):
        online = feed(Sequence(torch.tensor(s), 0, None)).aux
        assert online.dtype == torch.bfloat16 and not online.is_inference()
        assert torch.equal(online, one)
        # a padded batch changes the matmul shapes and so the rounding: in float32 compute
        # in the last bits (one bf16 step once stored); in bf16 compute (the fastest dtype
        # on a CPU with AMX) in bf16's own rounding of the sums, one bf16 step at the
        # states' scale; a padding leak would move them by their whole size
        scale = 1e-6 if decoder.dtype == torch.float32 else 2 ** -7 * float(
            in_batch.float().abs().max())
        torch.testing.assert_close(online, in_batch, rtol=2 ** -7, atol=scale)


def test_distill_teacher_is_the_targets_next_token_distribution(tmp_path: Path) -> None:
    """The whole decoder gives the truncated one's aux states and a final state whose
    product with the LM head is the target's logits; block slot j at anchor a is taught
    by the target's logits at a + j - 1, the position that predicts the slot's token."""
    from transformers import AutoModelForCausalLM

    target = str(make_tiny_target(tmp_path / "target"))
    tokens = torch.randint(1, 512, (20,), generator=torch.Generator().manual_seed(0))
    truncated = target_states.truncated_decoder(target, max(LAYERS))
    aux, final = target_states.states_and_final(target_states.truncated_decoder(target, None),
                                                tokens.tolist(), LAYERS)
    assert torch.equal(aux, target_states.stored_states(truncated, [tokens.tolist()], LAYERS)[0])
    lm = AutoModelForCausalLM.from_pretrained(target).eval()
    with torch.no_grad():
        want = lm(tokens[None]).logits[0]
    head = lm.lm_head.weight.detach()
    anchors = torch.tensor([3, 10, 18])
    taught = block_teacher_logits(final, anchors, 3, head)
    torch.testing.assert_close(taught[1, 2], final[12].float() @ head.T)
    torch.testing.assert_close(taught[1], want[10:13], rtol=0.02, atol=0.02)  # bf16 state
    torch.testing.assert_close(taught[2, 2], taught[2, 1])  # past the end: clamped


def test_distill_one_with_a_certain_teacher_is_the_label_loss() -> None:
    """--distill 1 replaces the labels by the teacher's distribution: a teacher sure of
    the label gives the labels' loss; a teacher unsure of it gives a larger one."""
    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(5, 3, 40, generator=gen), torch.randint(40, (5, 3), generator=gen)
    labels[4, 2] = IGNORE
    slots = torch.tensor([1.0, 0.5, 0.25])
    sure = 1e4 * torch.nn.functional.one_hot(labels.clamp(min=0), 40).float()
    hard = weighted_block_ce(logits, labels, slots)[0]
    torch.testing.assert_close(weighted_block_ce(logits, labels, slots, None, sure, 1.0)[0], hard)
    unsure = torch.zeros(5, 3, 40)
    assert weighted_block_ce(logits, labels, slots, None, unsure, 1.0)[0] > hard
    assert torch.equal(weighted_block_ce(logits, labels, slots, None, unsure, 0.0)[0], hard)


def test_distill_refuses_cached_target_states(tiny_setup: dict[str, Path],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CARRYOVER_CACHE", str(tiny_setup["cache"]))
    with pytest.raises(SystemExit, match="drop --target-states cached"):
        main(recipe_argv("baseline", tiny_setup, "distill-cached", "--distill", "1",
                         "--target-states", "cached"))


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("train_device")
    target = make_tiny_target(tmp / "target")
    drafter = make_tiny_drafter(target, tmp / "drafter", block_size=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CARRYOVER_CACHE", str(tmp / "cache"))
        write_tiny_dataset(target, LAYERS)
    return {"target": target, "drafter": drafter, "cache": tmp / "cache"}


@pytest.mark.parametrize(("recipe", "extra"), [
    ("baseline", ["--target-states", "online"]),
    ("baseline", ["--dtype", "bfloat16"]),
    ("carryover", ["--target-states", "online", "--dtype", "bfloat16"]),
    ("baseline", ["--distill", "0.5"]),
], ids=["baseline-online", "baseline-bf16", "carryover-online-bf16", "baseline-distill"])
def test_short_run_on_the_default_device_trains(tiny_setup: dict[str, Path],
                                                monkeypatch: pytest.MonkeyPatch,
                                                recipe: str, extra: list[str]) -> None:
    monkeypatch.setenv("VLLM_CARRYOVER_CACHE", str(tiny_setup["cache"]))
    if "online" in extra or "--distill" in extra:  # the state cache is never read

        def no_cache(*args: Any) -> None:
            raise AssertionError("online training read the state cache")

        monkeypatch.setattr(baseline, "dataset_states", no_cache)
    run = f"{recipe}-{'-'.join(x.strip('-') for x in extra)}"
    main(recipe_argv(recipe, tiny_setup, run, "--steps", "2", "--eval-every", "0",
                     "--device", str(torch.get_default_device()), *extra))
    steps = [json.loads(x) for x in (run_dir(run) / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in steps] == [0, 1]
    assert all(math.isfinite(x["loss"]) for x in steps)
    final = torch.load(run_dir(run) / "final.pt")
    assert final["meta"]["steps"] == 2
    assert all(v.device.type == "cpu" and v.isfinite().all() for v in final["state"].values())


def test_auto_target_states_cache_what_fits_and_compute_the_rest_online(
        tiny_setup: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`--target-states auto`: a dataset whose bf16 states take a sliver of memory is
    cached; one whose states would take over a quarter of it (a 3M-token dataset on a
    24 GB machine) runs the target online; an explicit choice stands."""
    from vllm_carryover.train.paths import data_dir

    monkeypatch.setenv("VLLM_CARRYOVER_CACHE", str(tiny_setup["cache"]))
    folder, feature = data_dir(DATA), 3 * 64
    assert target_states.states_gib(folder, feature) < 0.01
    assert target_states.resolve_mode("auto", folder, feature) == "cached"
    assert "target states: cached" in capsys.readouterr().out
    monkeypatch.setattr(target_states, "states_gib", lambda data, size: 1e6)
    assert target_states.resolve_mode("auto", folder, feature) == "online"
    assert target_states.resolve_mode("cached", folder, feature) == "cached"


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
