"""``builtin:tiny-sd15`` as files: a tiny, deterministic SD1.5-shaped model for tests and smoke runs.

It keeps the real SD 1.x layout, so every LoRA module name equals a real SD1.5's: UNet CrossAttnDownBlock2D×3 +
DownBlock2D, UpBlock2D + CrossAttnUpBlock2D×3, 2 layers per block, one transformer per attention (16 transformer
blocks, 192 LoRA-targeted Linear / 1x1-conv modules), and a 12-layer CLIP text encoder (72 LoRA-targeted Linear
layers). Channels are tiny: UNet (32, 32, 64, 64), cross-attention dim 32, 2 heads; VAE (32, 32, 64, 64), a 64 px
image gives an 8×8 latent; text hidden size 32. Configs: ``library/assets/configs/tiny-sd15``; weights are
generated from a seed, never downloaded or committed. ``python -m library.tiny_model OUT_DIR`` writes a diffusers
folder (``StableDiffusionPipeline.from_pretrained`` loads it offline) and ``OUT_DIR/model.safetensors`` in the
original single-file (LDM) layout.
"""

from __future__ import annotations

from pathlib import Path

from library.families.model_files import force_offline
from library.families.sd.loading import BUILTIN_MODELS, BUILTIN_TINY, build_builtin
from library.families.sd.parts import SDModel


def build_tiny_sd15(seed: int = 0) -> SDModel:
    """Build the tiny model with weights drawn from ``seed``; two calls with one seed give identical weights.

    The caller's torch RNG state is left untouched.
    """
    return build_builtin(BUILTIN_TINY, seed)


def save_diffusers_folder(model: SDModel, out_dir: Path, *, safe_serialization: bool = True) -> None:
    """Write ``model`` as a diffusers StableDiffusionPipeline folder (no safety checker).

    The folder's scheduler gets SD's released ``steps_offset=1`` for inference; training uses ``noise_scheduler``.
    """
    from diffusers import DDPMScheduler, StableDiffusionPipeline

    from library.families.tokenizers import as_transformers_tokenizer

    pipe = StableDiffusionPipeline(
        vae=model.vae,
        text_encoder=model.text_encoder,
        tokenizer=as_transformers_tokenizer(model.tokenizer),
        unet=model.unet,
        scheduler=DDPMScheduler.from_config(model.noise_scheduler.config, steps_offset=1),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(str(out_dir), safe_serialization=safe_serialization)


def write_tiny_model(out_dir: Path, seed: int = 0) -> SDModel:
    """Write the tiny model to ``out_dir`` as a diffusers folder plus ``model.safetensors`` (LDM layout)."""
    from library.families.sd.single_file import save_checkpoint

    force_offline()
    model = build_tiny_sd15(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_diffusers_folder(model, out_dir)
    save_checkpoint(model, out_dir / "model.safetensors", config_name=BUILTIN_MODELS[BUILTIN_TINY])
    return model


def write_tiny_files(out_dir: Path) -> str:
    """``python -m library.tiny_model OUT_DIR``: what ``write_tiny_model`` wrote."""
    write_tiny_model(out_dir)
    return f"{out_dir} (diffusers folder) and {out_dir / 'model.safetensors'} (single file)"
