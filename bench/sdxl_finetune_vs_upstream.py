"""Our ``sdxl_train.py`` against upstream sd-scripts' on the same work, side by side: seconds per step and peak
resident memory of full fine-tuning of an SDXL U-Net (random weights), cached latents and text encoder outputs.

The model: SDXL's U-Net at reduced depth and a little narrower, so that its weights dominate the memory and the
largest row stays under 9 GiB here: channels ``--channels`` x (1, 2, 4) (SDXL: 320; default 224), heads 64 wide,
context 2048 and vector 2816 wide as SDXL's, ONE transformer layer per attention block (SDXL: 2 and 10); text encoders
of SDXL's widths (768; 1280 with its projection) but 12 and 2 layers with 64-wide MLPs (both sides read layer 11 of
the first and the penultimate of the second), a small VAE with SDXL's 8x downsampling. Written once, with upstream's
Python, as a diffusers ``StableDiffusionXLPipeline`` folder that both sides load: ours as it reads any diffusers
SDXL folder; upstream's ``sdxl_train_util._load_target_model`` converts the U-Net's state dict to its own
``SdxlUNet2DConditionModel``, which hardcodes the channels and the layer counts, so upstream's trainer runs through
this script's ``--run_upstream`` mode: it sets that module's ``MODEL_CHANNELS``/``TIME_EMBED_DIM`` and builds every
``Transformer2DModel`` with one layer, then runs upstream's unchanged ``sdxl_train.py`` as ``__main__``.

The rows (``ROWS``): mixed bf16 with AdamW (torch's class on both sides); upstream's memory recipe, ``--full_bf16``
Adafactor with the fused backward pass (both sides); ours alone: full bf16 StochasticAdamW with the fused backward
pass, without and with gradient accumulation; and AdamW under ``--fused_optimizer_groups 4`` (both sides). The same
flags word for word on both sides otherwise: 8 captioned images at ``--resolution`` px, batch 1, ``--cache_latents``,
``--cache_text_encoder_outputs``, seed 0, no data loader workers.

Each run is a child process of its side's Python (``bench/vs_upstream.py``'s ``--child``: threads pinned, the run's
``__main__``), its updates stamped at each LR-schedule tick (the fused backward pass steps without
``Optimizer.step``; the first tick is the schedule's creation). s/step: the median interval after ``--warmup``
updates; peak RSS: the process's high-water mark at its last update, before the final save. Rows run interleaved,
``--rounds`` times; the table gives medians.

    PEER_DIR=<harness> OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python bench/sdxl_finetune_vs_upstream.py

writes ``bench/results/sdxl-finetune-vs-upstream-<date>.md`` and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish, write_images  # noqa: E402
from finetune_vs_upstream import step_seconds  # noqa: E402
from memory_speed import machine  # noqa: E402
from vs_upstream import cpu_bf16, git_head, harness_args, run_flags, run_side, upstream_versions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "library" / "assets" / "configs" / "sdxl"
TOKENIZER_NAMES = ("openai_clip-vit-large-patch14", "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k")
ADAFACTOR = ["--optimizer_type", "Adafactor", "--optimizer_args", "relative_step=False", "scale_parameter=False",
             "warmup_init=False"]
MIXED_ADAMW = ["--mixed_precision", "bf16", "--optimizer_type", "AdamW"]
FUSED = ["--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "StochasticAdamW", "--fused_backward_pass"]
# row -> (its flags, whether upstream runs it)
ROWS = {
    "mixed bf16, AdamW": (MIXED_ADAMW, True),
    "full bf16, Adafactor, fused backward (upstream's recipe)": (
        ["--mixed_precision", "bf16", "--full_bf16", *ADAFACTOR, "--fused_backward_pass"], True),
    "full bf16, StochasticAdamW, fused backward": (FUSED, False),
    "full bf16, StochasticAdamW, fused backward, accumulation 2": ([*FUSED, "--gradient_accumulation_steps", "2"],
                                                                    False),
    "mixed bf16, AdamW, --fused_optimizer_groups 4": ([*MIXED_ADAMW, "--fused_optimizer_groups", "4"], True),
}
MODEL_INDEX = {
    "_class_name": "StableDiffusionXLPipeline", "force_zeros_for_empty_prompt": True,
    "scheduler": ["diffusers", "DDPMScheduler"], "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"], "tokenizer": [None, None],
    "tokenizer_2": [None, None],
}


def _config(part: str, **changes) -> dict:
    """The bundled SDXL config of ``part`` with ``changes``, without the keys that name its writer."""
    config = json.loads((CONFIGS / part / ("scheduler_config.json" if part == "scheduler" else "config.json"))
                        .read_text())
    config = {key: value for key, value in config.items()
              if not key.startswith("_") and key not in ("architectures", "transformers_version")}
    return {**config, **changes}


def build_model(folder: Path, channels: int) -> None:
    """Write the reduced SDXL (module docstring) to ``folder`` as a diffusers pipeline folder, seed 0, fp32."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(0)
    widths = [channels, 2 * channels, 4 * channels]
    unet = UNet2DConditionModel.from_config(_config("unet", block_out_channels=widths, transformer_layers_per_block=1,
                                                    attention_head_dim=[width // 64 for width in widths]))
    vae = AutoencoderKL.from_config(_config("vae", block_out_channels=[32] * 4, layers_per_block=1, sample_size=64))
    te1 = CLIPTextModel(CLIPTextConfig(**_config("text_encoder", intermediate_size=64)))
    te2 = CLIPTextModelWithProjection(CLIPTextConfig(**_config("text_encoder_2", intermediate_size=64,
                                                               num_hidden_layers=2)))
    for name, part in (("unet", unet), ("vae", vae), ("text_encoder", te1), ("text_encoder_2", te2)):
        part.save_pretrained(str(folder / name), safe_serialization=True)
    (folder / "scheduler").mkdir()
    (folder / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({"_class_name": "DDPMScheduler", **_config("scheduler")}, indent=2))
    (folder / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2))
    print(f"U-Net parameters: {sum(p.numel() for p in unet.parameters())}", flush=True)


def run_upstream(trainer: str, argv: list[str]) -> None:
    """Upstream's ``trainer`` as ``__main__`` with ``argv``, its U-Net class at ``SDXL_BENCH_CHANNELS`` channels and
    one transformer layer per attention block."""
    bench = str(Path(__file__).resolve().parent)
    sys.path[:] = [str(Path(trainer).resolve().parent), *(entry for entry in sys.path if entry != bench)]
    from library import sdxl_original_unet

    channels = int(os.environ["SDXL_BENCH_CHANNELS"])
    sdxl_original_unet.MODEL_CHANNELS, sdxl_original_unet.TIME_EMBED_DIM = channels, 4 * channels
    build_transformer = sdxl_original_unet.Transformer2DModel.__init__

    def one_layer(self, *args, **kwargs):
        build_transformer(self, *args, **{**kwargs, "num_transformer_layers": 1})

    sdxl_original_unet.Transformer2DModel.__init__ = one_layer
    sys.argv = [trainer, *argv]
    runpy.run_path(trainer, run_name="__main__")


def table(runs: dict[tuple[str, str], list[dict]], rows: list[str], warmup: int) -> str:
    """One row per configuration: s/step and peak RSS on each side, and ours relative to upstream's (same row, and
    its mixed bf16 AdamW)."""
    base_runs = runs.get(("upstream", "mixed bf16, AdamW"))
    base = statistics.median(r["peak_rss_at_last_step_bytes"] for r in base_runs) if base_runs else float("nan")
    lines = ["| configuration | ours s/step | upstream s/step | ours peak RSS GiB | upstream peak RSS GiB | ours / "
             "upstream (same row) | ours / upstream's mixed bf16 AdamW |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        ours, theirs = runs.get(("ours", row)), runs.get(("upstream", row))
        cells = []
        for side_runs in (ours, theirs):
            if side_runs:
                cells.append((statistics.median(step_seconds(r, warmup) for r in side_runs),
                              statistics.median(r["peak_rss_at_last_step_bytes"] for r in side_runs)))
            else:
                cells.append(None)
        (s_ours, m_ours), theirs_cell = cells[0] or (float("nan"), float("nan")), cells[1]
        s_theirs, m_theirs = (f"{theirs_cell[0]:.2f}", f"{theirs_cell[1] / 2**30:.2f}") if theirs_cell else ("—", "—")
        same = f"**{m_ours / theirs_cell[1]:.2f}×**" if theirs_cell and ours else "—"
        lines.append(f"| {row} | {s_ours:.2f} | {s_theirs} | {m_ours / 2**30:.2f} | {m_theirs} | {same} | "
                     f"**{m_ours / base:.2f}×** |")
    return "\n".join(lines)


def prepare(args: argparse.Namespace, tmp: Path) -> tuple[Path, Path, Path]:
    """The model folder (written with upstream's Python), the tokenizer cache under both upstream names, and the
    image folder; returns their paths."""
    model, tokenizers, data = tmp / "sdxl-reduced", tmp / "tokenizers", tmp / "data"
    env = {**os.environ, "PYTHONPATH": args.upstream_pythonpath, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([args.upstream_python, str(Path(__file__).resolve()), "--build_model", str(model),
                    str(args.channels)], cwd=args.upstream_dir, env=env, check=True)
    for name in TOKENIZER_NAMES:
        shutil.copytree(args.peer_dir / "model" / "tokenizer_cache" / TOKENIZER_NAMES[0], tokenizers / name)
    write_images(data / "1_shapes", args.resolution)
    return model, tokenizers, data


def per_update(report: dict, steps: int) -> dict:
    """``report`` with one stamp per update: upstream's ``--fused_optimizer_groups N`` keeps N LR schedules, each
    ticking at its creation and once per update, so its stamps come N at a time; the last of each N is kept."""
    ticks = len(report["stamps"]) // (steps + 1)
    if ticks > 1 and len(report["stamps"]) == ticks * (steps + 1):
        report["stamps"] = report["stamps"][ticks - 1::ticks]
    report["ticks_per_update"] = ticks
    return report


def measure(args: argparse.Namespace, rows: list[str], common: list[str], tmp: Path) -> tuple[dict, list[str]]:
    """Every row of ``rows`` on each side that runs it, interleaved, ``--rounds`` times: the children's reports, and
    a line per failed run."""
    sides = {"ours": (sys.executable, ROOT, None, str(ROOT / "sdxl_train.py"), []),
             "upstream": (args.upstream_python, args.upstream_dir, args.upstream_pythonpath,
                          str(Path(__file__).resolve()), ["--run_upstream", str(args.upstream_dir / "sdxl_train.py")])}
    runs: dict[tuple[str, str], list[dict]] = {}
    failures: list[str] = []
    child_env = {"VS_UPSTREAM_STAMP": "scheduler", "SDXL_BENCH_CHANNELS": str(args.channels)}
    for round_index in range(args.rounds):
        for row in rows:
            flags, both = ROWS[row]
            for side, (python, cwd, pythonpath, trainer, prefix) in sides.items():
                if side == "upstream" and not both:
                    continue
                name = f"{side}-{list(ROWS).index(row)}-{round_index}"
                log = tmp / f"{name}.log"
                try:
                    report = run_side(python, cwd, pythonpath, trainer,
                                      [*prefix, *common, *flags, "--output_dir", str(tmp / name)], args.threads,
                                      log, child_env)
                except RuntimeError as error:
                    print(f"round {round_index + 1} {row} {side}: FAILED\n{str(error)[-1500:]}", flush=True)
                    last = [line for line in str(error).splitlines() if line.strip()][-1]
                    failures.append(f"round {round_index + 1}, {row}, {side}: `{last.strip()[:300]}`")
                    continue
                shutil.rmtree(tmp / name, ignore_errors=True)
                runs.setdefault((side, row), []).append(per_update(report, args.steps))
                print(f"round {round_index + 1} {row} {side}: {step_seconds(report, args.warmup):.2f} s/step, "
                      f"peak RSS {report['peak_rss_at_last_step_bytes'] / 2**30:.2f} GiB (with the save "
                      f"{report['peak_rss_bytes'] / 2**30:.2f}), load {report['load']}, {report['wall']:.0f} s, "
                      f"{report['ticks_per_update']} LR tick(s) per update",
                      flush=True)
    return runs, failures


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    run_flags(parser, steps=4, warmup=1, threads="1")
    parser.add_argument("--channels", type=int, default=224, help="the U-Net's first width (SDXL: 320)")
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--rows", type=int, nargs="+", default=list(range(len(ROWS))),
                        help=f"which of ROWS to run, by index (0-{len(ROWS) - 1}; 0 always runs)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results"
                        / f"sdxl-finetune-vs-upstream-{time.strftime('%Y-%m-%d')}.md")
    args = parser.parse_args()
    harness_args(parser, args, ".")
    return args


def main() -> int:
    if sys.argv[1:2] == ["--build_model"]:
        build_model(Path(sys.argv[2]), int(sys.argv[3]))
        return 0
    if sys.argv[1:2] == ["--run_upstream"]:
        run_upstream(sys.argv[2], sys.argv[3:])
        return 0
    args = parse()
    rows = [name for index, name in enumerate(ROWS) if index in {0, *args.rows}]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        model, tokenizers, data = prepare(args, tmp)
        common = ["--pretrained_model_name_or_path", str(model), "--tokenizer_cache_dir", str(tokenizers),
                  "--train_data_dir", str(data), "--caption_extension", ".txt", "--resolution",
                  str(args.resolution), "--train_batch_size", "1", "--learning_rate", "1e-5", "--max_train_steps",
                  str(args.steps), "--max_data_loader_n_workers", "0", "--seed", "0", "--cache_latents",
                  "--cache_text_encoder_outputs", "--save_model_as", "safetensors"]
        runs, failures = measure(args, rows, common, tmp)
        shown = shlex.join(common).replace(str(tmp), "<work>")
    _, bf16_line = cpu_bf16()
    command = (f"OMP_NUM_THREADS={args.threads} HF_HUB_OFFLINE=1 .venv/bin/python bench/sdxl_finetune_vs_upstream.py "
               f"{shlex.join(sys.argv[1:])}").rstrip()
    report = "\n\n".join(filter(None, [
        f"# sdxl_train.py against sd-scripts {git_head(args.upstream_dir)}: full fine-tuning of a reduced SDXL U-Net, "
        f"CPU, {time.strftime('%Y-%m-%d %H:%M')}",
        f"How to reproduce (from the repository root; {(time.perf_counter() - started) / 60:.0f} minutes here):"
        f"\n\n    {command}",
        f"{machine()}; CPU: {bf16_line}; ours at {git_head(ROOT)}; upstream venv: "
        f"{upstream_versions(args.upstream_python)}; torch threads {args.threads} on both sides.",
        f"Model: SDXL's U-Net at channels {args.channels}/{2 * args.channels}/{4 * args.channels} (SDXL: "
        "320/640/1280), one transformer layer per attention block (SDXL: 2 and 10), heads 64 wide, context 2048 and "
        "vector 2816 wide; random weights (seed 0) written as a diffusers folder that both sides load (`<work>`: a "
        "temporary folder); small text encoders of SDXL's widths, their outputs cached.",
        f"Same flags on both sides (`--output_dir` aside): `{shown}` plus the row's "
        f"({'; '.join(f'{row}: `{shlex.join(ROWS[row][0])}`' for row in rows)}). Upstream runs unchanged but for "
        "its U-Net class's depth and channels, patched at run time. s/step: median update interval after "
        f"{args.warmup} warm-up updates, median over {args.rounds} interleaved rounds; peak RSS: the process's "
        "high-water mark at its last update (before the final save).",
        table(runs, rows, args.warmup),
        "Failed runs (their last output line): " + "; ".join(failures) if failures else "",
        args.note,
    ]))
    publish(report, args.out, {str(args.peer_dir): "$PEER_DIR"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
