"""Hostile or unlucky FLUX.1 model files (issue 29 items 2, 5, 6, 7, 8), planted from the tiny model's own files
(``write_tiny_flux``) with edited tensors or metadata: each loads right or stops with a ``UserError`` (exit 2)
naming the file and what is wrong, never a traceback from deep inside torch, transformers or diffusers.

* ComfyUI's scaled fp8 layout (``<layer>.scale_weight``, ``scaled_fp8``, ``scale_input``) loads as the weights it
  encodes (fp8 × scale, ComfyUI ``comfy/ops.py``), compared with the original weights the file was quantized from.
* An AE that does not fit the transformer (an SD-style VAE, or 4 latent channels) names both files.
* Our own ``sd_scripts_bf16.config`` metadata is checked: field, type, range, shapes.
* A diffusers folder without one of its shards names the missing shard; an integer tensor where a weight belongs
  names the tensor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from library.base.errors import UserError
from library.families.flux.checkpoints import load_transformer, save_diffusers_transformer
from library.families.flux.loading import load_flux_model
from library.families.flux.part_files import load_ae, load_clip_l, load_t5xxl, save_ae
from library.families.flux.parts import TINY_CONFIGS, build_ae, part_config
from library.families.flux.tiny_files import FLUX_FILES, write_tiny_flux
from library.families.model_files import CONFIG_METADATA_KEY, apply_fp8_scales, fill_module

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALED_MARK = "scaled_fp8"  # ComfyUI's marker tensor of the layout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("tiny_flux_hostile")
    return out, write_tiny_flux(out, seed=5)


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})  # noqa: SIM118


def _plant(source: Path, target: Path, *, tensors=None, metadata=None) -> Path:
    """``source`` rewritten to ``target`` with ``tensors(state)`` and ``metadata(meta)`` applied (None: kept)."""
    state, meta = _read(source)
    save_file(tensors(state) if tensors else state, str(target), meta if metadata is None else metadata(meta))
    return target


def _quantize(state: dict[str, torch.Tensor], per_channel: bool, prefix: str = "") -> dict[str, torch.Tensor]:
    """ComfyUI's scaled fp8 layout, written by hand: every 2-D weight divided by its scale (max |w| / 448, per tensor
    or per output row) and stored in fp8, with ``scale_weight``, a ``scale_input`` and the ``scaled_fp8`` marker."""
    out = {prefix + SCALED_MARK: torch.zeros(2, dtype=FP8)}
    for key, tensor in state.items():
        if key.endswith(".weight") and tensor.ndim == 2:
            amax = tensor.float().abs().amax(dim=1, keepdim=True) if per_channel else tensor.float().abs().amax()
            scale = (amax / FP8_MAX).clamp(min=1e-12)
            out[prefix + key] = (tensor.float() / scale).to(FP8)
            out[prefix + key.removesuffix(".weight") + ".scale_weight"] = scale
            out[prefix + key.removesuffix(".weight") + ".scale_input"] = torch.ones(())
        else:
            out[prefix + key] = tensor
    return out


def _close_to_original(loaded: torch.nn.Module, original: torch.nn.Module, scaled: dict[str, torch.Tensor]) -> int:
    """Each quantized weight of ``loaded`` within fp8's rounding of the weight it was made from (relative 2^-4,
    absolute half an fp8 subnormal step times its scale, plus bf16's rounding); returns how many were compared."""
    ours, theirs = loaded.state_dict(), original.state_dict()
    compared = 0
    for key, tensor in ours.items():
        name = next((k for k in scaled if k.endswith(key.removesuffix(".weight") + ".scale_weight")), None)
        if name is None or not key.endswith(".weight"):
            continue
        scale = scaled[name].float().max()
        expected = theirs[key].float()
        assert tensor.dtype == torch.bfloat16, key
        assert torch.allclose(tensor.float(), expected, rtol=2**-4 + 2**-7, atol=float(scale) * 2**-9), key
        compared += 1
    return compared


@pytest.mark.parametrize("per_channel", [False, True])
def test_scaled_fp8_transformer_loads_the_weights_it_encodes(tiny, tmp_path, per_channel):
    out, model = tiny
    state, meta = _read(out / FLUX_FILES[0])
    scaled = _quantize(state, per_channel, prefix="model.diffusion_model.")
    path = tmp_path / "flux1-dev_fp8_e4m3fn_scaled.safetensors"
    save_file(scaled, str(path), meta)
    loaded = load_transformer(path)
    assert _close_to_original(loaded, model.unet, scaled) > 20


def test_scaled_fp8_text_encoders_load_the_weights_they_encode(tiny, tmp_path):
    out, model = tiny
    for name, loader, original, per_channel in ((FLUX_FILES[1], load_clip_l, model.clip_l, False),
                                                (FLUX_FILES[2], load_t5xxl, model.t5xxl, True)):
        state, meta = _read(out / name)
        scaled = _quantize(state, per_channel)
        path = tmp_path / name.replace(".safetensors", "_fp8_e4m3fn_scaled.safetensors")
        save_file(scaled, str(path), meta)
        assert _close_to_original(loader(path), original, scaled) > 10, name


def test_scales_by_hand_and_bad_scales_named():
    weight = torch.tensor([[2.0, -4.0], [8.0, 0.5]]).to(FP8)
    state = {"a.weight": weight, "a.scale_weight": torch.tensor(0.5), "a.scale_input": torch.tensor(1.0),
             "b.weight": weight, "b.scale_weight": torch.tensor([[0.25], [2.0]]), SCALED_MARK: torch.zeros(2)}
    out = apply_fp8_scales(state, "m.safetensors")
    assert sorted(out) == ["a.weight", "b.weight"]
    assert out["a.weight"].tolist() == [[1.0, -2.0], [4.0, 0.25]]
    assert out["b.weight"].tolist() == [[0.5, -1.0], [16.0, 1.0]]
    for bad, problem in (({"c.scale_weight": torch.tensor(1.0)}, "no weight c.weight"),
                         ({"a.weight": weight, "a.scale_weight": torch.ones(2, 2, 1)}, "block-wise"),
                         ({"a.weight": weight, "a.scale_weight": torch.tensor(float("nan"))}, "NaN")):
        with pytest.raises(UserError, match=rf"m\.safetensors: scaled fp8 tensor .*{problem}"):
            apply_fp8_scales(bad, "m.safetensors")


def _ae_config(**changes) -> dict:
    return part_config(TINY_CONFIGS, "ae", **changes)


def test_sd_style_vae_as_ae_names_the_tensor(tiny, tmp_path):
    """Four latent channels, quant convs, other widths and no metadata (as an SD VAE file): the bundled FLUX AE's
    widths do not fit, and the mismatch is named instead of failing in ``reshape``."""
    sd_vae = build_ae(_ae_config(latent_channels=4, use_quant_conv=True, use_post_quant_conv=True))
    path = tmp_path / "sd_vae.safetensors"
    save_ae(sd_vae, path)
    _plant(path, path, metadata=lambda meta: {})
    with pytest.raises(UserError, match=r"sd_vae\.safetensors: FLUX AE tensors? .*not"):
        load_ae(path)


def test_ae_with_four_latent_channels_names_both_files(tiny, tmp_path):
    out, _ = tiny
    path = tmp_path / "ae4.safetensors"
    save_ae(build_ae(_ae_config(latent_channels=4)), path)
    files = [str(out / name) for name in FLUX_FILES]
    with pytest.raises(UserError, match=r"--ae .*ae4\.safetensors: its latent channels × 4 is 16, the transformer "
                       r".*flux1-dev\.safetensors takes in_channels 64"):
        load_flux_model(files[0], clip_l=files[1], t5xxl=files[2], ae=str(path))


def _edited(field: str, value) -> callable:
    def edit(meta: dict[str, str]) -> dict[str, str]:
        config = json.loads(meta[CONFIG_METADATA_KEY])
        if value is KeyError:
            del config[field]
        else:
            config[field] = value
        return {CONFIG_METADATA_KEY: json.dumps(config)}
    return edit


def _replaced(text: str) -> callable:
    return lambda meta: {CONFIG_METADATA_KEY: text}


CONFIG_CASES = [  # (file index, metadata edit, what the message names)
    (0, _replaced("{not json"), "not JSON"),
    (0, _edited("colour", 3), "unknown field 'colour'"),
    (0, _edited("num_heads", 3), "not divisible by num_heads 3"),
    (0, _edited("axes_dim", [4, 6, 8]), r"axes_dim \[4, 6, 8\] must sum to the head dim 16"),
    (0, _edited("axes_dim", KeyError), "field axes_dim missing"),
    (0, _replaced("[64, 32]"), "a JSON list, expected an object"),
    (0, _edited("hidden_size", 10**12), "field hidden_size is 1000000000000, allowed: an integer 1 to"),
    (0, _edited("in_channels", 16), r"img_in\.weight the shape \(32, 16\), the file holds \(32, 64\)"),
    (1, _replaced("{not json"), "not JSON"),
    (1, _edited("vocab_size", -5), "field vocab_size is -5, allowed: int 0 to"),
    (2, _edited("d_model", "wide"), "field d_model is 'wide', allowed: int"),
    (3, _replaced('["AutoencoderKL"]'), "a JSON list"),
]


@pytest.mark.parametrize(("index", "edit", "message"), CONFIG_CASES)
def test_edited_config_metadata_is_named(tiny, tmp_path, index, edit, message):
    out, _ = tiny
    name = FLUX_FILES[index]
    path = _plant(out / name, tmp_path / name, metadata=edit)
    loader = (load_transformer, load_clip_l, load_t5xxl, load_ae)[index]
    with pytest.raises(UserError, match=rf"{re.escape(name)}: metadata sd_scripts_bf16\.config: .*{message}"):
        loader(path)


def test_missing_diffusers_shard_is_named(tiny, tmp_path):
    _, model = tiny
    save_diffusers_transformer(model.unet, tmp_path, shards=3)
    (tmp_path / "transformer" / "diffusion_pytorch_model-00002-of-00003.safetensors").unlink()
    with pytest.raises(UserError, match=r"diffusion_pytorch_model-00002-of-00003\.safetensors: missing"):
        load_transformer(tmp_path)


@pytest.mark.parametrize(("index", "key"), [(0, "img_in.weight"), (1, "text_model.final_layer_norm.weight"),
                                            (3, "encoder.conv_in.weight")])
def test_integer_tensor_where_a_weight_belongs_is_named(tiny, tmp_path, index, key):
    out, _ = tiny
    name = FLUX_FILES[index]
    path = _plant(out / name, tmp_path / name, tensors=lambda s: {**s, key: s[key].to(torch.int32)})
    loader = (load_transformer, load_clip_l, load_t5xxl, load_ae)[index]
    with pytest.raises(UserError, match=r"tensor .* is stored as torch\.int32; model weights are floating-point"):
        loader(path)


def test_integer_tensor_in_a_shared_reader_is_named():
    with torch.device("meta"):
        module = torch.nn.Linear(2, 2)
    state = {"weight": torch.ones(2, 2, dtype=torch.int32), "bias": torch.zeros(2)}
    with pytest.raises(UserError, match=r"m\.ckpt: UNet tensor weight is stored as torch\.int32"):
        fill_module(module, state, Path("m.ckpt"), "UNet", torch.float32, model="an SD model", shape_hint="")
