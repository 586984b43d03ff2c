"""A tiny, deterministic SD1.5-shaped model for tests and smoke runs (``builtin:tiny-sd15``).

It keeps the real SD 1.x layout, so every LoRA module name equals a real SD1.5's: UNet CrossAttnDownBlock2D×3 +
DownBlock2D, UpBlock2D + CrossAttnUpBlock2D×3, 2 layers per block, one transformer per attention (16 transformer
blocks, 192 LoRA-targeted Linear / 1x1-conv modules), and a 12-layer CLIP text encoder (72 LoRA-targeted Linear
layers). Channels are tiny: UNet (32, 32, 64, 64), cross-attention dim 32, 2 heads; VAE (32, 32, 64, 64), a 64 px
image gives an 8×8 latent; text hidden size 32. Configs: ``library/assets/configs/tiny-sd15``; weights are
generated from a seed, never downloaded or committed.

``python -m library.tiny_model OUT_DIR`` writes a diffusers folder (``StableDiffusionPipeline.from_pretrained``
loads it offline) and ``OUT_DIR/model.safetensors`` in the original single-file (LDM) layout.

``builtin:tiny-sdxl`` is the same idea for SDXL: the real SDXL module layout (DownBlock2D + 2 CrossAttnDownBlock2D
with 1/2/10 transformer layers, a 10-layer mid block, 3 layers per up block, size conditioning with 256-wide
sinusoids, a 12-layer CLIP-L-shaped and a 32-layer bigG-shaped text encoder), so every LoRA name equals a real
SDXL's (986 modules, 1052 with conv_dim); UNet channels (32, 64, 96), text hidden size 32 for both encoders.
``python -m library.tiny_model --sdxl OUT_DIR`` writes it as a ``StableDiffusionXLPipeline`` folder plus
``OUT_DIR/model.safetensors`` in the SGM single-file layout.

``builtin:tiny-flux`` (``library/families/flux/builtin.py``): ``python -m library.tiny_model --flux OUT_DIR`` writes
``flux1-dev.safetensors`` (BFL names), ``clip_l.safetensors``, ``t5xxl.safetensors`` and ``ae.safetensors`` (BFL
names), the four files ``flux_train_network.py`` takes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from library.families.sd.loading import BUILTIN_MODELS, BUILTIN_TINY, build_builtin
from library.families.sd.parts import SDModel, force_offline


def build_tiny_sd15(seed: int = 0) -> SDModel:
    """Build the tiny model with weights drawn from ``seed``; two calls with one seed give identical weights.

    The caller's torch RNG state is left untouched.
    """
    return build_builtin(BUILTIN_TINY, seed)


def save_diffusers_folder(model: SDModel, out_dir: Path) -> None:
    """Write ``model`` as a diffusers StableDiffusionPipeline folder (no safety checker).

    The folder's scheduler gets SD's released ``steps_offset=1`` for inference; training uses ``noise_scheduler``.
    """
    from diffusers import DDPMScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline(
        vae=model.vae,
        text_encoder=model.text_encoder,
        tokenizer=model.tokenizer,
        unet=model.unet,
        scheduler=DDPMScheduler.from_config(model.noise_scheduler.config, steps_offset=1),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(str(out_dir), safe_serialization=True)


def write_tiny_model(out_dir: Path, seed: int = 0) -> SDModel:
    """Write the tiny model to ``out_dir`` as a diffusers folder plus ``model.safetensors`` (LDM layout)."""
    from library.families.sd.single_file import save_checkpoint

    force_offline()
    model = build_tiny_sd15(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_diffusers_folder(model, out_dir)
    save_checkpoint(model, out_dir / "model.safetensors", config_name=BUILTIN_MODELS[BUILTIN_TINY])
    return model


def save_sdxl_diffusers_folder(model, out_dir: Path) -> None:
    """Write an ``SDXLModel`` as a diffusers StableDiffusionXLPipeline folder."""
    from diffusers import DDPMScheduler, StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline(
        vae=model.vae, text_encoder=model.text_encoder, text_encoder_2=model.text_encoder_2,
        tokenizer=model.tokenizer, tokenizer_2=model.tokenizer_2, unet=model.unet,
        scheduler=DDPMScheduler.from_config(model.noise_scheduler.config, steps_offset=1),
    )
    pipe.save_pretrained(str(out_dir), safe_serialization=True)


def write_tiny_sdxl(out_dir: Path, seed: int = 0):
    """Write ``builtin:tiny-sdxl`` to ``out_dir`` as a diffusers folder plus ``model.safetensors`` (SGM layout)."""
    from library.families.sdxl.loading import BUILTIN_SDXL_MODELS, BUILTIN_TINY_SDXL, build_builtin_sdxl
    from library.families.sdxl.single_file import save_sdxl_checkpoint

    force_offline()
    model = build_builtin_sdxl(BUILTIN_TINY_SDXL, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_sdxl_diffusers_folder(model, out_dir)
    save_sdxl_checkpoint(model, out_dir / "model.safetensors", config_name=BUILTIN_SDXL_MODELS[BUILTIN_TINY_SDXL])
    return model


FLUX_FILES = ("flux1-dev.safetensors", "clip_l.safetensors", "t5xxl.safetensors", "ae.safetensors")


def write_tiny_flux(out_dir: Path, seed: int = 0):
    """Write ``builtin:tiny-flux`` as the four files FLUX users have (``FLUX_FILES``: BFL transformer, CLIP-L,
    T5-XXL, BFL AE), for ``--pretrained_model_name_or_path``, ``--clip_l``, ``--t5xxl`` and ``--ae``."""
    from library.families.flux.builtin import BUILTIN_TINY_FLUX, build_builtin_flux
    from library.families.flux.checkpoints import save_transformer
    from library.families.flux.part_files import save_ae, save_clip_l, save_t5xxl

    force_offline()
    model = build_builtin_flux(BUILTIN_TINY_FLUX, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    transformer, clip_l, t5xxl, ae = (out_dir / name for name in FLUX_FILES)
    save_transformer(model.unet, transformer)
    save_clip_l(model.clip_l, clip_l)
    save_t5xxl(model.t5xxl, t5xxl)
    save_ae(model.vae, ae)
    return model


def main(argv: list[str]) -> int:
    kind = argv[0] if argv[:1] in (["--sdxl"], ["--flux"]) else None
    rest = argv[1:] if kind else argv
    if len(rest) != 1 or rest[0].startswith("-"):
        print("usage: python -m library.tiny_model [--sdxl | --flux] OUT_DIR", file=sys.stderr)
        return 2
    out_dir = Path(rest[0])
    if kind == "--flux":
        write_tiny_flux(out_dir)
        print(f"wrote {', '.join(str(out_dir / name) for name in FLUX_FILES)}")
        return 0
    (write_tiny_sdxl if kind else write_tiny_model)(out_dir)
    print(f"wrote {out_dir} (diffusers folder) and {out_dir / 'model.safetensors'} (single file)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
