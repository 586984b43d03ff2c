"""The pieces of a FLUX.1 model besides the transformer: the bundle (``FluxModel``), the bundled text-encoder and
AE configs, the tokenizers, and building each part from its config (random or empty weights).

Configs (``library/assets/configs/flux`` and ``tiny-flux``): ``clip_l.json`` is the CLIP-L upstream sd-scripts'
``flux_utils.load_clip_l`` builds: its config dict names ``hidden_act`` twice, so under transformers 4 the effective
activation is ``gelu`` (not CLIP's ``quick_gelu``), and ``eos_token_id`` 2 selects argmax pooling; we keep both so
text conditioning equals upstream's. ``t5xxl.json`` is ``flux_utils.load_t5xxl``'s T5-XXL encoder (gated-gelu,
d_model 4096, 24 layers). ``ae.json`` is BFL's AE as a diffusers ``AutoencoderKL`` (16 latent channels, no quant
convs, ``scaling_factor`` 0.3611, ``shift_factor`` 0.1159, ``flux_models.configs["dev"].ae_params``).

Tokenizers: CLIP-L is the bundled CLIP BPE tokenizer of SD 1.x (``library/assets/clip_tokenizer``, the
openai/clip-vit-large-patch14 vocabulary upstream's ``FluxTokenizeStrategy`` loads). T5 is
``library/assets/t5_tokenizer/tokenizer.json``: the google/t5-v1_1-xxl vocabulary (32,100 tokens, Apache-2.0) as
upstream sd-scripts bundles it in ``configs/t5_old/tokenizer.json``; it loads with the ``tokenizers`` library
alone (no sentencepiece) and gives the hub tokenizer's ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from library.families.flux.chroma import ChromaTransformer
from library.families.flux.model import FluxTransformer
from library.families.model_parts import freeze
from library.families.tokenizers import load_tokenizer

if TYPE_CHECKING:
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

ASSETS = Path(__file__).resolve().parents[2] / "assets"
T5_TOKENIZER_FILE = ASSETS / "t5_tokenizer" / "tokenizer.json"
REAL_CONFIGS = "flux"
TINY_CONFIGS = "tiny-flux"
PART_CONFIGS = ("clip_l", "t5xxl", "ae")


@dataclass
class FluxModel:
    """A loaded FLUX.1 model: what ``flux_train_network.py`` uses (``load_target_model`` + tokenizers). The
    transformer is ``unet`` and the AE ``vae``: the names the trainer gives every family's denoiser and autoencoder
    (upstream's ``train_network.py`` passes the FLUX transformer as its ``unet`` too)."""

    unet: FluxTransformer | ChromaTransformer
    clip_l: CLIPTextModel | None  # None (both) once released after caching (``FluxFamily.release_text_encoders``)
    t5xxl: T5EncoderModel | None
    vae: AutoencoderKL
    clip_tokenizer: CLIPTokenizer
    t5_tokenizer: T5TokenizerFast
    name: str
    t5_max_length: int | None = None  # --t5xxl_max_token_length (None: 512 for dev, 256 for schnell)
    apply_t5_attn_mask: bool = False  # --apply_t5_attn_mask
    guidance_scale: float = 3.5  # --guidance_scale, the training steps' guidance input (dev)
    t5_file_fp8: bool = False  # T5-XXL's file stores its Linear weights in float8_e4m3fn
    # the sample prompts' text inputs, encoded before the text encoders were released: (prompt, negative) -> inputs
    sample_conditioning: dict[tuple[str, str | None], dict[str, Any]] = field(default_factory=dict)

    @property
    def is_schnell(self) -> bool:
        return self.unet.is_schnell

    @property
    def is_chroma(self) -> bool:
        """Chroma's transformer (``--model_type chroma``), not FLUX.1's."""
        return isinstance(self.unet, ChromaTransformer)


def part_config(configs: str, part: str, **overrides) -> dict:
    """The bundled config dict ``library/assets/configs/<configs>/<part>.json`` with ``overrides`` applied."""
    path = ASSETS / "configs" / configs / f"{part}.json"
    if not path.is_file():
        raise FileNotFoundError(f"bundled config {path} is missing; the checkout is incomplete")
    return {**json.loads(path.read_text(encoding="utf-8")), **overrides}


def build_clip_l(config: dict) -> CLIPTextModel:
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(CLIPTextConfig(**config))


def build_t5xxl(config: dict) -> T5EncoderModel:
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(**config))


def build_ae(config: dict) -> AutoencoderKL:
    from diffusers import AutoencoderKL

    return AutoencoderKL.from_config({k: v for k, v in config.items() if not k.startswith("_")})


def load_clip_tokenizer() -> CLIPTokenizer:
    """The CLIP-L tokenizer (pad ``<|endoftext|>``, 77 tokens), bundled."""
    return load_tokenizer(v2=False)


def load_t5_tokenizer() -> T5TokenizerFast:
    """The T5-XXL tokenizer (google/t5-v1_1-xxl vocabulary, pad ``<pad>`` id 0, eos ``</s>`` id 1), bundled."""
    from transformers import T5TokenizerFast

    if not T5_TOKENIZER_FILE.is_file():
        raise FileNotFoundError(f"bundled T5 tokenizer {T5_TOKENIZER_FILE} is missing; the checkout is incomplete")
    return T5TokenizerFast(tokenizer_file=str(T5_TOKENIZER_FILE))


def assemble(transformer: FluxTransformer, clip_l, t5xxl, ae, *, name: str) -> FluxModel:
    """Freeze the parts and bundle them with the bundled tokenizers."""
    for part in (transformer, clip_l, t5xxl, ae):
        freeze(part)
    return FluxModel(unet=transformer, clip_l=clip_l, t5xxl=t5xxl, vae=ae,
                     clip_tokenizer=load_clip_tokenizer(), t5_tokenizer=load_t5_tokenizer(), name=name)
