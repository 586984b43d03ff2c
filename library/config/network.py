"""``--network_module`` and its options: the LoRA (or other network) that is trained."""

from __future__ import annotations

from dataclasses import dataclass

from library.config.fields import flag


@dataclass
class NetworkConfig:
    """The LoRA (or other network module) that is trained."""

    network_module: str = flag("networks.lora", "network module with create_network (networks.lora, "
                               "networks.lora_fa, lycoris.kohya)")
    network_dim: int | None = flag(None, "LoRA rank (default 4)")
    network_alpha: float | None = flag(None, "LoRA alpha; scale = alpha / rank (default 1)")
    network_dropout: float | None = flag(None, "dropout on the LoRA down-projection outputs (neuron dropout)")
    network_args: list[str] = flag([], 'extra network options "key=value" (conv_dim, rank_dropout, ...)')
    network_weights: str | None = flag(None, "start from these LoRA weights")
    dim_from_weights: bool = flag(False, "take rank and alpha from --network_weights")
    network_train_unet_only: bool = flag(False, "train only the UNet LoRA modules")
    network_train_text_encoder_only: bool = flag(False, "train only the text encoder LoRA modules")
    scale_weight_norms: float | None = flag(None, "max-norm regularization of each LoRA module's weight")


# sd-scripts network modules that this trainer does not provide (networks.loha / networks.lokr: newer than 48d368fa,
# the kohya_ss GUI's LoRA types "Kohya LoHa" / "Kohya LoKr"), and what to use instead.
MODULES_NOT_PROVIDED = {
    "networks.dylora": "sd-scripts' DyLoRA is not provided here; use --network_module lycoris.kohya with "
                       "--network_args algo=dylora block_size=<unit> (LyCORIS DyLoRA; the kohya_ss GUI's LoRA type "
                       "\"LyCORIS/DyLoRA\"), or networks.lora for a plain LoRA",
    "networks.oft": "sd-scripts' OFT is not provided here; use --network_module lycoris.kohya with --network_args "
                    "algo=diag-oft (LyCORIS Diag-OFT), or networks.lora for a plain LoRA",
    **{f"networks.{algo}": f"sd-scripts' own {name} is not provided here; use --network_module lycoris.kohya with "
                           f"--network_args algo={algo} (LyCORIS {name}), or the script's plain LoRA module "
                           "(networks.lora_anima for anima_train_network.py, networks.lora for SD 1.x/2.x and SDXL)"
       for algo, name in (("loha", "LoHa"), ("lokr", "LoKr"))},
}


def network_module_problems(cfg: NetworkConfig) -> list[str]:
    """A message when ``--network_module`` names an sd-scripts module that this trainer does not have."""
    instead = MODULES_NOT_PROVIDED.get(cfg.network_module)
    return [f"--network_module {cfg.network_module}: {instead}"] if instead else []
