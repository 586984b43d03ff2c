"""Train a LoRA for Stable Diffusion 1.x/2.x with kohya sd-scripts' flags. ``main`` is the trainer of every model
family (``library/families/registry.py``): ``sdxl_train_network.py`` and ``flux_train_network.py`` run it with theirs.

    python train_network.py --pretrained_model_name_or_path MODEL --train_data_dir DATA \\
        --resolution 512 --output_dir OUT --network_module networks.lora [--full_bf16 ...]

Several GPUs or machines: ``accelerate launch --multi_gpu --num_processes N train_network.py ...`` or
``torchrun --nproc_per_node N train_network.py ...`` (README, "Several GPUs or machines").

Exit codes: 0 done, 2 bad input (nothing written; also weights or a state holding NaN/Inf) or a file the run cannot
write (a full disk, bytes or inodes; a read-only or vanished output folder: one line names the file, the cause, what
to do and the last good LoRA; the temporaries are removed, the lock released), 3 training diverged
(the message names the last good LoRA: saved at the stop when the weights were still good, else the last file
written before; no file ever holds NaN/Inf), 4 another process of the run stopped unexpectedly or stopped answering
(one line names it and the last checkpoint), 130 interrupted (one line names the last checkpoint the run saved, or
says that it saved none and names a file from before it at the final name); with several
processes every process exits with the code of the one that stopped the run.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import replace
from typing import Any


def _interrupt_on_sigterm() -> Any:
    """Treat SIGTERM like Ctrl-C, so that both stop the run between atomic writes; returns the handler it replaced
    (``main`` puts it back when the run ends, so that a program calling ``main``, and processes it forks later,
    keep their own)."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, handler)


def _prints_errors() -> bool:
    """Under torchrun / accelerate launch every process parses the same flags: their errors are printed (and the log
    file written) by the main process (``RANK`` 0) only. Errors during a run are reported to it
    (``library/runtime/processes.py``)."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


def main(argv: list[str] | None = None, family: str = "sd", script: str | None = None) -> int:
    """Run the trainer for the model family called ``family`` in ``library/families/registry.py`` ("sd": this script;
    each family's entry script passes its own); ``script``: a full fine-tuning script's name (``fine_tune.py``,
    ``train_db.py``, ``sdxl_train.py``: its record in ``entry_scripts()``), None for the family's LoRA script."""
    from library.base.errors import Stopped, TrainingDiverged, UserError
    from library.config.cli import parse_args, write_config_file
    from library.families.registry import FAMILIES, entry_scripts
    from library.runtime.console_log import setup_logging

    setup_logging()
    try:
        args = sys.argv[1:] if argv is None else argv
        scripts = entry_scripts()
        record = FAMILIES[family] if script is None else scripts[script]
        cfg, explicit = parse_args(args, record, list(scripts.values()))
        # --console_log_file is the main process's; the others log their warnings to the console
        setup_logging(cfg.log if _prints_errors() else replace(cfg.log, console_log_file=None))
        if cfg.run.output_config:
            if not cfg.run.config_file:
                raise UserError("--output_config writes the given arguments to the --config_file path; "
                                "give --config_file NEW.toml")
            print(f"wrote {write_config_file(cfg.run.config_file, explicit)}")
            return 0
        from library.runtime.host_memory import keep_freed_host_memory, use_huge_pages
        from library.runtime.run import run  # heavy imports (torch, diffusers) only once the flags are valid

        if cfg.precision.mixed_precision == "bf16":
            use_huge_pages()  # before the model is loaded: its first large allocation reads the setting
        keep_freed_host_memory()
        previous = _interrupt_on_sigterm()
        try:
            result = run(cfg)
        finally:
            signal.signal(signal.SIGTERM, previous)
    except UserError as exc:
        for message in exc.messages if _prints_errors() else []:
            print(f"error: {message}", file=sys.stderr)
        return exc.exit_code
    except Stopped as exc:  # a run interrupted, or a multi-process run stopped on every process
        for line in exc.lines:
            print(line, file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # before the run's processes started: nothing written yet
        print("interrupted: nothing was saved by this run", file=sys.stderr)
        return 130
    except TrainingDiverged as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    if result is None:  # --debug_dataset
        return 0
    loop = result.loop
    if not result.main_process:
        return 0
    print(f"saved {result.lora_path}: {loop.position.step} steps, {loop.position.epoch} epochs, "
          f"loss (last step) {loop.last_loss:.4f}, "
          f"{loop.skipped_updates} update{'' if loop.skipped_updates == 1 else 's'} skipped as non-finite, "
          f"{loop.seconds:.1f} s ({loop.seconds_per_step:.3f} s/step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
