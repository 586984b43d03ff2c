"""``run(cfg)``: the only function that sees the whole config; it wires the stages in order.

validate → the processes (``library/runtime/processes.py``; one, or those torchrun started) → sample prompts → the
``--resume`` state (read and checked; its seed) → data (no model needed, so data errors come before anything loads)
→ step plan and start position → trajectory check against the state → output folder (lock, writability, cleanup
after interrupted saves) → models → precision → network → optimizer → LR schedule → latent cache → restore the
state → loop → final save. Each stage gets only its own config section. Nothing is written into the output folder
until every check that needs no model has passed; the lock file is removed at the end, also after an error or an
interruption.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from library.base.errors import TrainingDiverged
from library.config import LogConfig, TrainConfig, public_snapshot, validate
from library.data import build_train_data
from library.data.debug import show_batches
from library.families import model_setup
from library.families.precision import optimizer_state_dtype, precision_policy
from library.families.registry import model_family
from library.runtime import processes as distributed
from library.runtime.fs_checks import check_folder, ensure_room_for_save
from library.runtime.output import open_output
from library.sampling.images import make_sample_hooks
from library.sampling.prompts import plan_samples
from library.saving.lora_files import OutputNames, Saver, make_save_hooks, save_dtype
from library.saving.metadata import optimizer_description, thumbnail_data_url, training_metadata
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
from library.train import network_setup, optimizer_setup
from library.train.accumulation import build_accumulation
from library.train.batch_loss import BatchLoss
from library.train.loop import LoopResult, train_loop
from library.train.noise import apply_zero_terminal_snr
from library.train.readout import Readout
from library.train.schedule import describe, plan_steps
from library.train.tracking import Tracker
from library.train.update import DynamicLossScale, Updater
from library.train.validation import build_validation

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    lora_path: Path
    loop: LoopResult
    main_process: bool = True  # False on the other processes of a multi-process run (they wrote nothing)


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
    with distributed.start(cfg.distributed) as processes:
        distributed.check_supported(processes.info, fused_backward_pass=cfg.optimizer.fused_backward_pass)
        for line in distributed.describe_options(cfg.distributed, processes.info):
            log.info(line)
        sample_plan = plan_samples(cfg.sample)
        choice = optimizer_setup.check_optimizer(cfg.optimizer, cfg.schedule)
        thumbnail = thumbnail_data_url(cfg.save.metadata_thumbnail)
        saved = read_state(cfg.save.resume) if cfg.save.resume else None
        if saved is not None:
            check_finite(saved)
        seed, stored_seed = cfg.run.seed, saved_seed(saved) if saved is not None else None
        if seed is None and stored_seed is not None:
            seed = stored_seed
            log.info("--resume without --seed: using the seed of the run that saved the state, %d", seed)
        seed = processes.decide_seed(seed)
        family = model_family(cfg.family)
        data = build_train_data(cfg.data, seed=seed, max_token_length=cfg.model.max_token_length,
                                masked_loss=cfg.loss.masked_loss, v2=cfg.model.v2, bucket_step=family.bucket_step,
                                latent_suffix=family.latent_suffix)
        data.shard(processes.shard)
        plan = plan_steps(len(data), batch_size=cfg.data.train_batch_size,
                          gradient_accumulation_steps=cfg.schedule.gradient_accumulation_steps,
                          num_processes=processes.world_size, max_train_steps=cfg.schedule.max_train_steps,
                          max_train_epochs=cfg.schedule.max_train_epochs)
        for line in data.summary() + describe(plan, data.num_train_images, data.num_reg_images):
            log.info(line)
        if cfg.data.debug_dataset:
            if processes.is_main:
                show_batches(data, plan.max_train_steps)
            return None
        lr_schedule = optimizer_setup.plan_schedule(cfg.schedule, choice, plan, cfg.optimizer.learning_rate)
        cfg = replace(cfg, schedule=replace(cfg.schedule, lr_scheduler=lr_schedule.name))  # as ss_lr_scheduler
        start = start_position(cfg.schedule, plan, saved_position(saved, plan) if saved else None)
        route = trajectory(seed=seed, datasets=data.datasets,
                           gradient_accumulation_steps=cfg.schedule.gradient_accumulation_steps,
                           optimizer=optimizer_label(choice.spec.name if choice.spec else choice.name,
                                                     choice.options),
                           network_module=cfg.network.network_module, num_processes=processes.world_size)
        if saved is not None:
            check_trajectory(saved, route)
        names = OutputNames(cfg.save.output_name)
        if cfg.log.logging_dir and processes.is_main:
            check_folder("--logging_dir", cfg.log.logging_dir)
        if cfg.network.network_weights:
            network_setup.weights_shapes(cfg.network.network_weights)  # a bad file is named before the model loads
            network_setup.check_network_weights(cfg.network)

        # before anything heavy loads; only the main process writes there
        with open_output(cfg.save.output_dir, names.last, names.owns) if processes.is_main else nullcontext():
            processes.sync()
            torch.manual_seed(seed)  # the same on every process: random-weight models, the network's init
            random.seed(seed)
            device = processes.device
            policy = precision_policy(cfg.precision)
            model = model_setup.load_model(cfg.model, cfg.precision, policy, device, family, cfg.sdxl)
            network_setup.merge_base_weights(cfg.model, cfg.network.network_module, model, policy, family)
            model_setup.store_frozen_fp8(model, policy, family)
            if cfg.noise.zero_terminal_snr:
                apply_zero_terminal_snr(model.noise_scheduler)
            network, train_te = network_setup.build_network(cfg.network, model, policy, device, family)
            processes.broadcast_from_main(list(network.state_dict().values()))  # one initialisation for all
            if processes.is_main:
                ensure_room_for_save(cfg.save.output_dir, network, save_dtype(cfg.save), cfg.save.save_state,
                                     "the LoRA")
            if cfg.data.cache_latents or cfg.data.cache_latents_to_disk:
                model_setup.cache_latents(data, model, policy, device, cfg.data, cfg.model.highvram,
                                          share=processes.owns_item, wait=processes.sync)
            if cfg.sdxl.cache_text_encoder_outputs or cfg.sdxl.cache_text_encoder_outputs_to_disk:
                model_setup.cache_text_encoder_outputs(data, model, family, policy, device, cfg.sdxl,
                                                       cfg.model.max_token_length, cfg.data.train_batch_size,
                                                       cfg.model.weighted_captions, share=processes.owns_item,
                                                       wait=processes.sync)
            groups, descriptions = network_setup.param_groups(network, cfg.optimizer)
            optimizer = optimizer_setup.build_optimizer(choice, groups, cfg.optimizer.learning_rate)
            scheduler = optimizer_setup.build_scheduler(optimizer, lr_schedule)
            for warning in optimizer_setup.optimizer_warnings(choice, groups, cfg.schedule, cfg.precision.full_bf16,
                                                              plan):
                log.warning(warning)
            log.info(policy.describe(optimizer_setup.optimizer_state_label(choice, policy)))
            accumulation = build_accumulation(network, steps=cfg.schedule.gradient_accumulation_steps,
                                              network_dtype=policy.network_dtype,
                                              mode=cfg.precision.full_bf16_grad_accumulation,
                                              seed=_stream_seed(seed, "accumulation"))
            processes.seed_generators(seed)
            noise_generator = torch.Generator(device).manual_seed(processes.process_seed(seed))
            host_generator = torch.Generator().manual_seed(_stream_seed(processes.process_seed(seed), "noise_host")) \
                if device.type != "cpu" else None
            loss_scale = DynamicLossScale() if policy.loss_scaling else None
            params = [p for g in groups for p in g["params"]]
            reducer = processes.gradient_reducer(params, _stream_seed(seed, "gradient_reduce"),
                                                 gradient_as_bucket_view=cfg.distributed.ddp_gradient_as_bucket_view)
            state = TrainingState(network, optimizer, scheduler, noise_generator, accumulation, loss_scale, seed,
                                  route, public_snapshot(cfg), host_generator, rank=processes.rank,
                                  other_ranks=lambda: processes.rank_rngs,
                                  reducer=reducer if processes.distributed else None)
            if cfg.save.save_state or cfg.save.save_state_on_train_end:
                state.check_storable()
            if saved is not None:
                state.restore(saved)

            started = time.time()
            meta = training_metadata(
                cfg, plan, seed=seed, thumbnail=thumbnail, dataset_meta=data.metadata(),
                network_meta=network_setup.network_meta(cfg.network),
                optimizer_name=optimizer_description(optimizer, choice.options),
                stochastic_rounding=optimizer_setup.rounds_stochastically(choice, policy),
                num_train_images=data.num_train_images, num_reg_images=data.num_reg_images,
                resolution=cfg.data.resolution or data.resolution, started=started)
            saver = Saver(Path(cfg.save.output_dir), cfg.save.save_model_as, save_dtype(cfg.save))
            tracker = Tracker(cfg.log if processes.is_main else LogConfig(), public_snapshot(cfg))
            readout = Readout()
            updater = Updater(params, optimizer, scheduler, accumulation, plan.gradient_accumulation_steps,
                              cfg.optimizer.max_grad_norm, cfg.precision.max_nan_steps, loss_scale=loss_scale,
                              max_norm=(network, cfg.network.scale_weight_norms) if cfg.network.scale_weight_norms
                              else None, fused=cfg.optimizer.fused_backward_pass, reduce=reducer.reduce,
                              scheduler_ticks=plan.num_processes, readout=readout, updates=start.step)
            batch_loss = BatchLoss(model, network, cfg.noise, cfg.loss, policy, device, noise_generator,
                                   cfg.model.clip_skip, cfg.model.max_token_length, train_te,
                                   cfg.model.weighted_captions, family, readout=readout,
                                   host_generator=host_generator)
            model_setup.compile_unet(model, cfg.precision)
            samples = make_sample_hooks(sample_plan if processes.is_main else None, model, network, policy, device,
                                        Path(cfg.save.output_dir), cfg.save.output_name, tracker, cfg.model.clip_skip,
                                        family, cfg.model.max_token_length)
            validation = build_validation(data.validation, cfg.validation, batch_loss,
                                          (network, *family.text_encoders(model), model.unet),
                                          plan.max_train_steps)
            saves = processes.gate_saves(
                make_save_hooks(saver, names, network, state.capture, meta, cfg.save, plan.num_epochs), params,
                state.rng)
            try:
                result = train_loop(
                    data=data, batch_loss=batch_loss, updater=updater, plan=plan, saves=saves, samples=samples,
                    tracker=tracker, lr_values=optimizer_setup.lr_reporter(optimizer, descriptions, choice),
                    on_epoch_start=lambda epoch: network.on_epoch_start(family.network_text_encoder(model),
                                                                        model.unet),
                    start=start, validation=validation, show_progress=processes.is_main)
            except TrainingDiverged as exc:
                raise TrainingDiverged(f"{exc}; {_last_good(saver, saver.lora_path(names.last), exc.weights_intact)}",
                                       weights_intact=exc.weights_intact) from None
            finally:
                tracker.close()
                accumulation.remove()
            processes.sync()  # the final save is written: every process ends with the main one's outcome
        log.info("optimizer state after training: %s", optimizer_state_dtype(optimizer))
        return RunResult(saver.lora_path(names.last), result, processes.is_main)
