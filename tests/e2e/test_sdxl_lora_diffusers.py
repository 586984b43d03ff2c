"""diffusers' ``StableDiffusionXLPipeline.load_lora_weights`` converts every key of a tiny-SDXL LoRA file and the
file changes what the pipeline draws (moved from ``tests/unit/networks/test_sdxl_lora.py``: it runs the pipeline)."""

from __future__ import annotations

import torch

from networks import lora


def test_diffusers_loads_every_key(tiny_sdxl_dir, tmp_path):
    from diffusers import StableDiffusionXLPipeline

    from library.families.sdxl.loading import load_sdxl_model

    model = load_sdxl_model(str(tiny_sdxl_dir))
    net = lora.create_network(1.0, 4, 2, model.vae, model.text_encoders, model.unet, conv_dim="4", conv_alpha="2")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in net.loras:
            module.lora_up.weight.copy_(torch.randn(module.lora_up.weight.shape, generator=gen) * 0.5)
    file = tmp_path / "sdxl_lora.safetensors"
    net.save_weights(str(file), None, {"ss_network_dim": "4"})
    pipe = StableDiffusionXLPipeline.from_pretrained(str(tiny_sdxl_dir), local_files_only=True)

    def latents():
        return pipe("a cat", num_inference_steps=2, height=64, width=64, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).images

    before = latents()
    pipe.load_lora_weights(str(file))
    adapters = {part: sum(1 for n, _ in getattr(pipe, part).named_modules() if n.endswith(".lora_A.default_0"))
                for part in ("unet", "text_encoder", "text_encoder_2")}
    assert adapters == {"unet": len(net.unet_loras), "text_encoder": 72, "text_encoder_2": 192}
    assert not torch.allclose(latents(), before)
