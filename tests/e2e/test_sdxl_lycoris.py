"""``--network_module lycoris.kohya`` for SDXL: LyCORIS sees our diffusers U-Net in sd-scripts' original layout
(``networks/sdxl_layout.py``), so every preset builds upstream's module set and shapes on the real architecture
(``tests/data/upstream_sdxl_lycoris_modules.json``: lycoris-lora run on sd-scripts' own SDXL classes in its venv);
on the tiny SDXL a LoCon and a LoKr train end to end, every LoCon key is one ComfyUI maps, the file loads back
(ours and diffusers' ``load_lora_weights``) and continues training with ``--network_weights``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate import init_empty_weights
from safetensors.torch import load_file

from library.families.ldm_layout import UNET_PREFIX
from library.families.sdxl.loading import build_builtin_sdxl
from library.families.sdxl.single_file import to_sdxl_single_file_state
from networks import lycoris_adapter
from tests.e2e.test_sdxl_train import sdxl_args, train

DATA = Path(__file__).resolve().parents[1] / "data"
UPSTREAM = json.loads((DATA / "upstream_sdxl_lycoris_modules.json").read_text())


@pytest.fixture(scope="module")
def real():
    return build_builtin_sdxl("builtin:sdxl-random", empty=True)


@pytest.mark.parametrize("preset", sorted(UPSTREAM["presets"]))
def test_real_architecture_equals_upstream(real, preset):
    letter = UPSTREAM["presets"][preset]
    expected = {name: shape for name, (shape, presets) in UPSTREAM["modules"].items() if letter in presets}
    args = {} if preset == "default" else {"preset": preset}
    with init_empty_weights():
        net = lycoris_adapter.create_network(1.0, 4, 2.0, None, real.text_encoders, real.unet, conv_dim=4,
                                              conv_alpha=1, algo="locon", **args)
    assert {m.lora_name: list(m.org_module[0].weight.shape) for m in net.loras} == expected


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sdxl-lycoris")
    for name, args in (("locon", ("algo=locon", "conv_dim=4", "conv_alpha=1")), ("lokr", ("algo=lokr", "factor=4"))):
        assert train(sdxl_args(root / name, "--network_module", "lycoris.kohya", "--network_args", *args)) == 0
    return root


def test_locon_keys_are_ones_comfyui_maps(runs):
    tiny = build_builtin_sdxl("builtin:tiny-sdxl", 0)
    sgm = to_sdxl_single_file_state(tiny)
    accepted = {"lora_unet_" + k[len(UNET_PREFIX):-len(".weight")].replace(".", "_")
                for k in sgm if k.startswith(UNET_PREFIX) and k.endswith(".weight")}
    state = load_file(runs / "locon" / "lora.safetensors")
    unet = {key.split(".")[0] for key in state if key.startswith("lora_unet_")}
    assert unet <= accepted and any("input_blocks_1_0_in_layers_2" in n for n in unet)
    assert {key.split("_")[1] for key in state} == {"unet", "te1", "te2"}
    assert {key.split(".", 1)[1] for key in state} == {"lora_down.weight", "lora_up.weight", "alpha"}
    ups = [v for k, v in state.items() if k.endswith("lora_up.weight")]
    assert any(float(v.abs().max()) > 0 for v in ups)


def test_lokr_trains_both_parts(runs):
    state = load_file(runs / "lokr" / "lora.safetensors")
    assert any(k.startswith("lora_unet_output_blocks_") and ".lokr_w" in k for k in state)
    assert any(k.startswith("lora_te2_text_model_") for k in state)


@pytest.mark.parametrize("name", ["locon", "lokr"])
def test_loaded_back_and_continued(runs, name, tmp_path):
    file = runs / name / "lora.safetensors"
    tiny = build_builtin_sdxl("builtin:tiny-sdxl", 0)
    net, _ = lycoris_adapter.create_network_from_weights(1.0, str(file), tiny.vae, tiny.text_encoders, tiny.unet)
    net.apply_to(tiny.text_encoders, tiny.unet, True, True)
    saved = load_file(file)
    assert {k for k in net.state_dict()} == set(saved)
    net.load_state_dict(saved)
    args = ("algo=locon", "conv_dim=4", "conv_alpha=1") if name == "locon" else ("algo=lokr", "factor=4")
    assert train(sdxl_args(tmp_path, "--network_module", "lycoris.kohya", "--network_args", *args,
                           "--network_weights", str(file), "--max_train_steps", "1")) == 0


def test_diffusers_loads_the_locon(runs, tiny_sdxl_dir):
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(str(tiny_sdxl_dir), local_files_only=True)

    def latents():
        return pipe("a cat", num_inference_steps=2, height=64, width=64, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).images

    before = latents()
    pipe.load_lora_weights(str(runs / "locon" / "lora.safetensors"))
    state = load_file(runs / "locon" / "lora.safetensors")
    adapters = sum(1 for n, _ in pipe.unet.named_modules() if n.endswith(".lora_A.default_0"))
    assert adapters == len({k.split(".")[0] for k in state if k.startswith("lora_unet_")})
    assert not torch.allclose(latents(), before)
