"""Steps, epochs, metadata and the LR schedule of an N-process run, against sd-scripts 48d368fa.

The expected values are sd-scripts' formulas written here from ``train_network.py`` (``max_train_steps`` from
``--max_train_epochs`` with the unsharded loader, epochs and ``ss_num_batches_per_epoch`` from the loader accelerate
has sharded, ``total_batch_size``) and ``train_util.get_scheduler_fix`` (``num_training_steps = max_train_steps *
num_processes``), with accelerate's own ``BatchSamplerShard`` for the sharded loader's length and transformers'
schedules stepped ``num_processes`` times per update, as accelerate's ``AcceleratedScheduler.step`` does.
"""

from __future__ import annotations

import math

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler

from library.base.errors import UserError
from library.config import OptimizerConfig, ScheduleConfig
from library.families.sd.family import SDFamily
from library.saving.metadata import training_metadata
from library.train import optimizer_setup
from library.train.accumulation import build_accumulation
from library.train.steps import plan_steps
from library.train.update import make_updater
from tests.config_helpers import parse_args

GRID = [(images, batch, accumulation, processes)
        for images in (1, 5, 8, 13) for batch in (1, 2, 3) for accumulation in (1, 2, 4)
        for processes in (1, 2, 3, 8)]


def upstream(images: int, batch: int, accumulation: int, processes: int, epochs: int | None, steps: int) -> dict:
    batches = math.ceil(images / batch)  # one bucket: a dataset item is a batch
    sharded = len(BatchSamplerShard(BatchSampler(range(batches), batch_size=1, drop_last=False),
                                    num_processes=processes, process_index=0, split_batches=False,
                                    even_batches=True))  # len(train_dataloader) after accelerator.prepare
    if epochs is not None:
        steps = epochs * math.ceil(batches / processes / accumulation)
    updates_per_epoch = math.ceil(sharded / accumulation)
    return {"batches": sharded, "steps": steps, "updates_per_epoch": updates_per_epoch,
            "epochs": math.ceil(steps / updates_per_epoch), "total_batch": batch * processes * accumulation,
            "lr_steps": steps * processes}


@pytest.mark.parametrize("images,batch,accumulation,processes", GRID)
def test_step_arithmetic_is_sd_scripts(images, batch, accumulation, processes):
    for epochs, steps in ((None, 7), (3, 1600)):
        expected = upstream(images, batch, accumulation, processes, epochs, steps)
        if accumulation > expected["batches"]:  # refused here: every update would see only part of a window
            with pytest.raises(UserError, match="--gradient_accumulation_steps"):
                plan_steps(math.ceil(images / batch), batch_size=batch, gradient_accumulation_steps=accumulation,
                           num_processes=processes, max_train_steps=steps, max_train_epochs=epochs)
            continue
        plan = plan_steps(math.ceil(images / batch), batch_size=batch, gradient_accumulation_steps=accumulation,
                          num_processes=processes, max_train_steps=steps, max_train_epochs=epochs)
        assert {"batches": plan.batches_per_process, "steps": plan.max_train_steps,
                "updates_per_epoch": plan.updates_per_epoch, "epochs": plan.num_epochs,
                "total_batch": plan.effective_batch_size, "lr_steps": plan.lr_ticks} == expected


@pytest.mark.parametrize("images,batch,accumulation,processes", [(13, 2, 2, 3), (8, 1, 4, 2), (9, 1, 1, 8)])
def test_metadata_is_what_sd_scripts_writes_for_n_processes(images, batch, accumulation, processes):
    cfg, _ = parse_args(["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--train_data_dir", "x",
                         "--output_dir", "o", "--train_batch_size", str(batch), "--max_train_epochs", "2",
                         "--gradient_accumulation_steps", str(accumulation)])
    plan = plan_steps(math.ceil(images / batch), batch_size=batch, gradient_accumulation_steps=accumulation,
                      num_processes=processes, max_train_epochs=2)
    meta = training_metadata(cfg, plan, SDFamily().model_ids(False, False), seed=1, thumbnail=None,
                             dataset_meta={"ss_batch_size_per_device": "x"}, network_meta={}, optimizer_name="AdamW",
                             stochastic_rounding=False,
                             num_train_images=images, num_reg_images=0, resolution=(64, 64), started=0.0).at_save(
        steps=1, epoch=1)
    expected = upstream(images, batch, accumulation, processes, 2, 0)
    assert meta["ss_num_batches_per_epoch"] == str(expected["batches"])
    assert meta["ss_num_epochs"] == str(expected["epochs"])
    assert meta["ss_max_train_steps"] == str(expected["steps"])
    assert meta["ss_total_batch_size"] == str(expected["total_batch"])
    assert meta["ss_gradient_accumulation_steps"] == str(accumulation)


@pytest.mark.parametrize("name,warmup", [("linear", 4), ("cosine", 3), ("constant_with_warmup", 0.25)])
@pytest.mark.parametrize("processes", [1, 2, 3])
def test_lr_schedule_ticks_once_per_process_and_update(name, warmup, processes):
    """An integer warm-up of W ticks lasts W / N updates; a ratio the same share of the run for any N."""
    from transformers import get_scheduler

    updates = 12
    schedule = ScheduleConfig(max_train_steps=updates, lr_scheduler=name, lr_warmup_steps=warmup)
    choice = optimizer_setup.check_optimizer(OptimizerConfig(optimizer_type="torch.optim.SGD", learning_rate=1.0),
                                             schedule)
    plan = plan_steps(updates * processes, batch_size=1, num_processes=processes, max_train_steps=updates)
    planned = optimizer_setup.plan_schedule(schedule, choice, plan, 1.0)

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    updater = make_updater([param], optimizer, optimizer_setup.build_scheduler(optimizer, planned),
                           build_accumulation(torch.nn.Linear(1, 1), steps=1, network_dtype=torch.float32,
                                              mode="stochastic"), 1, 0.0, 3, scheduler_ticks=plan.num_processes)
    ours = []
    for _ in range(updates):
        ours.append(optimizer.param_groups[0]["lr"])
        updater.backward(param.sum() * 0)
        updater.update()

    reference_param = torch.nn.Parameter(torch.zeros(1))
    reference_optimizer = torch.optim.SGD([reference_param], lr=1.0)
    total = updates * processes  # get_scheduler_fix: max_train_steps * num_processes
    ticks = int(warmup * total) if isinstance(warmup, float) else warmup
    reference = get_scheduler(name, reference_optimizer, num_warmup_steps=ticks, num_training_steps=total)
    expected = []
    for _ in range(updates):
        expected.append(reference_optimizer.param_groups[0]["lr"])
        reference_optimizer.step()
        for _ in range(processes):  # AcceleratedScheduler.step: num_processes steps per optimizer step
            reference.step()
    assert ours == pytest.approx(expected, abs=1e-12)
