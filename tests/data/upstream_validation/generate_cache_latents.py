"""Make ``cache_latents.json``: sd-scripts' validation loss of a seeded SD1.5 run with ``--cache_latents`` (latents
in RAM, sampled by upstream from its global generator) and the first numbers of each VAE posterior draw it made.

Runs upstream ``train_network.py`` (48d368fa) in the harness of ``shared/upstream/setup.sh`` with the VAE posterior's
``sample`` wrapped to note torch's CPU generator state before each draw; the draw itself is regenerated from that
state. Run with the harness's interpreter from its ``sd-scripts`` folder:

    cd $PEER_DIR/sd-scripts && PYTHONPATH=$PEER_DIR/shim HF_HUB_OFFLINE=1 CUDA_VISIBLE_DEVICES= \\
        $PEER_DIR/venv/bin/python <this file> WORK_DIR OUT_JSON

WORK_DIR receives a copy of ``$PEER_DIR/data/10_sks``, the output and the logs.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from diffusers.models.autoencoders import vae as diffusers_vae
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

FLAGS = ["--caption_extension", ".txt", "--resolution", "256", "--output_name", "v", "--network_module",
         "networks.lora", "--network_dim", "4", "--network_alpha", "4", "--optimizer_type", "AdamW",
         "--learning_rate", "1e-30", "--max_train_steps", "1", "--seed", "1", "--validation_seed", "1",
         "--validation_split", "0.25", "--validate_every_n_steps", "1", "--cache_latents",
         "--max_data_loader_n_workers", "0", "--mixed_precision", "no"]
HEAD = 8  # numbers kept of each draw


def unet_draws(peer: Path, first_state: torch.Tensor) -> int:
    """The numbers upstream's U-Net construction (``train_util._load_target_model``) draws: building it after
    ``torch.manual_seed(1)`` leaves the CPU generator where the first posterior draw found it (checked)."""
    from diffusers import UNet2DConditionModel as DiffusersUNet
    from library.original_unet import UNet2DConditionModel

    config = DiffusersUNet.load_config(str(peer / "model" / "sd15-random" / "unet"))
    torch.manual_seed(1)
    unet = UNet2DConditionModel(config["sample_size"], config["attention_head_dim"], config["cross_attention_dim"],
                                config.get("use_linear_projection", False), config.get("upcast_attention", False))
    if not torch.equal(torch.get_rng_state(), first_state):
        raise RuntimeError("the first posterior draw does not follow the U-Net's construction")
    layers = (torch.nn.Linear, torch.nn.Conv2d)
    return sum(p.numel() for m in unet.modules() if isinstance(m, layers) for p in m.parameters(recurse=False))


def main() -> None:
    peer, work, out = Path(os.environ["PEER_DIR"]), Path(sys.argv[1]), Path(sys.argv[2])
    shutil.copytree(peer / "data" / "10_sks", work / "data" / "10_sks")
    states = []
    sample = diffusers_vae.DiagonalGaussianDistribution.sample

    def noting(self, generator=None):
        states.append((torch.get_rng_state(), tuple(self.mean.shape)))
        return sample(self, generator)

    diffusers_vae.DiagonalGaussianDistribution.sample = noting
    sys.path.insert(0, os.getcwd())
    import train_network
    from library import train_util

    parser = train_network.setup_parser()
    args = parser.parse_args([
        "--pretrained_model_name_or_path", str(peer / "model" / "sd15-random"), "--tokenizer_cache_dir",
        str(peer / "model" / "tokenizer_cache"), "--train_data_dir", str(work / "data"), "--output_dir",
        str(work / "out"), "--logging_dir", str(work / "logs"), *FLAGS])
    train_network.NetworkTrainer().train(train_util.read_config_from_file(args, parser))
    events = EventAccumulator(str(next((work / "logs").iterdir()) / "network_train"))
    events.Reload()
    [scalar] = events.Scalars("loss/validation/step_average")
    draws = []
    for state, shape in states:
        generator = torch.Generator().manual_seed(0)
        generator.set_state(state)
        noise = torch.randn(shape, generator=generator)
        draws.append({"shape": list(shape), "head": noise.flatten()[:HEAD].tolist(), "sum": float(noise.sum())})
    out.write_text(json.dumps({
        "validation_step_average": scalar.value,
        "cpu_draws_before_latents": unet_draws(peer, states[0][0]),
        "flags": FLAGS,
        "draws": draws,
        "produced_by": "kohya-ss/sd-scripts 48d368fa train_network.py on the harness of shared/upstream/setup.sh "
                       "(PEER_DIR): tests/data/upstream_validation/generate_cache_latents.py",
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
