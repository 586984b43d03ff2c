"""The caches of the data stage, filled with the frozen model: latents from the VAE (``--cache_latents``) and the
text encoders' outputs (``--cache_text_encoder_outputs``), each encoded once before training, as sd-scripts does.

What is cached is checked on the host as it is made (the encoders' outputs are on the CPU then anyway): NaN or Inf
from the VAE or the text encoders stops the run (``UserError``) before any cache file holds it, as sd-scripts'
``cache_batch_latents`` refuses NaN latents. Disk cache files are checked when they are validated
(``library/data/latent_cache``, ``text_cache``; the text encoders' output shapes are measured here for that).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from library.base.errors import UserError
from library.config import DataConfig
from library.data.cache_progress import QUIET, CacheProgress
from library.data.latent_cache import LatentFiles
from library.data.text_cache import ArrayNames
from library.families.base import ModelFamily
from library.families.precision import PrecisionPolicy

if TYPE_CHECKING:
    from library.families.spec import FamilySpec


def release_cached_memory(device: torch.device, highvram: bool) -> None:
    """After a latent-caching batch: empty the CUDA memory cache unless ``--highvram`` (sd-scripts'
    ``clean_memory_on_device`` unless ``HIGH_VRAM``); the CPU keeps no such cache."""
    if device.type == "cuda" and not highvram:
        torch.cuda.empty_cache()


def cache_latents(data, model: Any, policy: PrecisionPolicy, device: torch.device, cfg: DataConfig,
                  files: LatentFiles, highvram: bool = False, share: Callable[[int], bool] | None = None,
                  wait: Callable[[], None] = lambda: None, progress: CacheProgress = QUIET,
                  generator: torch.Generator | None = None) -> None:
    """Encode every image once (``--cache_latents``), then move the VAE off the training device. As sd-scripts,
    the CUDA cache is emptied after each VAE batch unless ``--highvram``. ``files``: the family's cache file name
    suffix and latent channels; ``generator``: where the VAE posterior samples come from (``latent_generator``;
    None: torch's global generator); ``share`` and ``wait`` split a disk cache between processes
    (``TrainData.cache_latents``); ``progress``: the bar and the check before each batch
    (``library/data/cache_progress.py``); the processes leave through ``wait`` together."""
    vae = model.vae

    @torch.no_grad()
    def encode(images: torch.Tensor) -> torch.Tensor:
        posterior = vae.encode(images.to(device, policy.vae_dtype)).latent_dist
        latents = posterior.sample(generator=generator).float().cpu()
        release_cached_memory(device, highvram)
        if not torch.isfinite(latents).all():  # on the CPU already: no extra wait for the device
            fix = ("VAEs can overflow in fp16 (SDXL's does): add --no_half_vae (or use a VAE fixed for fp16)"
                   if policy.vae_dtype == torch.float16 else "check the VAE's weights (--vae)")
            raise UserError(f"the VAE ({str(policy.vae_dtype).removeprefix('torch.')}) turned images into NaN/Inf "
                            f"latents, which cannot be cached; {fix}")
        return latents

    # Identify the VAE by its weights (the first tensors are enough to tell VAEs apart) and dtype, so that a cache
    # written with another VAE (--vae, another checkpoint, fp16 vs fp32) is rebuilt.
    digest = hashlib.sha1(str(vae.dtype).encode())
    for param in list(vae.parameters())[:4]:
        digest.update(param.detach().float().cpu().numpy().tobytes())
    vae_id = digest.hexdigest()[:16]
    data.cache_latents(progress.watch(encode), to_disk=cfg.cache_latents_to_disk, vae_id=vae_id,
                       batch_size=cfg.vae_batch_size, files=files, share=share, wait=wait, progress=progress)
    wait()
    vae.to("cpu")


def latent_generator(seed: int, device: torch.device, cpu_draws: int) -> torch.Generator:
    """The generator of the latent cache's VAE posterior samples, so that a seeded run caches upstream's latents.
    Upstream ``train_network.py`` calls ``set_seed(seed)``, loads the model, then caches (``new_cache_latents``,
    ``strategy_sd.cache_batch_latents``: ``latent_dist.sample()``) with torch's global generator of the VAE's device,
    one draw per batch of ``--vae_batch_size`` images of a bucket, smallest buckets first, the training images
    before the validation images, as ``TrainData.cache_latents`` encodes them; disk or RAM alike.

    On CUDA nothing drew from that generator before (upstream builds its models on the CPU), so a CUDA generator
    seeded with ``seed`` continues alike. On the CPU upstream's loading drew ``cpu_draws`` numbers first
    (``ModelFamily.upstream_draws_before_latents``): upstream's global CPU stream is the only way to match there, so
    this is a CPU generator seeded alike and advanced by as many uniform draws (seconds for the 859 million of an
    SD 1.5 U-Net). Torch's global generators are left as they were."""
    generator = torch.Generator(device).manual_seed(seed)
    remaining = cpu_draws if device.type == "cpu" else 0
    block = torch.empty(min(remaining, 1 << 22))
    while remaining:
        count = min(remaining, block.numel())
        block[:count].uniform_(generator=generator)  # one 32-bit draw per float32 element, as upstream's init
        remaining -= count
    return generator


ID_CHUNK = 1 << 22  # elements hashed at a time (16 MB in fp32)


def module_id(*modules: torch.nn.Module) -> str:
    """Identify frozen models by their weights (the first tensors are enough to tell checkpoints apart) and dtype,
    so that a cache written with other text encoders (another checkpoint, fp16 vs fp32) is rebuilt. Hashed in
    chunks of ``ID_CHUNK`` elements: a whole fp32 copy of Qwen3's 151,936 x 1,024 embedding and its bytes would add
    1.2 GB to the run's peak host memory."""
    digest = hashlib.sha1()
    for module in modules:
        digest.update(str(next(module.parameters()).dtype).encode())
        for param in list(module.parameters())[:4]:
            flat = param.detach().reshape(-1)
            for start in range(0, flat.numel(), ID_CHUNK):
                digest.update(flat[start:start + ID_CHUNK].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def cache_text_encoder_outputs(data, model, family: ModelFamily, policy: PrecisionPolicy, device: torch.device,
                               to_disk: bool, max_token_length: int | None, batch_size: int, record: FamilySpec,
                               weighted: bool = False, share: Callable[[int], bool] | None = None,
                               wait: Callable[[], None] = lambda: None, progress: CacheProgress = QUIET) -> None:
    """``--cache_text_encoder_outputs``: encode every caption once with the frozen text encoders (in RAM, or with
    ``--cache_text_encoder_outputs_to_disk`` in ``<image>`` + ``text_cache_suffix`` files, of the family's
    ``record``; with its ``cached_caption_dropout`` a subset may have ``caption_dropout_rate``), the held-out
    validation images' too, then move the encoders to the CPU, as sd-scripts does; the network must train the denoiser
    only (checked before loading). With ``weighted`` (``--weighted_captions``) the weighted outputs are cached, as
    sd-scripts' ``is_weighted`` caching strategy. ``share`` and ``wait`` split a disk cache between processes
    (``TrainData.cache_text_encoder_outputs``); ``progress`` as for ``cache_latents``."""
    text_encoders = family.text_encoders(model)

    @torch.no_grad()
    def encode(captions: list[str]) -> dict[str, torch.Tensor]:
        with policy.autocast(device):
            cond = family.encode(model, captions, device, clip_skip=None, max_token_length=max_token_length,
                                 weighted=weighted)
        outputs = family.to_cache(cond)  # float32 on the CPU
        bad = [name for name, t in outputs.items() if not torch.isfinite(t).all()]
        if bad:
            raise UserError(f"the text encoders gave NaN/Inf ({', '.join(bad)}) for a batch of captions (the first: "
                            f"{captions[0]!r}), which cannot be cached; fp16 can overflow: try --mixed_precision bf16 "
                            "or no, or check the text encoders' weights")
        return outputs

    names = ArrayNames(family.cache_names, output_shapes(encode, device) if to_disk else None,
                       record.text_cache_suffix)
    data.cache_text_encoder_outputs(progress.watch(encode), to_disk=to_disk, encoder_id=module_id(*text_encoders),
                                    max_token_length=max_token_length, names=names, batch_size=batch_size,
                                    weighted=weighted, share=share, wait=wait, progress=progress,
                                    cached_dropout=record.cached_caption_dropout)
    wait()
    for text_encoder in text_encoders:
        text_encoder.to("cpu")


def output_shapes(encode: Callable[[list[str]], dict[str, torch.Tensor]],
                  device: torch.device) -> dict[str, tuple[int, ...]]:
    """The shape of each cached text encoder output for one caption, from encoding an empty one: every caption gives
    the same, as the tokens are padded to ``--max_token_length`` (sd-scripts pads alike). Torch's random streams are
    left as they were, so that the run trains the same as without the measurement."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        sample = encode([""])
    return {name: tuple(t.shape[1:]) for name, t in sample.items()}
