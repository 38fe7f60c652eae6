"""`train carryover --init` and `train baseline --init-run` start from a public DFlash
drafter named by its Hugging Face hub id, resolved as serving resolves one.

The drafter is a tiny random one in the layout public DFlash drafters are published in
(more layers than ours, block 16, its own target layers and mask token), put in an
offline huggingface_hub cache. The runs go through `python -m train` (in-process) for a
few CPU steps on a tiny Llama target.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.checkpoint_layouts import hub_cache_layout, public_dflash_drafter
from support.tiny_models import make_tiny_target, write_random_dataset
from vllm_carryover.train.main import main
from vllm_carryover.train.paths import run_dir

from vllm_carryover.drafter.checkpoint import load_drafter_state
from vllm_carryover.drafter.format import REJECTED_EMBEDDING, DrafterConfig

PUBLIC = "carryover-tests/public-dflash"
DATA = "tiny-public"
# the public drafter's shape: none of it is what our recipes would pick for the target
LAYERS, BLOCK, TARGET_LAYERS, MASK = 3, 16, [0, 2], 511


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny target, a dataset for it in the cache, and a public-layout drafter for it."""
    tmp = tmp_path_factory.mktemp("public_drafter")
    target = make_tiny_target(tmp / "target")
    public = public_dflash_drafter(target, tmp / "public", num_layers=LAYERS,
                                   block_size=BLOCK, target_layer_ids=TARGET_LAYERS,
                                   mask_token_id=MASK)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CARRYOVER_CACHE", str(tmp / "cache"))
        write_random_dataset(target, DATA)
    return {"target": target, "public": public, "cache": tmp / "cache"}


@pytest.fixture
def hub(setup: dict[str, Path], offline_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The public drafter as `hf download` leaves it in the offline hub cache."""
    monkeypatch.setenv("VLLM_CARRYOVER_CACHE", str(setup["cache"]))
    return hub_cache_layout(offline_cache, PUBLIC, setup["public"])


def argv(recipe: str, target: Path, run: str, *extra: str) -> list[str]:
    """Three tiny CPU steps of `recipe`."""
    return [recipe, "--target", str(target), "--data", DATA, "--run-name", run,
            "--steps", "3", "--seqs-per-step", "2", "--anchors-per-seq", "4",
            "--eval-every", "0", "--eval-anchors-per-seq", "2", "--num-negatives", "32",
            "--threads", "1", "--device", "cpu", "--dtype", "float32", *extra]


def assert_public_shape(saved: dict) -> None:
    """A run's final.pt keeps the public drafter's depth, block size, target layers and
    mask token."""
    d = DrafterConfig.from_dict(saved["config"])
    assert (d.num_hidden_layers, d.block_size) == (LAYERS, BLOCK)
    assert (list(d.target_layer_ids), d.mask_token_id) == (TARGET_LAYERS, MASK)
    assert f"layers.{LAYERS - 1}.mlp.down_proj.weight" in saved["state"]


def test_carryover_init_from_a_hub_id_trains_the_public_drafter_with_a_rejected_embedding(
        setup: dict[str, Path], hub: Path) -> None:
    main(argv("carryover", setup["target"], "carryover-from-hub", "--init", PUBLIC))
    saved = torch.load(run_dir("carryover-from-hub") / "final.pt")
    assert_public_shape(saved)
    assert saved["meta"]["init_checkpoint"] == PUBLIC
    rejected = saved["state"][REJECTED_EMBEDDING]
    # added at a context row's scale (an RMS-normed row's norm is its weight's), then trained
    context_norm = float(saved["state"]["hidden_norm.weight"].norm())
    assert rejected.shape == (128,) and 0.5 < float(rejected.norm()) / context_norm < 2
    # the public weights, moved by three small steps: not a new random drafter
    _, public = load_drafter_state(hub, fill_rejected=False)
    for name, weight in public.items():
        assert torch.allclose(saved["state"][name], weight.float(), atol=1e-2), name


def test_baseline_init_run_from_a_hub_id_keeps_the_public_drafters_config(
        setup: dict[str, Path], hub: Path) -> None:
    # the recipe's own defaults (--layers 1, --block-size 8) would make another drafter
    main(argv("baseline", setup["target"], "baseline-from-hub", "--init-run", PUBLIC))
    saved = torch.load(run_dir("baseline-from-hub") / "final.pt")
    assert_public_shape(saved)
    assert REJECTED_EMBEDDING not in saved["state"]  # still a plain DFlash drafter
    assert saved["meta"]["continued_from"] == [PUBLIC]


@pytest.mark.parametrize("recipe, flag", [("carryover", "--init"), ("baseline", "--init-run")])
@pytest.mark.parametrize("value, message", [
    ("carryover-tests/no-such-drafter",
     "no finished run of that name in the cache .*, and as a hub id: drafter "
     "carryover-tests/no-such-drafter is not a local folder .*`hf download "
     "carryover-tests/no-such-drafter`"),
    ("no-such-run", "no such folder, no finished run of that name in the cache .*, and no "
     "Hugging Face hub id"),
])
def test_init_naming_no_drafter_is_refused_before_the_target_is_read(
        setup: dict[str, Path], hub: Path, tmp_path: Path, recipe: str, flag: str, value: str,
        message: str) -> None:
    # the target folder does not exist: reading anything of it would fail otherwise
    run = f"{recipe}-refused"
    with pytest.raises(SystemExit, match=f"^{flag} {value}: {message}") as refused:
        main(argv(recipe, tmp_path / "no-target", run, flag, value))
    assert "\n" not in str(refused.value)
    assert not run_dir(run).exists()


def test_public_drafter_for_another_target_is_refused_naming_the_mismatch(
        setup: dict[str, Path], offline_cache: Path, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    monkeypatch.setenv("VLLM_CARRYOVER_CACHE", str(setup["cache"]))
    deeper = public_dflash_drafter(setup["target"], tmp_path / "deeper", num_layers=LAYERS,
                                   block_size=BLOCK, target_layer_ids=[1, 30],
                                   mask_token_id=MASK)  # reads layers a 4-layer target lacks
    hub_cache_layout(offline_cache, "carryover-tests/deeper-target", deeper)
    with pytest.raises(SystemExit, match=r"^--init carryover-tests/deeper-target: drafter .* "
                       r"reads target layers \[30\], outside 0..2 of a 4-layer target"):
        main(argv("carryover", setup["target"], "refused", "--init",
                  "carryover-tests/deeper-target"))
    assert not run_dir("refused").exists()
