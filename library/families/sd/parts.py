"""The pieces every Stable Diffusion 1.x / 2.x loader shares: the model bundle, the tokenizer cache folder
(``--tokenizer_cache_dir``), building parts from a config folder and wrapping them with a tokenizer and sd-scripts'
training noise scheduler (``library/families/ddpm_scheduler.py``).

``library/families/sd/loading.py`` (which form a path is, and loading it) and ``library/families/sd/single_file.py``
(the original single-file layout) both build on these; neither imports the other for them. What other families
share with these (bundled configs, seeded weights, freezing, the bundled CLIP tokenizer) is in ``library/families/``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from library.base.errors import UserError
from library.families.ddpm_scheduler import build_noise_scheduler
from library.families.model_parts import freeze
from library.families.tokenizers import CLIP_TOKENIZER, CleanCLIPTokenizer, load_tokenizer

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer


@dataclass
class SDModel:
    """A loaded Stable Diffusion 1.x / 2.x model: the pieces ``train_network.py`` uses."""

    unet: UNet2DConditionModel
    vae: AutoencoderKL
    text_encoder: CLIPTextModel
    tokenizer: CLIPTokenizer
    noise_scheduler: DDPMScheduler
    v2: bool
    v_parameterization: bool
    name: str


# The hub tokenizers sd-scripts' SdTokenizeStrategy loads; their cache folder is named after them ("/" -> "_").
TOKENIZER_IDS = {False: "openai/clip-vit-large-patch14", True: "stabilityai/stable-diffusion-2"}
CLIP_VOCAB_SIZE = 49408  # SD1's CLIP-L and SD2's OpenCLIP-H share the vocabulary


def cached_tokenizer_dir(cache_dir: str | os.PathLike[str], v2: bool) -> Path:
    """``<cache_dir>/openai_clip-vit-large-patch14`` (SD1) or ``<cache_dir>/stabilityai_stable-diffusion-2``."""
    return Path(cache_dir) / TOKENIZER_IDS[v2].replace("/", "_")


def load_cached_tokenizer(cache_dir: str | os.PathLike[str], v2: bool) -> tuple[CLIPTokenizer, str]:
    """``--tokenizer_cache_dir`` as sd-scripts' ``TokenizeStrategy._load_tokenizer``: the tokenizer saved in the
    cache folder when it is there, else the bundled one (what sd-scripts would download), saved there first.

    The saved copy is the bundled vocab.json / merges.txt / configs (SD2's with pad "!"), a layout that both
    transformers 4 (sd-scripts) and 5 read. Returns the tokenizer and a line saying which way it came.
    """
    folder = cached_tokenizer_dir(cache_dir, v2)
    if folder.exists():
        unreadable = (f"--tokenizer_cache_dir {cache_dir}: {folder} is not a readable CLIP tokenizer "
                      "({}); delete that folder to have the bundled tokenizer saved there again")
        has_vocab = (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()
        if not (has_vocab or (folder / "tokenizer.json").is_file()):
            raise UserError(unreadable.format("no vocab.json + merges.txt or tokenizer.json"))
        try:
            tokenizer = CleanCLIPTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError) as exc:
            raise UserError(unreadable.format(exc)) from exc
        if len(tokenizer) != CLIP_VOCAB_SIZE:
            raise UserError(unreadable.format(f"{len(tokenizer)} tokens, CLIP has {CLIP_VOCAB_SIZE}"))
        return tokenizer, f"tokenizer read from the cache {folder}"
    try:
        _save_bundled_tokenizer(folder, v2)
    except OSError as exc:
        raise UserError(f"--tokenizer_cache_dir {cache_dir}: cannot write {folder} ({exc}); give a writable "
                        "folder, or leave the flag out (the tokenizer is bundled)") from exc
    return load_tokenizer(v2), f"bundled tokenizer saved to the cache {folder}"


def _save_bundled_tokenizer(folder: Path, v2: bool) -> None:
    """Copy the bundled tokenizer into ``folder`` through a temporary sibling, so no reader sees half of it."""
    import json
    import shutil
    import tempfile

    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        for file in CLIP_TOKENIZER.iterdir():
            if file.suffix in (".json", ".txt"):
                shutil.copyfile(file, staging / file.name)
        if v2:
            for name in ("tokenizer_config.json", "special_tokens_map.json"):
                config = json.loads((staging / name).read_text(encoding="utf-8"))
                config["pad_token"] = "!"
                (staging / name).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        try:
            staging.rename(folder)
        except OSError:
            if not folder.is_dir():  # another process saving at the same time is fine
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def build_from_config(config: Path, *, empty: bool) -> tuple[UNet2DConditionModel, AutoencoderKL, CLIPTextModel]:
    """UNet, VAE and text encoder from a diffusers-style config folder.

    ``empty=True`` builds them on the meta device (no memory, no init time) to be filled with
    ``load_state_dict(..., assign=True)``; otherwise weights are randomly initialised from torch's current RNG.
    """
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    context = init_empty_weights() if empty else contextlib.nullcontext()
    with context:
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(str(config / "unet")))
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(str(config / "vae")))
        text_encoder = CLIPTextModel(CLIPTextConfig.from_json_file(str(config / "text_encoder" / "config.json")))
    return unet, vae, text_encoder


def assemble(
    unet: UNet2DConditionModel,
    vae: AutoencoderKL,
    text_encoder: CLIPTextModel,
    *,
    v2: bool,
    v_parameterization: bool,
    name: str,
    tokenizer: CLIPTokenizer | None = None,
) -> SDModel:
    """Freeze the parts (eval, no grad) and wrap them with a tokenizer and sd-scripts' training scheduler."""
    for part in (unet, vae, text_encoder):
        freeze(part)
    return SDModel(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer if tokenizer is not None else load_tokenizer(v2),
        noise_scheduler=build_noise_scheduler(v_parameterization),
        v2=v2,
        v_parameterization=v_parameterization,
        name=name,
    )


def check_v2_flag(path: Path, *, file_is_v2: bool, v2: bool) -> None:
    """``--v2`` must agree with the model's text encoder (OpenCLIP-H for SD2, CLIP-L for SD1)."""
    if file_is_v2 and not v2:
        raise UserError(
            f"--pretrained_model_name_or_path {path} is a Stable Diffusion 2.x model (OpenCLIP-H text encoder); "
            "add --v2 (and --v_parameterization for 768-v models such as SD 2.0-768 / 2.1)"
        )
    if v2 and not file_is_v2:
        raise UserError(
            f"--pretrained_model_name_or_path {path} is a Stable Diffusion 1.x model (CLIP-L text encoder) "
            "but --v2 was given; remove --v2"
        )
