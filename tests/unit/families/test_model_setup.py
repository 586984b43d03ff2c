"""Loader and memory switches of the model stage: ``--tokenizer_cache_dir``, ``--cpu_offload_checkpointing``
and ``--lowram`` (``--highvram``'s caching: ``tests/unit/data/test_encode_caches.py``).

Expected values: the cache folder names are sd-scripts' (the hub id with "/" -> "_"); the tokenizer ids are
openai/clip-vit-large-patch14's; checkpointing with offloaded tensors must give the same gradients as plain
checkpointing (it changes where tensors wait, not the arithmetic).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from library.base.errors import UserError
from library.config import PrecisionConfig
from library.config.precision import precision_problems
from library.families import model_setup
from library.families.sd.parts import load_cached_tokenizer
from library.families.sd.tiny_files import build_tiny_sd15

torch.set_num_threads(1)
CAT_IDS = [49406, 320, 1125, 539, 320, 2368, 49407]  # "a photo of a cat"


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_sd15()


@pytest.mark.parametrize("v2,folder,pad_id", [(False, "openai_clip-vit-large-patch14", 49407),
                                              (True, "stabilityai_stable-diffusion-2", 0)])
def test_tokenizer_saved_then_read_from_the_cache(tmp_path, v2, folder, pad_id):
    tokenizer, how = load_cached_tokenizer(tmp_path, v2)
    assert how == f"bundled tokenizer saved to the cache {tmp_path / folder}"
    assert sorted(p.name for p in (tmp_path / folder).iterdir()) == [
        "merges.txt", "special_tokens_map.json", "tokenizer_config.json", "vocab.json"]
    assert [p.name for p in tmp_path.iterdir()] == [folder]  # no staging folder left behind
    again, how = load_cached_tokenizer(tmp_path, v2)
    assert how == f"tokenizer read from the cache {tmp_path / folder}"
    for tok in (tokenizer, again):
        assert tok("a photo of a cat").input_ids == CAT_IDS
        assert tok.pad_token_id == pad_id


def test_the_cached_tokenizer_is_the_one_used(tmp_path):
    load_cached_tokenizer(tmp_path, False)
    config_file = tmp_path / "openai_clip-vit-large-patch14" / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["model_max_length"] = 123
    config_file.write_text(json.dumps(config))
    tokenizer, _ = load_cached_tokenizer(tmp_path, False)
    assert tokenizer.model_max_length == 123


def test_unreadable_cache_folder_is_a_user_error(tmp_path):
    folder = tmp_path / "openai_clip-vit-large-patch14"
    folder.mkdir()
    with pytest.raises(UserError, match="clip-vit-large-patch14 is not a readable CLIP tokenizer .no vocab.json"):
        load_cached_tokenizer(tmp_path, False)
    (folder / "vocab.json").write_text('{"a": 0, "b": 1}')
    (folder / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(UserError, match=r"not a readable CLIP tokenizer \(\d+ tokens, CLIP has 49408\)"):
        load_cached_tokenizer(tmp_path, False)


def unet_grads(unet, checkpoint_func):
    unet = copy.deepcopy(unet)
    unet.enable_gradient_checkpointing(checkpoint_func)
    unet.train()
    for p in unet.parameters():
        p.requires_grad_(True)
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 77, 32, generator=g)
    unet(x, torch.tensor([10, 700]), cond).sample.pow(2).mean().backward()
    return {name: p.grad for name, p in unet.named_parameters()}


def test_offloaded_checkpointing_gives_the_same_gradients(tiny, monkeypatch):
    packed = []
    pack = model_setup._pack_to_cpu

    def counting_pack(tensor):
        packed.append(tensor.shape)
        return pack(tensor)

    monkeypatch.setattr(model_setup, "_pack_to_cpu", counting_pack)
    plain = unet_grads(tiny.unet, None)
    offloaded = unet_grads(tiny.unet, model_setup.offloaded_checkpoint)
    assert len(packed) >= 22  # the inputs of every checkpointed resnet and transformer block
    assert plain.keys() == offloaded.keys()
    for name in plain:
        torch.testing.assert_close(offloaded[name], plain[name], rtol=0, atol=0, msg=name)


def test_cpu_offload_needs_gradient_checkpointing():
    assert precision_problems(PrecisionConfig(cpu_offload_checkpointing=True)) == [
        "--cpu_offload_checkpointing offloads the tensors of gradient checkpointing; add --gradient_checkpointing "
        "or drop it"]
    assert precision_problems(PrecisionConfig(cpu_offload_checkpointing=True, gradient_checkpointing=True)) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lowram_reads_a_single_file_straight_to_the_gpu(tiny, tmp_path):
    from library.families.sd.loading import load_sd_model
    from library.families.sd.single_file import save_checkpoint

    path = tmp_path / "tiny.safetensors"
    save_checkpoint(tiny, path)
    model = load_sd_model(str(path), file_device="cuda")
    assert {p.device.type for p in model.unet.parameters()} == {"cuda"}
    assert {p.device.type for p in model.text_encoder.parameters()} == {"cuda"}
