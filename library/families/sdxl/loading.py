"""Loading Stable Diffusion XL models, always offline.

``load_sdxl_model`` accepts what sd-scripts' ``sdxl_train_network.py --pretrained_model_name_or_path`` accepts
locally (``library/sdxl_train_util.py`` ``_load_target_model``): a diffusers ``StableDiffusionXLPipeline`` folder or
a single-file checkpoint in the original (SGM) layout (``library/families/sdxl/single_file.py``), plus two built-ins:
``builtin:tiny-sdxl`` (tiny channels, the real SDXL module layout, so LoRA names equal a real SDXL's) and
``builtin:sdxl-random`` (the real architecture with random weights, for benchmarks). Hub ids are refused.

Differences from upstream, on purpose: the UNet stays a diffusers ``UNet2DConditionModel`` (upstream converts it
to its own ``SdxlUNet2DConditionModel``); LoRA modules still get upstream's original-layout names
(``networks/families.py``). Both tokenizers are the bundled CLIP BPE tokenizer, as upstream loads them from the hub
(openai/clip-vit-large-patch14 and laion/CLIP-ViT-bigG-14-laion2B-39B-b160k share the vocabulary); the second one
pads with id 0 ("!"), as upstream sets ``tokenizer2.pad_token_id = 0``. The training noise scheduler is SD's, as
upstream's (``library/families/ddpm_scheduler.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from library.base.errors import UserError
from library.families.ddpm_scheduler import build_noise_scheduler
from library.families.model_files import SUFFIXES, force_offline
from library.families.model_parts import config_dir, seeded
from library.families.sdxl.parts import SDXLModel, assemble_sdxl, build_sdxl_from_config

if TYPE_CHECKING:
    import torch

BUILTIN_TINY_SDXL = "builtin:tiny-sdxl"
BUILTIN_SDXL_MODELS = {BUILTIN_TINY_SDXL: "tiny-sdxl", "builtin:sdxl-random": "sdxl"}
SDXL_ACCEPTED_FORMS = (
    f'{" or ".join(BUILTIN_SDXL_MODELS)}, a diffusers SDXL folder (with model_index.json, unet/, vae/, '
    "text_encoder/, text_encoder_2/), or a single-file SDXL checkpoint (.safetensors, .ckpt)"
)
SDXL_PARTS = ("unet", "vae", "text_encoder", "text_encoder_2")


def build_builtin_sdxl(name: str, seed: int = 0, *, empty: bool = False,
                       dtype: torch.dtype | None = None) -> SDXLModel:
    """A built-in SDXL (``BUILTIN_SDXL_MODELS``) with weights drawn from ``seed``; the caller's RNG is untouched.
    ``empty`` builds it on the meta device (names and shapes only); ``dtype`` creates the weights in that dtype
    (the real architecture is 14 GB in fp32, 7 GB in bf16)."""
    import torch

    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype or default)
        with seeded(seed):
            parts = build_sdxl_from_config(config_dir(BUILTIN_SDXL_MODELS[name]), empty=empty)
    finally:
        torch.set_default_dtype(default)
    return assemble_sdxl(*parts, name=name)


def _load_diffusers_folder(path: Path) -> SDXLModel:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    missing = [sub for sub in SDXL_PARTS if not (path / sub).is_dir()]
    if missing:
        raise UserError(f"--pretrained_model_name_or_path {path}: diffusers folder lacks {', '.join(missing)}/; an "
                        f"SDXL pipeline folder has all of {', '.join(SDXL_PARTS)} (SD 1.x/2.x: use train_network.py)")
    unet = UNet2DConditionModel.from_pretrained(str(path), subfolder="unet", local_files_only=True)
    if unet.config.addition_embed_type != "text_time":
        raise UserError(f"--pretrained_model_name_or_path {path}: its UNet has no size conditioning, so it is not an "
                        "SDXL UNet; train SD 1.x/2.x models with train_network.py")
    vae = AutoencoderKL.from_pretrained(str(path), subfolder="vae", local_files_only=True)
    te1 = CLIPTextModel.from_pretrained(str(path), subfolder="text_encoder", local_files_only=True)
    te2 = CLIPTextModelWithProjection.from_pretrained(str(path), subfolder="text_encoder_2", local_files_only=True)
    return assemble_sdxl(unet, vae, te1, te2, name=str(path))


def load_sdxl_model(path: str, *, vae: str | None = None, disable_mmap: bool = False,
                    random_dtype: torch.dtype | None = None, v_parameterization: bool = False) -> SDXLModel:
    """Load an SDXL model for LoRA training, offline (fp32, as upstream; the precision policy casts later).

    ``vae`` replaces the VAE (``--vae``); ``disable_mmap`` reads a single file into memory in one go instead of
    memory-mapping it (``--disable_mmap_load_safetensors``). ``builtin:sdxl-random`` is created directly in
    ``random_dtype`` (the frozen weight dtype): its random weights need no fp32 copy. ``v_parameterization``
    (``--v_parameterization``, v-prediction SDXL models such as NoobAI-XL v-pred): the model predicts velocity and
    the training scheduler says so, as sd-scripts' shared ``train_network.py`` loss for SDXL.
    """
    from library.families.sdxl import single_file
    from library.families.vae_files import replace_vae

    force_offline()
    if path == BUILTIN_TINY_SDXL:
        model = build_builtin_sdxl(path)
    elif path in BUILTIN_SDXL_MODELS:
        model = build_builtin_sdxl(path, dtype=random_dtype)
    else:
        p = Path(path)
        if p.is_dir():
            if not (p / "model_index.json").is_file():
                raise UserError(f"--pretrained_model_name_or_path {p}: folder has no model_index.json, so it is not "
                                f"a diffusers pipeline; accepted: {SDXL_ACCEPTED_FORMS}")
            model = _load_diffusers_folder(p)
        elif p.is_file():
            if p.suffix.lower() not in SUFFIXES:
                raise UserError(f"--pretrained_model_name_or_path {p}: unknown file type {p.suffix!r}; "
                                f"accepted: {SDXL_ACCEPTED_FORMS}")
            model = single_file.load_sdxl_checkpoint(p, mmap=not disable_mmap)
        else:
            raise UserError(f"--pretrained_model_name_or_path {p}: no such file or folder (hub ids are not "
                            f"downloaded: give a local copy); accepted: {SDXL_ACCEPTED_FORMS}")
    if vae is not None:
        replace_vae(model, vae)
    model.v_parameterization = v_parameterization
    model.noise_scheduler = build_noise_scheduler(v_parameterization)
    return model
