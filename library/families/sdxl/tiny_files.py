"""``builtin:tiny-sdxl`` as files: the real SDXL module layout (DownBlock2D + 2 CrossAttnDownBlock2D with 1/2/10
transformer layers, a 10-layer mid block, 3 layers per up block, size conditioning with 256-wide sinusoids, a
12-layer CLIP-L-shaped and a 32-layer bigG-shaped text encoder), so every LoRA name equals a real SDXL's (986
modules, 1052 with conv_dim); UNet channels (32, 64, 96), text hidden size 32 for both encoders.
``python -m library.tiny_model --sdxl OUT_DIR`` writes it as a ``StableDiffusionXLPipeline`` folder plus
``OUT_DIR/model.safetensors`` in the SGM single-file layout.
"""

from __future__ import annotations

from pathlib import Path

from library.families.model_files import force_offline


def save_sdxl_diffusers_folder(model, out_dir: Path, *, safe_serialization: bool = True) -> None:
    """Write an ``SDXLModel`` as a diffusers StableDiffusionXLPipeline folder."""
    from diffusers import DDPMScheduler, StableDiffusionXLPipeline

    from library.families.tokenizers import as_transformers_tokenizer

    pipe = StableDiffusionXLPipeline(
        vae=model.vae, text_encoder=model.text_encoder, text_encoder_2=model.text_encoder_2,
        tokenizer=as_transformers_tokenizer(model.tokenizer),
        tokenizer_2=as_transformers_tokenizer(model.tokenizer_2), unet=model.unet,
        scheduler=DDPMScheduler.from_config(model.noise_scheduler.config, steps_offset=1),
    )
    pipe.save_pretrained(str(out_dir), safe_serialization=safe_serialization)


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


def write_tiny_files(out_dir: Path) -> str:
    """``python -m library.tiny_model --sdxl OUT_DIR``: what ``write_tiny_sdxl`` wrote."""
    write_tiny_sdxl(out_dir)
    return f"{out_dir} (diffusers folder) and {out_dir / 'model.safetensors'} (single file)"
