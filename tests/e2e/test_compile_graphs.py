"""End to end: ``--torch_compile`` compiles the U-Net once for a whole run (issue 22, item 6).

The run has everything that used to recompile it: two datasets, three bucket shapes (latents 16x16, 16x24, 24x16), two
``network_multiplier`` values, validation (eval mode, ``no_grad``), sample images and module dropout (a host draw
and an ``if`` per LoRA module: a graph break in each). Dynamo's own count of the graphs it compiled
(``counters["stats"]["unique_graphs"]``, every graph break adds graphs) must be 1, with no graph break; the issue's
bound is one graph per bucket shape, here 3. ``--dynamo_backend eager`` runs dynamo's tracing and guards without
generating code. mkldnn is off for the run: on the CPU, convolution picks mkldnn above an input size, and that
choice is a shape guard of its own (a second graph once a bucket crosses it), which CUDA's convolutions do not have.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

import train_network
from library.config import PrecisionConfig
from library.families import model_setup
from library.train import validation
from tests.e2e.test_train_network import SAMPLES, train_args

PROMPTS = "a red square --w 64 --h 64 --d 1 --s 2\n"


def dataset_toml(folder: Path) -> str:
    """Two datasets of the same 8 images (96x64, 64x96, 64x64), 2 of each held out, batch size 1 (so that only
    the bucket shape changes): bucketed at 128x128 (latents 16x16) with multiplier 1, and at 192x128 / 128x192
    (latents 16x24, 24x16) with multiplier 0.5. Latents under 16 would leave a 1x1 map at the tiny U-Net's
    deepest block, which dynamo specializes (real buckets are far larger)."""
    def dataset(resolution: str, top: int, multiplier: float) -> str:
        return (f"[[datasets]]\nresolution = {resolution}\nenable_bucket = true\nmin_bucket_reso = 128\n"
                f"max_bucket_reso = {top}\nbatch_size = 1\nnetwork_multiplier = {multiplier}\n"
                f"[[datasets.subsets]]\nimage_dir = \"{folder.as_posix()}\"\nnum_repeats = 1\n")

    general = "[general]\ncaption_extension = \".txt\"\nvalidation_split = 0.25\n"
    return "\n".join((general, dataset("128", 128, 1.0), dataset("[192, 128]", 192, 0.5)))


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    (root / "dataset.toml").write_text(dataset_toml(SAMPLES / "10_shapes"), encoding="utf-8")
    (root / "prompts.txt").write_text(PROMPTS, encoding="utf-8")
    args = train_args(root / "out", "--dataset_config", str(root / "dataset.toml"), "--cache_latents",
                      "--torch_compile", "--dynamo_backend", "eager", "--network_args", "module_dropout=0.1",
                      "--max_train_steps", "12", "--validate_every_n_steps", "6",
                      "--sample_prompts", str(root / "prompts.txt"), "--sample_every_n_steps", "6")
    shapes, validations = set(), []
    marking, validating = model_setup.mark_bucket_dims, validation.Validation.run

    def recording(module, args, kwargs):
        shapes.add(tuple(args[0].shape[2:]))
        return marking(module, args, kwargs)

    def counting(self):
        validations.append(validating(self))
        return validations[-1]

    torch._dynamo.reset()
    counters.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.backends.mkldnn, "enabled", False)
        patch.setattr(model_setup, "mark_bucket_dims", recording)
        patch.setattr(validation.Validation, "run", counting)
        assert train_network.main(args) == 0
    return SimpleNamespace(out=root / "out", graphs=counters["stats"]["unique_graphs"], shapes=shapes,
                           breaks=sum(counters["graph_break"].values()), validations=validations)


def test_the_unet_compiles_once_for_three_buckets_validation_samples_and_dropout(compiled_run):
    assert compiled_run.shapes == {(16, 16), (16, 24), (24, 16)}
    assert compiled_run.breaks == 0
    assert compiled_run.graphs == 1


def test_the_run_validated_and_sampled(compiled_run):
    assert len(compiled_run.validations) == 3  # steps 6 and 12, the end of the epoch
    assert len(list((compiled_run.out / "sample").glob("*.png"))) == 2  # steps 6 and 12
    assert (compiled_run.out / "lora.safetensors").is_file()


class Recompiling(torch.nn.Module):
    """A module whose integer attribute dynamo guards on: each new value is a recompile."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.step = 0

    def forward(self, sample: torch.Tensor) -> torch.Tensor:
        return self.linear(sample) * self.step


def test_hitting_the_recompile_limit_is_one_warning_naming_torch_compile(caplog):
    model = SimpleNamespace(unet=Recompiling())
    # torch's own patch: its undo restores the limit (monkeypatch's undo leaves dynamo's config broken)
    with torch._dynamo.config.patch(recompile_limit=2):
        model_setup.compile_unet(model, PrecisionConfig(torch_compile=True, dynamo_backend="eager"), "UNet",
                                 bucket_shapes=1)
        model_setup.watch_recompile_limit().warned = False
        with caplog.at_level(logging.WARNING, logger="library.families.model_setup"):
            for step in range(5):
                model.unet._orig_mod.step = step
                model.unet(torch.randn(2, 3, 8, 4))
    ours = [r.getMessage() for r in caplog.records if r.name == "library.families.model_setup"]
    assert len(ours) == 1
    assert ours[0].startswith("--torch_compile: dynamo hit torch._dynamo.config.recompile_limit (2)")


class Pooling(torch.nn.Module):
    """A stand-in denoiser whose output follows the latents' size."""

    def forward(self, sample: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.avg_pool2d(sample, 2) * 2


@pytest.mark.parametrize(("bucket_shapes", "graphs"), [(1, 2), (3, 1)])
def test_only_a_run_of_several_bucket_shapes_compiles_them_dynamic(bucket_shapes, graphs):
    """One bucket: dynamo traces the static shape (a second shape, which such a run never has, would compile again);
    several: the first graph already has symbolic height and width and serves the second shape too."""
    model = SimpleNamespace(unet=Pooling())
    torch._dynamo.reset()
    counters.clear()
    model_setup.compile_unet(model, PrecisionConfig(torch_compile=True, dynamo_backend="eager"), "UNet",
                             bucket_shapes=bucket_shapes)
    for height, width in ((8, 8), (8, 12)):
        out = model.unet(torch.ones(1, 4, height, width))
        assert out.shape == (1, 4, height // 2, width // 2)
    assert counters["stats"]["unique_graphs"] == graphs
