"""Anima's VAE (``library/families/anima/vae.py``: diffusers' ``AutoencoderKLQwenImage``) against upstream sd-scripts
48d368fa's ``qwen_image_autoencoder_kl``: the file's key names, the loader, the training-latent normalization,
decoding, ``--vae_chunk_size`` and ``--vae_disable_cache``.

Reference: ``tests/data/upstream_anima_vae.safetensors`` / ``.json``, written by ``tests/data/upstream_anima_vae.py``
in upstream's venv: upstream's fixed config, its 123-entry rename map, the real model's 194 keys in diffusers' and in
the file's (ComfyUI / Wan) names, and a tiny VAE (the real config at ``base_dim`` 4) with seeded bf16-valued weights
in the file's names, its latents of seeded pixels, its decoding of seeded latents and the tensors in between, in fp32
and bf16, and the convolution input shapes of a chunked encode and decode.

On the CPU that wrote the data every fp32 result here equalled upstream's bit for bit (chunked and cache-less ones
too); the tests allow fp32 rounding (relative 1e-5 of each tensor's largest value) for other CPUs' kernels. In
bf16 diffusers 0.42 normalizes its RMS norms in fp32 where upstream normalizes in bf16: with upstream's norm patched
in, bf16 results equal too; as shipped they differ by bf16 rounding (about 2 % of the largest value here).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from library.base.errors import UserError
from library.families.anima import vae as anima_vae
from library.families.model_files import CONFIG_METADATA_KEY
from tests import parity

DATA = Path(__file__).resolve().parents[3] / "data"
FACTS = json.loads((DATA / "upstream_anima_vae.json").read_text())
REF = load_file(str(DATA / "upstream_anima_vae.safetensors"))
FILE_WEIGHTS = {k.removeprefix("vae."): v for k, v in REF.items() if k.startswith("vae.")}
BF16_NORM_RTOL = 5e-2
BF16_ULPS_RTOL = 2.0**-7  # two bf16 ulps at the largest value: another CPU's bf16 kernels (AVX2) round otherwise


close = partial(parity.close, same_dtype=True)  # within ``rtol`` (default fp32's) of the largest value, same dtype


def upstream_rename(key: str) -> str:
    """Upstream's ``convert_comfyui_state_dict`` rule on one key, with its stored map."""
    prefix = key.rsplit(".", 1)[0]
    mapped = FACTS["key_map"].get(prefix)
    return key if mapped is None else key.replace(prefix, mapped)


def write(path: Path, state: dict, config: dict | None = anima_vae.TINY_CONFIG) -> Path:
    save_file(state, str(path), metadata=None if config is None else {CONFIG_METADATA_KEY: json.dumps(config)})
    return path


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> Path:
    """Upstream's tiny weights in the file's names, our config in the metadata."""
    return write(tmp_path_factory.mktemp("vae") / "tiny_vae.safetensors", FILE_WEIGHTS)


@pytest.fixture(scope="module")
def vae(tiny_file):
    return anima_vae.load_vae(tiny_file, dtype=torch.float32)


def encode_decode(vae) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return anima_vae.encode_pixels(vae, REF["pixels"]), anima_vae.decode_latents(vae, REF["noise_latents"])


def test_configs_are_upstreams():
    upstream = {k: v for k, v in FACTS["real_config"].items() if not k.startswith("_")}
    ours = {k: v for k, v in anima_vae.REAL_CONFIG.items() if k != "input_channels"}
    assert ours == upstream and anima_vae.REAL_CONFIG["input_channels"] == 3  # load_vae's default
    assert {k: v for k, v in anima_vae.TINY_CONFIG.items() if k != "input_channels"} == {
        k: v for k, v in FACTS["tiny_config"].items() if not k.startswith("_")}
    assert list(anima_vae.LATENTS_MEAN) == upstream["latents_mean"]
    assert list(anima_vae.LATENTS_STD) == upstream["latents_std"]


def test_real_file_keys_map_onto_diffusers_model():
    """Every key of the official file (derived from upstream's map) names a tensor of diffusers' real model with
    its shape: 0 missing, 0 unexpected, on the meta device."""
    file_shapes = dict(FACTS["real_file_keys"])
    assert len(file_shapes) == 194
    assert anima_vae.FILE_MARK in file_shapes
    renamed = anima_vae.from_file_names({k: torch.empty(s, device="meta") for k, s in file_shapes.items()})
    with torch.device("meta"):
        model = anima_vae.build_vae()
    result = model.load_state_dict(renamed, strict=False, assign=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert {k: list(v.shape) for k, v in model.state_dict().items()} == dict(FACTS["real_state_shapes"])
    assert sum(p.numel() for p in model.parameters()) == FACTS["real_parameters"] == 126_892_531


def test_rename_rule_equals_upstreams_map():
    """Our rule gives upstream's name for every key of the real file and every entry of the map, and
    ``file_key`` inverts it on every model key."""
    file_keys = [k for k, _ in FACTS["real_file_keys"]]
    assert [anima_vae.diffusers_key(k) for k in file_keys] == [upstream_rename(k) for k in file_keys]
    assert [k for k, _ in FACTS["real_state_shapes"]] == [upstream_rename(k) for k in file_keys]
    assert len(FACTS["key_map"]) == 123
    for theirs, ours in FACTS["key_map"].items():
        assert anima_vae.diffusers_key(f"{theirs}.weight") == f"{ours}.weight"
    assert [anima_vae.file_key(k) for k, _ in FACTS["real_state_shapes"]] == file_keys
    assert anima_vae.from_file_names({"quant_conv.bias": 1}) == {"quant_conv.bias": 1}  # diffusers names kept


def test_loaded_weights_are_the_files(vae):
    state = vae.state_dict()
    assert len(state) == 194 and not any(t.is_meta for t in state.values())
    for name, tensor in FILE_WEIGHTS.items():
        assert torch.equal(state[anima_vae.diffusers_key(name)], tensor.float()), name
    assert not any(p.requires_grad for p in vae.parameters()) and not vae.training


def test_encode_equals_upstream(vae):
    """Training latents (``encode_pixels_to_latents``): 4D in, 4D out, normalized as upstream."""
    with torch.no_grad():
        raw = vae.encode(REF["pixels"].unsqueeze(2)).latent_dist.mode()
    assert close(raw, REF["raw_mode"])
    latents, _ = encode_decode(vae)
    assert latents.shape == (2, 16, 4, 3) and close(latents, REF["latents"])
    assert torch.equal(anima_vae.normalize_latents(vae, REF["raw_mode"]).squeeze(2), REF["latents"])
    with torch.no_grad():
        five_d = anima_vae.encode_pixels(vae, REF["pixels"].unsqueeze(2))
    assert five_d.shape == (2, 16, 1, 4, 3) and torch.equal(five_d.squeeze(2), latents)


def test_decode_equals_upstream(vae):
    """``decode_to_pixels``: the decoder gets upstream's denormalized latents, the pixels equal, 5D stays 5D and 4D
    latents give 4D pixels."""
    assert torch.equal(anima_vae.denormalize_latents(vae, REF["noise_latents"]), REF["decode_input"])
    _, pixels = encode_decode(vae)
    assert pixels.shape == (2, 3, 1, 32, 24) and close(pixels, REF["decoded"])
    assert pixels.abs().max() <= 1.0
    with torch.no_grad():
        flat = anima_vae.decode_latents(vae, REF["noise_latents"].squeeze(2))
    assert flat.shape == (2, 3, 32, 24) and torch.equal(flat, pixels.squeeze(2))


def upstream_rms_norm(self, x):
    """Upstream's ``QwenImageRMS_norm.forward``: the normalization in the input's dtype."""
    return F.normalize(x, dim=(1 if self.channel_first else -1)) * self.scale * self.gamma + self.bias


def test_bf16_equals_upstream_but_for_the_rms_norm(tiny_file, monkeypatch):
    """The VAE cast to bf16 as the trainers cast it: normalization in bf16 exact; with upstream's bf16 RMS norm the
    outputs equal upstream's (bit for bit on the CPU that wrote the data; within two bf16 ulps on an AVX2 one), with
    diffusers' fp32 one they differ by up to a few per cent (bf16 rounding carried through the layers)."""
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageRMS_norm

    vae = anima_vae.load_vae(tiny_file, dtype=torch.bfloat16)
    assert torch.equal(anima_vae.normalize_latents(vae, REF["raw_mode_bf16"]).squeeze(2), REF["latents_bf16"])
    assert torch.equal(anima_vae.denormalize_latents(vae, REF["noise_latents"].bfloat16()),
                       REF["decode_input_bf16"])
    latents, pixels = encode_decode(vae)
    assert latents.dtype == pixels.dtype == torch.bfloat16
    assert close(latents, REF["latents_bf16"], BF16_NORM_RTOL) and close(pixels, REF["decoded_bf16"], BF16_NORM_RTOL)
    monkeypatch.setattr(QwenImageRMS_norm, "forward", upstream_rms_norm)
    latents, pixels = encode_decode(vae)
    assert close(latents, REF["latents_bf16"], BF16_ULPS_RTOL) and close(pixels, REF["decoded_bf16"], BF16_ULPS_RTOL)


def conv_inputs(vae, monkeypatch) -> dict[str, list]:
    """The input shape of every 2D / 3D convolution of an encode and a decode (the bands when chunked)."""
    calls: dict[str, list] = {}
    originals = {"conv2d": F.conv2d, "conv3d": F.conv3d}
    for step in ("encode", "decode"):
        seen = calls[step] = []
        for kind, function in originals.items():
            def spy(x, *args, _kind=kind, _function=function, _seen=seen, **kwargs):
                _seen.append([_kind, list(x.shape)])
                return _function(x, *args, **kwargs)
            monkeypatch.setattr(F, kind, spy)
        with torch.no_grad():
            if step == "encode":
                anima_vae.encode_pixels(vae, REF["pixels"])
            else:
                anima_vae.decode_latents(vae, REF["noise_latents"])
        for kind, function in originals.items():
            monkeypatch.setattr(F, kind, function)
    return calls


def test_chunking_cuts_upstreams_bands(tiny_file, monkeypatch):
    """``--vae_chunk_size 5`` (made 6, as upstream): the same convolutions on the same bands as upstream, the
    results those without chunking; switched off again, no bands."""
    vae = anima_vae.load_vae(tiny_file, dtype=torch.float32, chunk_size=FACTS["chunk"] - 1)
    assert FACTS["bit_equal_to_plain"]["chunked"] == {"latents": True, "decoded": True}
    assert conv_inputs(vae, monkeypatch) == FACTS["chunked_conv_calls"]
    latents, pixels = encode_decode(vae)
    assert close(latents, REF["latents"]) and close(pixels, REF["decoded"])
    anima_vae.set_spatial_chunking(vae, None)
    plain = conv_inputs(vae, monkeypatch)
    assert len(plain["encode"]) < len(FACTS["chunked_conv_calls"]["encode"])


@pytest.mark.parametrize("kind, height, size, upstream_heights", FACTS["band_cases"])
def test_single_conv_bands_are_upstreams(kind, height, size, upstream_heights, monkeypatch):
    """One chunked conv at heights where the last band's rule decides: upstream's bands, the unchunked values."""
    import functools

    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d

    torch.manual_seed(0)
    if kind == "causal3d":
        conv, banded, function = QwenImageCausalConv3d(2, 2, 3, padding=1), anima_vae._causal_conv_bands, "conv3d"
        x = torch.randn(1, 2, 1, height, 5)
    else:
        conv = torch.nn.Conv2d(2, 2, 3, **({"padding": 1} if kind == "up2d" else {"stride": 2}))
        banded, function, x = anima_vae._resample_conv_bands, "conv2d", torch.randn(1, 2, height, 5)
    with torch.no_grad():
        plain = conv(x)
        conv._conv_forward = functools.partial(banded, conv, size)
        original, heights = getattr(F, function), []

        def spy(t, *args, **kwargs):
            heights.append(t.shape[-2])
            return original(t, *args, **kwargs)

        monkeypatch.setattr(F, function, spy)
        chunked = conv(x)
    assert heights == upstream_heights
    assert close(chunked, plain)


def test_disabled_cache_changes_nothing_for_images(tiny_file):
    vae = anima_vae.load_vae(tiny_file, dtype=torch.float32, disable_cache=True)
    assert FACTS["bit_equal_to_plain"]["nocache"] == {"latents": True, "decoded": True}
    latents, pixels = encode_decode(vae)
    assert close(latents, REF["latents"]) and close(pixels, REF["decoded"])
    with pytest.raises(UserError, match="one frame"):
        anima_vae.decode_latents(vae, REF["noise_latents"].expand(-1, -1, 2, -1, -1))


def test_a_wrong_constant_or_a_swapped_key_is_detected(tiny_file, tmp_path, vae):
    """The reference tells a wrong normalization and two swapped tensors of one shape apart."""
    wrong_std = [*anima_vae.LATENTS_STD[:-1], anima_vae.LATENTS_STD[-1] + 1e-3]
    wrong = anima_vae.load_vae(write(tmp_path / "std.safetensors", FILE_WEIGHTS,
                                     {**anima_vae.TINY_CONFIG, "latents_std": wrong_std}), dtype=torch.float32)
    latents, pixels = encode_decode(wrong)
    assert not close(latents, REF["latents"]) and not close(pixels, REF["decoded"])
    with torch.no_grad():
        divided = (vae.encode(REF["pixels"].unsqueeze(2)).latent_dist.mode() - torch.tensor(
            anima_vae.LATENTS_MEAN).view(1, 16, 1, 1, 1)) / torch.tensor(anima_vae.LATENTS_STD).view(1, 16, 1, 1, 1)
    assert not torch.equal(divided.squeeze(2), REF["latents"])  # the order of roundings is checked bit for bit
    a, b = "encoder.downsamples.0.residual.0.gamma", "encoder.downsamples.0.residual.3.gamma"
    swapped = {**FILE_WEIGHTS, a: FILE_WEIGHTS[b], b: FILE_WEIGHTS[a]}
    latents, _ = encode_decode(anima_vae.load_vae(write(tmp_path / "swap.safetensors", swapped), dtype=torch.float32))
    assert not close(latents, REF["latents"])


def test_save_writes_the_files_names(vae, tmp_path):
    path = tmp_path / "saved.safetensors"
    anima_vae.save_vae(vae, path)
    saved = load_file(str(path))
    assert set(saved) == set(FILE_WEIGHTS)
    assert all(torch.equal(saved[k], FILE_WEIGHTS[k].float()) for k in saved)
    again = anima_vae.load_vae(path)
    assert again.config.base_dim == 4 and torch.equal(encode_decode(again)[0], encode_decode(vae)[0])


def test_diffusers_names_load_too(vae, tmp_path):
    path = write(tmp_path / "diffusers.safetensors", {k: v.contiguous() for k, v in vae.state_dict().items()})
    assert torch.equal(encode_decode(anima_vae.load_vae(path))[0], encode_decode(vae)[0])


def test_files_that_are_not_the_vae_are_refused(tmp_path):
    with pytest.raises(UserError, match="not a Qwen-Image"):
        anima_vae.load_vae(write(tmp_path / "other.safetensors", {"foo.weight": torch.zeros(2)}))
    with pytest.raises(UserError, match="another VAE"):  # the tiny file read as the real one: shapes differ
        anima_vae.load_vae(write(tmp_path / "bare.safetensors", FILE_WEIGHTS, None))
    with pytest.raises(UserError, match="no such file"):
        anima_vae.load_vae(tmp_path / "missing.safetensors")
