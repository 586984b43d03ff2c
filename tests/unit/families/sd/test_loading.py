"""The built-in tiny model (determinism, real SD1.5 module names) and ``load_sd_model``'s forms and errors."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from library.base.errors import UserError
from library.families.model_parts import config_dir
from library.families.sd.loading import load_sd_model
from library.families.sd.parts import build_from_config
from library.families.sd.tiny_files import build_tiny_sd15

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[4]
PARTS = ("unet", "vae", "text_encoder")


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_sd15()


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """``python -m library.tiny_model OUT``, run as a user would."""
    out = tmp_path_factory.mktemp("tiny") / "model"
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-m", "library.tiny_model", str(out)], cwd=REPO, env=env, check=True,
                   capture_output=True)
    return out


def assert_same_weights(a, b, parts=PARTS):
    for part in parts:
        sa, sb = getattr(a, part).state_dict(), getattr(b, part).state_dict()
        assert sa.keys() == sb.keys(), part
        for key in sa:
            assert torch.equal(sa[key], sb[key]), f"{part}.{key}"


def lora_targets(module: torch.nn.Module, inside: str) -> list[str]:
    """Names of the Linear and 1x1 Conv2d modules sd-scripts' LoRA targets inside ``inside`` containers."""
    names = []
    for name, sub in module.named_modules():
        one_by_one = isinstance(sub, torch.nn.Conv2d) and sub.kernel_size == (1, 1)
        if inside in name and (isinstance(sub, torch.nn.Linear) or one_by_one):
            names.append(name)
    return names


def test_two_builds_are_identical(tiny):
    assert_same_weights(tiny, build_tiny_sd15())


def test_seed_changes_weights_and_keeps_global_rng(tiny):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    other = build_tiny_sd15(seed=1)
    assert torch.equal(torch.rand(3), expected)
    assert not torch.equal(other.unet.conv_in.weight, tiny.unet.conv_in.weight)


def test_unet_lora_names_equal_real_sd15(tiny):
    real_unet, _, _ = build_from_config(config_dir("sd15"), empty=True)
    tiny_names = lora_targets(tiny.unet, ".attentions.")
    assert len(tiny_names) == 192
    assert tiny_names == lora_targets(real_unet, ".attentions.")
    blocks = {n.split(".transformer_blocks.")[0] for n in tiny_names if ".transformer_blocks." in n}
    assert len(blocks) == 16
    assert list(real_unet.config.block_out_channels) == [320, 640, 1280, 1280]


def test_text_encoder_lora_names_equal_real_sd15(tiny):
    _, _, real_te = build_from_config(config_dir("sd15"), empty=True)
    names = lora_targets(tiny.text_encoder, "encoder.layers.")
    assert len(names) == 72
    assert names == lora_targets(real_te, "encoder.layers.")
    assert "encoder.layers.11.mlp.fc2" in names
    assert real_te.config.hidden_size == 768


def test_tiny_shapes_and_scheduler(tiny):
    assert tiny.text_encoder.config.num_hidden_layers == 12
    assert tiny.text_encoder.config.max_position_embeddings == 77
    assert tiny.vae.config.scaling_factor == 0.18215
    with torch.no_grad():
        latent = tiny.vae.encode(torch.zeros(1, 3, 64, 64)).latent_dist.mean
        out = tiny.unet(latent, torch.tensor([500]), encoder_hidden_states=torch.zeros(1, 77, 32)).sample
    assert latent.shape == (1, 4, 8, 8)
    assert out.shape == (1, 4, 8, 8)
    cfg = tiny.noise_scheduler.config
    assert (cfg.beta_start, cfg.beta_end, cfg.beta_schedule) == (0.00085, 0.012, "scaled_linear")
    assert (cfg.num_train_timesteps, cfg.clip_sample, cfg.prediction_type) == (1000, False, "epsilon")
    assert not any(p.requires_grad for p in tiny.unet.parameters())
    assert tiny.name == "builtin:tiny-sd15" and not tiny.v2


def test_builtin_name_and_v_parameterization():
    model = load_sd_model("builtin:tiny-sd15", v_parameterization=True)
    assert model.v_parameterization
    assert model.noise_scheduler.config.prediction_type == "v_prediction"


def test_exported_folder_loads_in_diffusers(exported, tiny):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(exported), local_files_only=True)
    assert pipe.safety_checker is None
    assert_same_weights(tiny, pipe)
    assert pipe.tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]


def test_load_exported_folder_and_single_file(exported, tiny):
    for path in (exported, exported / "model.safetensors"):
        model = load_sd_model(str(path))
        assert_same_weights(tiny, model)
        assert model.name == str(path)
        assert model.text_encoder.dtype == torch.float32


def test_replace_vae_from_file_and_folder(exported, tmp_path, tiny):
    from library.families.sd.single_file import save_checkpoint
    from library.families.sd.tiny_files import save_diffusers_folder

    other = build_tiny_sd15(seed=7)
    save_checkpoint(other, tmp_path / "other.safetensors")
    save_diffusers_folder(other, tmp_path / "other")
    for vae in (tmp_path / "other.safetensors", tmp_path / "other" / "vae", tmp_path / "other"):
        model = load_sd_model(str(exported), vae=str(vae))
        assert_same_weights(other, model, parts=("vae",))
        assert_same_weights(tiny, model, parts=("unet", "text_encoder"))


def test_missing_path_names_it_and_the_forms(tmp_path):
    with pytest.raises(UserError) as info:
        load_sd_model(str(tmp_path / "nope.safetensors"))
    assert "nope.safetensors" in str(info.value) and "diffusers folder" in str(info.value)


def test_hub_id_is_not_downloaded():
    with pytest.raises(UserError, match="hub ids are not downloaded"):
        load_sd_model("runwayml/stable-diffusion-v1-5")


def test_unknown_file_type(tmp_path):
    path = tmp_path / "model.txt"
    path.write_text("hello")
    with pytest.raises(UserError, match="unknown file type"):
        load_sd_model(str(path))


def test_folder_without_model_index(tmp_path):
    with pytest.raises(UserError, match="model_index.json"):
        load_sd_model(str(tmp_path))


def test_missing_vae(exported, tmp_path):
    with pytest.raises(UserError, match="--vae"):
        load_sd_model("builtin:tiny-sd15", vae=str(tmp_path / "vae.safetensors"))


@pytest.mark.parametrize("damage, said", [
    ("unet/config.json", "unet/ cannot be loaded .*its config.json is damaged"),
    ("unet/diffusion_pytorch_model.safetensors", "unet/ cannot be loaded .*its weights are damaged, truncated"),
])
def test_damaged_diffusers_part_names_the_part(exported, tmp_path, damage, said):
    folder = tmp_path / "copy"
    shutil.copytree(exported, folder)
    damaged = folder / damage
    damaged.write_bytes(damaged.read_bytes()[:200])
    with pytest.raises(UserError, match=said):
        load_sd_model(str(folder))


def test_builtin_refuses_v2():
    with pytest.raises(UserError, match="remove --v2"):
        load_sd_model("builtin:tiny-sd15", v2=True)


def test_sd1_file_with_v2_flag(exported):
    with pytest.raises(UserError, match="remove --v2"):
        load_sd_model(str(exported / "model.safetensors"), v2=True)


def test_sd2_file_without_v2_flag(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "sd2.safetensors"
    save_file({
        "model.diffusion_model.input_blocks.0.0.weight": torch.zeros(320, 4, 3, 3),
        "cond_stage_model.model.token_embedding.weight": torch.zeros(2, 1024),
    }, str(path))
    with pytest.raises(UserError, match="add --v2"):
        load_sd_model(str(path))


def test_ckpt_with_state_dict_nesting(exported, tmp_path, tiny):
    from safetensors.torch import load_file

    state = load_file(str(exported / "model.safetensors"))
    path = tmp_path / "model.ckpt"
    torch.save({"global_step": 1, "state_dict": state}, str(path))
    assert_same_weights(tiny, load_sd_model(str(path)))


def test_ckpt_with_pickled_objects_is_refused(tmp_path):
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "obj": Path("x")}, str(path))
    with pytest.raises(UserError, match="weights-only"):
        load_sd_model(str(path))


def test_lora_file_is_not_a_model(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "lora.safetensors"
    save_file({"lora_unet_x.lora_down.weight": torch.zeros(1, 1)}, str(path))
    with pytest.raises(UserError, match="not a single-file SD"):
        load_sd_model(str(path))
