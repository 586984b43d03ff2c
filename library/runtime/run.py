"""``run(cfg)``: the only function that sees the whole config; it builds the run's components and hands them to
the loop.

In order: validate → the processes (``library/runtime/processes.py``; one, or those torchrun started) → what needs
no model (``_prepare``: sample prompts, the ``--resume`` state and its seed, data, step plan, start position,
trajectory check; so data errors come before anything loads) → the output folder (lock, writability, cleanup after
interrupted saves) → models and network (``_models``) → optimizer, schedule, accumulation, generators, the state
to save and restore (``_optimization``) → the loop's components (``_trainer``) → the loop → final save. Each stage
function elsewhere gets only its own config section. Nothing is written into the output folder until every check
that needs no model has passed; the lock file is removed at the end, also after an error or an interruption.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from library.base.errors import TrainingDiverged
from library.base.fs_checks import check_folder, ensure_room_for_save
from library.config import LogConfig, SaveConfig, TrainConfig, public_snapshot, validate
from library.data import encode_caches
from library.data.cache_progress import CacheProgress
from library.data.dataset import TrainData, build_train_data
from library.data.debug import show_batches
from library.data.latent_cache import LatentFiles
from library.families import model_setup
from library.families.base import ModelFamily
from library.families.precision import PrecisionPolicy, optimizer_state_dtype, precision_policy
from library.families.registry import model_family
from library.runtime import processes as process_group
from library.runtime.compile_checks import check_dynamo_backend
from library.runtime.output import open_output
from library.sampling.images import SAMPLE_FOLDER, make_sample_hooks
from library.sampling.prompts import SamplePlan, check_sample_folder, plan_samples
from library.saving.lora_files import OutputNames, Saver, make_save_hooks, save_dtype
from library.saving.metadata import checkpoint_metadata, optimizer_description, thumbnail_data_url, training_metadata
from library.saving.resume import (
    TrainingState,
    check_finite,
    check_trajectory,
    saved_position,
    saved_seed,
    start_position,
)
from library.saving.state_file import read_state
from library.saving.trajectory import optimizer_label, trajectory
from library.train import full_model, network_setup, optimizer_setup
from library.train.accumulation import build_accumulation
from library.train.batch_loss import BatchLoss
from library.train.cadence import Hook
from library.train.loop import LoopResult, train_loop
from library.train.loss_scale import DynamicLossScale
from library.train.position import Position, SampleHooks, SaveHooks
from library.train.readout import Readout
from library.train.steps import StepPlan, describe, plan_steps
from library.train.tracking import Tracker
from library.train.update import Updater, make_updater
from library.train.validation import Validation, build_validation

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    lora_path: Path
    loop: LoopResult
    main_process: bool = True  # False on the other processes of a multi-process run (they wrote nothing)


@dataclass
class Prepared:
    """What the run decides before any model loads."""

    cfg: TrainConfig  # with the LR scheduler's resolved name (as ss_lr_scheduler)
    seed: int
    saved: Any  # the --resume state, or None
    samples: SamplePlan | None
    choice: optimizer_setup.OptimizerChoice
    lr_schedule: Any
    thumbnail: str | None
    family: ModelFamily
    data: TrainData
    plan: StepPlan
    start: Position
    route: dict[str, Any]
    names: OutputNames


@dataclass
class Models:
    """The model of the run's family under its precision policy, with the network attached."""

    device: torch.device
    policy: PrecisionPolicy
    model: Any
    network: torch.nn.Module
    train_text_encoder: bool
    compile_clock: model_setup.CompileClock | None = None  # --torch_compile


@dataclass
class Optimization:
    """How the network is updated, and the state ``--save_state`` stores and ``--resume`` puts back."""

    optimizer: Any
    scheduler: Any
    lr_values: Callable[[], dict[str, float]]
    updater: Updater
    accumulation: Any
    noise_generator: torch.Generator
    host_generator: torch.Generator | None
    state: TrainingState


@dataclass
class Trainer:
    """The loop's components, built from their own sections; ``train()`` runs the loop."""

    data: TrainData
    plan: StepPlan
    start: Position
    batch_loss: BatchLoss
    updater: Updater
    saver: Saver
    saves: SaveHooks
    samples: SampleHooks
    validation: Validation | None
    tracker: Tracker
    lr_values: Callable[[], dict[str, float]]
    on_epoch_start: Callable[[int], None]
    accumulation: Any
    last: Path  # the final LoRA file
    show_progress: bool
    after_first_update: Callable[[], None] | None = None  # --torch_compile's report of the compilation's time
    stop_hooks: list[Hook] = field(default_factory=list)  # parts of a full fine-tuning that stop training part-way

    def train(self) -> LoopResult:
        try:
            return train_loop(data=self.data, batch_loss=self.batch_loss, updater=self.updater, plan=self.plan,
                              saves=self.saves, samples=self.samples, tracker=self.tracker, lr_values=self.lr_values,
                              on_epoch_start=self.on_epoch_start, start=self.start, validation=self.validation,
                              show_progress=self.show_progress, after_first_update=self.after_first_update,
                              stop_hooks=self.stop_hooks)
        except TrainingDiverged as exc:
            raise TrainingDiverged(f"{exc}; {_last_good(self.saver, self.last, exc.weights_intact)}",
                                   weights_intact=exc.weights_intact) from None
        finally:
            self.tracker.close()
            self.accumulation.remove()


def _stream_seed(seed: int, stream: str) -> int:
    """A seed for one random stream of the run, derived from the run's seed (so that streams are not copies)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{stream}".encode()).digest()[:8], "little") >> 1


def _last_good(saver: Saver, final: Path, weights_intact: bool) -> str:
    """Where the last good weights are, for the divergence message."""
    if saver.last_lora is not None and weights_intact:
        return f"the last good weights are saved in {saver.last_lora}"
    if saver.last_lora is not None:
        return f"the last good LoRA is {saver.last_lora}, left as it was"
    before = f"; {final} from before this run is left as it was" if final.exists() else ""
    return f"no LoRA file was written by this run (--save_every_n_steps keeps earlier ones){before}"


def run(cfg: TrainConfig) -> RunResult | None:
    """Train a LoRA as described by ``cfg``; returns the final file and the loop's figures (None when
    ``--debug_dataset`` only showed the batches).

    Started by torchrun / ``accelerate launch`` on several processes, every process runs this same function
    (``library/runtime/processes.py``): the seed is the main process's, each process loads its share of every epoch,
    gradients are averaged once per update, and only the main process writes into the output folder."""
    validate(cfg)
    with process_group.start(cfg.distributed) as processes:
        ready = _prepare(cfg, processes)
        if ready is None:
            return None
        names = ready.names  # the output folder is taken before anything heavy loads; only the main process writes
        final = Saver(Path(cfg.save.output_dir), full_model.saved_extension(cfg), None).lora_path(names.last)
        processes.earlier = (lambda: final) if final.is_file() else (lambda: None)  # named if interrupted
        subfolders = (SAMPLE_FOLDER,) if ready.samples else ()  # written into: a link there is refused first
        with open_output(cfg.save.output_dir, names, subfolders) if processes.is_main else nullcontext():
            processes.sync()
            torch.manual_seed(ready.seed)  # the same on every process: random-weight models, the network's init
            random.seed(ready.seed)
            models = _models(ready.cfg, ready, processes)
            optimization = _optimization(ready.cfg, ready, models, processes)
            trainer = _trainer(ready.cfg, ready, models, optimization, processes)
            processes.checkpoint = lambda: trainer.saver.last_lora  # named if a process is lost
            result = trainer.train()
            processes.sync()  # the final save is written: every process ends with the main one's outcome
        log.info("optimizer state after training: %s", optimizer_state_dtype(optimization.optimizer))
        return RunResult(trainer.last, result, processes.is_main)


def _prepare(cfg: TrainConfig, processes: process_group.Processes) -> Prepared | None:
    """Everything decided before a model loads, so that bad input fails fast; None for ``--debug_dataset``."""
    samples, choice, thumbnail = _check_before_loading(cfg, processes)
    saved, seed = _resumed_state(cfg.save, cfg.run.seed, processes)
    data, plan = _data_and_plan(cfg, seed, processes)
    if cfg.data.debug_dataset:
        if processes.is_main:
            show_batches(data, plan.max_train_steps)
        return None
    lr_schedule = optimizer_setup.plan_schedule(cfg.schedule, choice, plan, cfg.optimizer.learning_rate)
    cfg = replace(cfg, schedule=replace(cfg.schedule, lr_scheduler=lr_schedule.name))  # as ss_lr_scheduler
    start = start_position(cfg.schedule, plan, saved_position(saved, plan) if saved else None)
    route = trajectory(seed=seed, datasets=data.datasets,
                       gradient_accumulation_steps=cfg.schedule.gradient_accumulation_steps,
                       optimizer=optimizer_label(choice.spec.name if choice.spec else choice.name, choice.options),
                       network_module=cfg.network.network_module, num_processes=processes.world_size)
    if saved is not None:
        check_trajectory(saved, route, public_snapshot(cfg)["network"], cfg.family.denoiser_name)
    if cfg.log.logging_dir and processes.is_main:
        check_folder("--logging_dir", cfg.log.logging_dir)
    network_setup.check_network_weights(cfg.network)  # a bad file is named before the model loads
    return Prepared(cfg=cfg, seed=seed, saved=saved, samples=samples, choice=choice, lr_schedule=lr_schedule,
                    thumbnail=thumbnail, family=model_family(cfg.family.name), data=data, plan=plan, start=start,
                    route=route, names=OutputNames(cfg.save.output_name))


def _check_before_loading(cfg: TrainConfig, processes: process_group.Processes
                          ) -> tuple[SamplePlan | None, optimizer_setup.OptimizerChoice, str | None]:
    """The checks of the flags and files that need neither data nor model: optimizer, processes, sample prompts,
    ``--dynamo_backend`` and the thumbnail; returns the sample plan, the optimizer choice and the thumbnail."""
    choice = optimizer_setup.check_optimizer(cfg.optimizer, cfg.schedule, cfg.family_config)
    for line in process_group.describe_options(cfg.distributed, processes.info):
        log.info(line)
    samples = plan_samples(cfg.sample, cfg.family)
    check_sample_folder(samples, cfg.save.output_dir)
    check_dynamo_backend(cfg.precision)  # --torch_compile with a backend this torch lacks
    return samples, choice, thumbnail_data_url(cfg.save.metadata_thumbnail)


def _resumed_state(save: SaveConfig, seed: int | None, processes: process_group.Processes) -> tuple[Any, int]:
    """The ``--resume`` state (checked to hold finite numbers), or None; and the run's seed: ``--seed``, else the
    resumed run's, decided by the main process."""
    saved = read_state(save.resume) if save.resume else None
    if saved is not None:
        check_finite(saved)
    stored_seed = saved_seed(saved) if saved is not None else None
    if seed is None and stored_seed is not None:
        seed = stored_seed
        log.info("--resume without --seed: using the seed of the run that saved the state, %d", seed)
    return saved, processes.decide_seed(seed)


def _data_and_plan(cfg: TrainConfig, seed: int, processes: process_group.Processes) -> tuple[TrainData, StepPlan]:
    """The datasets (this process's share) and the steps and epochs they make."""
    data = build_train_data(cfg.data, seed=seed, max_token_length=cfg.model.max_token_length,
                            masked_loss=cfg.loss.masked_loss, v2=cfg.model.v2, bucket_step=cfg.family.bucket_step)
    data.shard(processes.shard)
    plan = plan_steps(len(data), batch_size=cfg.data.train_batch_size,
                      gradient_accumulation_steps=cfg.schedule.gradient_accumulation_steps,
                      num_processes=processes.world_size, max_train_steps=cfg.schedule.max_train_steps,
                      max_train_epochs=cfg.schedule.max_train_epochs)
    for line in data.summary() + describe(plan, data.num_train_images, data.num_reg_images):
        log.info(line)
    return data, plan


def _models(cfg: TrainConfig, ready: Prepared, processes: process_group.Processes) -> Models:
    """Load the model, apply the precision policy, attach the network, cache what can be cached and compile the
    denoiser (``--torch_compile``)."""
    device, family, data = processes.device, ready.family, ready.data
    policy = precision_policy(cfg.precision)
    section = cfg.family_config
    if cfg.family.trained == "model":
        model, network, train_te = full_model.load_and_unfreeze(cfg, policy, device, family)
    else:
        model = model_setup.load_model(cfg.model, cfg.precision, policy, device, family=family, section=section)
        network_setup.merge_base_weights(cfg.model, cfg.network.network_module, model, policy, family=family)
        policy = model_setup.store_frozen_fp8(model, policy, family=family, denoiser_name=cfg.family.denoiser_name,
                                              section=section)
        family.place_denoiser(model, section, device)
        network, train_te = network_setup.build_network(cfg.network, model, policy, device, family=family)
    processes.broadcast_from_main(list(network.state_dict().values()))  # one initialisation for all
    if processes.is_main:
        ensure_room_for_save(cfg.save.output_dir, network, save_dtype(cfg.save), cfg.save.save_state,
                             "the checkpoint" if cfg.family.trained == "model" else "the LoRA")
    caching = CacheProgress(show=processes.is_main, step=processes.caching_step)  # a bar; stops keep step
    if cfg.data.cache_latents or cfg.data.cache_latents_to_disk:
        files = LatentFiles(cfg.family.latent_suffix, cfg.family.latent_channels)
        generator = encode_caches.latent_generator(ready.seed, device,
                                                   family.upstream_draws_before_latents(cfg.model, model))
        encode_caches.cache_latents(data, model, policy, device, cfg.data, files, highvram=cfg.model.highvram,
                                    share=processes.owns_item, wait=processes.caching_done, progress=caching,
                                    generator=generator)
    caches_text, to_disk = family.text_output_cache(section)
    if caches_text:
        encode_caches.cache_text_encoder_outputs(
            data, model, family, policy, device, to_disk, cfg.model.max_token_length,
            section.text_encoder_batch_size or cfg.data.train_batch_size, cfg.family,
            cfg.model.weighted_captions, share=processes.owns_item, wait=processes.caching_done, progress=caching)
        if not train_te:  # frozen, and read from now on by sample prompts alone
            family.release_text_encoders(model, ready.samples, device, policy)
    clock = model_setup.compile_unet(model, cfg.precision, cfg.family.denoiser_name,
                                     bucket_shapes=len({reso for ds in data.datasets for reso, _ in ds.buckets}))
    return Models(device=device, policy=policy, model=model, network=network, train_text_encoder=train_te,
                  compile_clock=clock)


def _optimization(cfg: TrainConfig, ready: Prepared, models: Models, processes: process_group.Processes
                  ) -> Optimization:
    """The optimizer and its schedule, gradient accumulation, the random streams, the update and the state."""
    choice, seed, device, network = ready.choice, ready.seed, models.device, models.network
    groups, descriptions = network_setup.param_groups(network, cfg.optimizer)
    optimizer = optimizer_setup.build_optimizer(choice, groups, cfg.optimizer.learning_rate, device,
                                                cfg.optimizer.offload_optimizer_state)
    scheduler = optimizer_setup.build_scheduler(optimizer, ready.lr_schedule)
    for warning in optimizer_setup.optimizer_warnings(choice, groups, cfg.schedule, cfg.precision.full_bf16,
                                                      ready.plan):
        log.warning(warning)
    log.info(models.policy.describe(optimizer_setup.optimizer_state_label(choice, models.policy),
                                   cfg.family.denoiser_name, full_model=cfg.family.trained == "model"))
    accumulation = build_accumulation(network, steps=cfg.schedule.gradient_accumulation_steps,
                                      network_dtype=models.policy.network_dtype,
                                      mode=cfg.precision.full_bf16_grad_accumulation,
                                      seed=_stream_seed(seed, "accumulation"))
    processes.seed_generators(seed)
    noise_generator = torch.Generator(device).manual_seed(processes.process_seed(seed))
    host_generator = torch.Generator().manual_seed(_stream_seed(processes.process_seed(seed), "noise_host")) \
        if device.type != "cpu" else None
    loss_scale = DynamicLossScale() if models.policy.loss_scaling else None
    params = [p for g in groups for p in g["params"]]
    reducer = processes.gradient_reducer(params, _stream_seed(seed, "gradient_reduce"),
                                         gradient_as_bucket_view=cfg.distributed.ddp_gradient_as_bucket_view)
    state = TrainingState(
        network=network, optimizer=optimizer, scheduler=scheduler, noise_generator=noise_generator,
        accumulation=accumulation, loss_scale=loss_scale, seed=seed, trajectory=ready.route,
        config=public_snapshot(cfg), host_generator=host_generator, rank=processes.rank,
        other_ranks=lambda: processes.rank_rngs, reducer=reducer if processes.distributed else None)
    if cfg.save.save_state or cfg.save.save_state_on_train_end:
        state.check_storable()
    if ready.saved is not None:
        state.restore(ready.saved)
    updater = make_updater(
        params=params, optimizer=optimizer, scheduler=scheduler, accumulation=accumulation,
        accumulation_steps=ready.plan.gradient_accumulation_steps, max_grad_norm=cfg.optimizer.max_grad_norm,
        max_nan_steps=cfg.precision.max_nan_steps, loss_scale=loss_scale,
        max_norm=(network, cfg.network.scale_weight_norms) if cfg.network.scale_weight_norms else None,
        norm_update=getattr(network, "norm_update", None), fused=choice.fused,
        reduce=reducer.reduce, scheduler_ticks=ready.plan.num_processes, readout=Readout(), updates=ready.start.step,
        reducer=reducer if processes.distributed else None)
    return Optimization(optimizer=optimizer, scheduler=scheduler, updater=updater, accumulation=accumulation,
                        lr_values=optimizer_setup.lr_reporter(optimizer, descriptions, choice),
                        noise_generator=noise_generator, host_generator=host_generator, state=state)


def _trainer(cfg: TrainConfig, ready: Prepared, models: Models, optimization: Optimization,
             processes: process_group.Processes) -> Trainer:
    """The loop's components: the loss of a batch, saving, sampling, validation and logs."""
    family, model, network, data = ready.family, models.model, models.network, ready.data
    ids = family.model_ids(cfg.model.v2, cfg.model.v_parameterization, model)
    meta = checkpoint_metadata(cfg, ids, cfg.data.resolution or data.resolution, ready.thumbnail) \
        if cfg.family.trained == "model" else training_metadata(
        cfg, ready.plan, ids, seed=ready.seed,
        thumbnail=ready.thumbnail, dataset_meta=data.metadata(), network_meta=network_setup.network_meta(cfg.network),
        optimizer_name=optimizer_description(optimization.optimizer, ready.choice.options),
        stochastic_rounding=optimizer_setup.rounds_stochastically(ready.choice, models.policy),
        num_train_images=data.num_train_images, num_reg_images=data.num_reg_images,
        resolution=cfg.data.resolution or data.resolution, started=time.time(),
        text_encoder_lr=network_setup.text_encoder_lr(network, cfg.optimizer), family_meta=family.metadata(cfg))
    saver = Saver(Path(cfg.save.output_dir), full_model.saved_extension(cfg), save_dtype(cfg.save))
    tracker = Tracker(cfg.log if processes.is_main else LogConfig(), public_snapshot(cfg))
    batch_loss = BatchLoss(
        model=model, network=network, noise=cfg.noise, loss=cfg.loss, policy=models.policy, device=models.device,
        generator=optimization.noise_generator, clip_skip=cfg.model.clip_skip,
        max_token_length=cfg.model.max_token_length, train_text_encoder=models.train_text_encoder,
        weighted_captions=cfg.model.weighted_captions, family=family, readout=optimization.updater.readout,
        host_generator=optimization.host_generator, objective=family.objective(model, cfg, models.device))
    samples = make_sample_hooks(
        ready.samples if processes.is_main else None, model=model, network=network, policy=models.policy,
        device=models.device, output_dir=Path(cfg.save.output_dir), output_name=cfg.save.output_name,
        tracker=tracker, clip_skip=cfg.model.clip_skip, family=family, max_token_length=cfg.model.max_token_length)
    validation = build_validation(data.validation, cfg.validation, batch_loss=batch_loss,
                                  modules=(network, *family.text_encoders(model), model.unet),
                                  max_train_steps=ready.plan.max_train_steps)
    state = optimization.state
    save_hooks = make_save_hooks(saver, ready.names, network=network, capture=state.capture, metadata=meta,
                                 cfg=cfg.save, num_epochs=ready.plan.num_epochs)
    saves = processes.gate_saves(save_hooks, optimization.updater.params, state.rng)
    return Trainer(
        data=data, plan=ready.plan, start=ready.start, batch_loss=batch_loss, updater=optimization.updater,
        saver=saver, saves=saves, samples=samples, validation=validation, tracker=tracker,
        lr_values=optimization.lr_values, accumulation=optimization.accumulation,
        on_epoch_start=lambda epoch: network.on_epoch_start(family.network_text_encoder(model), model.unet),
        last=saver.lora_path(ready.names.last), show_progress=processes.is_main,
        after_first_update=models.compile_clock.first_update_done if models.compile_clock else None,
        stop_hooks=network.stop_hooks(ready.start.step) if isinstance(network, full_model.TrainedModel) else [])
