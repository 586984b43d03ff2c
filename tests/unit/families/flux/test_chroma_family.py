"""``--model_type chroma`` in the FLUX.1 family: a Chroma file loads as Chroma's transformer only under that flag (a
FLUX.1 file only without it), as upstream 48d368fa's ``flux_utils.load_flow_model(model_type=...)`` builds one or
the other; Chroma reads no CLIP-L (upstream's ``dummy_clip_l`` in its place: zeros); the configuration checks of
``FluxNetworkTrainer.assert_extra_args`` (``--apply_t5_attn_mask`` required) and the model files a single-file
Chroma needs (``--t5xxl``, ``--ae``; ``--clip_l`` not read); the base model's names in the metadata
(``sai_model_spec``: architecture ``chroma``, ``IMPL_CHROMA``; ``ss_base_model_version`` ``chroma``)."""

from __future__ import annotations

import logging

import pytest
import torch

from library.base.errors import UserError
from library.config import validate
from library.families.flux.builtin import build_builtin_flux
from library.families.flux.checkpoints import load_transformer, save_transformer
from library.families.flux.chroma import ChromaTransformer, NoClip
from library.families.flux.family import FluxFamily
from library.families.flux.loading import load_flux_model
from tests.config_helpers import parse_args

CHROMA = ["--model_type", "chroma", "--apply_t5_attn_mask"]


def test_tiny_chroma_has_chromas_modules_and_no_clip():
    model = build_builtin_flux("builtin:tiny-chroma", 0)
    assert isinstance(model.unet, ChromaTransformer) and isinstance(model.clip_l, NoClip)
    names = {name.split(".")[0] for name, _ in model.unet.named_parameters()}
    assert names == {"img_in", "txt_in", "distilled_guidance_layer", "double_blocks", "single_blocks", "final_layer"}
    assert not model.is_schnell  # upstream: Chroma is "not schnell" (guidance input, 512 T5 tokens)
    pooled = model.clip_l(torch.zeros(3, 77, dtype=torch.long))["pooler_output"]
    assert pooled.shape == (3, 1) and not pooled.any()
    with pytest.raises(UserError, match="Chroma has no CLIP-L and no variants"):
        build_builtin_flux("builtin:tiny-chroma:variant=schnell", 0)


def test_a_chroma_file_loads_under_model_type_chroma_only(tmp_path):
    chroma = build_builtin_flux("builtin:tiny-chroma:double=1,single=3", 0).unet
    path = tmp_path / "chroma.safetensors"
    save_transformer(chroma, path, prefix="model.diffusion_model.")  # ComfyUI's prefix, as upstream strips it
    back = load_transformer(path, model_type="chroma")
    assert isinstance(back, ChromaTransformer) and (back.params.depth, back.params.depth_single_blocks) == (1, 3)
    assert all(torch.equal(a, b) for a, b in zip(chroma.state_dict().values(), back.state_dict().values(),
                                                 strict=True))
    with pytest.raises(UserError, match="a Chroma checkpoint .*train it with --model_type chroma"):
        load_transformer(path)
    flux = tmp_path / "flux.safetensors"
    save_transformer(build_builtin_flux("builtin:tiny-flux", 0).unet, flux)
    with pytest.raises(UserError, match="a FLUX.1 checkpoint, not Chroma's"):
        load_transformer(flux, model_type="chroma")
    with pytest.raises(UserError, match="builtin:tiny-chroma is a Chroma model: add --model_type chroma"):
        load_flux_model("builtin:tiny-chroma")
    with pytest.raises(UserError, match="builtin:tiny-flux is a FLUX.1 model"):
        load_flux_model("builtin:tiny-flux", model_type="chroma")


def _problems(argv: list[str], tmp_path) -> list[str]:
    (tmp_path / "data" / "10_x").mkdir(parents=True, exist_ok=True)
    cfg, _ = parse_args(["--output_dir", str(tmp_path / "out"), "--train_data_dir", str(tmp_path / "data"),
                         "--resolution", "64", "--network_module", "networks.lora_flux", *argv], "flux")
    try:
        validate(cfg)
    except UserError as exc:
        return exc.messages
    return []


def test_chroma_needs_the_t5_mask_and_no_clip_l_file(tmp_path, caplog):
    assert _problems(["--pretrained_model_name_or_path", "builtin:tiny-chroma", "--model_type", "chroma"],
                     tmp_path) == ["--model_type chroma without --apply_t5_attn_mask: Chroma attends to T5's real "
                                   "tokens only (upstream asserts the flag); add --apply_t5_attn_mask"]
    single = ["--pretrained_model_name_or_path", str(tmp_path / "chroma.safetensors"), *CHROMA]
    assert [p.split(" is required")[0] for p in _problems(single, tmp_path)] == ["--t5xxl", "--ae"]
    with caplog.at_level(logging.WARNING):
        assert _problems([*single, "--t5xxl", "t5.safetensors", "--ae", "ae.safetensors", "--clip_l",
                          "clip.safetensors"], tmp_path) == []
    assert "--clip_l is not read: Chroma has no CLIP-L" in caplog.text


def test_the_base_model_names_are_upstreams_for_chroma():
    ids = FluxFamily().model_ids(False, False, build_builtin_flux("builtin:tiny-chroma", 0))
    assert (ids.base_model_version, ids.architecture, ids.implementation, ids.prediction_type) == (
        "chroma", "chroma/lora", "https://huggingface.co/lodestones/Chroma", None)
