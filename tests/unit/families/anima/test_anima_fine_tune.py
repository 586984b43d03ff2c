"""``anima_train.py``'s parts: the DiT's optimizer groups (upstream 48d368fa ``anima_train_utils
.get_anima_param_groups``), its checks, and its checkpoint writer.

Expected values: the real model's split per group is upstream's, computed from upstream's ``Anima`` built on the
meta device (``docs/anima-upstream-facts.md`` section 9); the tiny model's counts follow from the per-block counts
there (the real ones over 28 blocks) and the adapter's tensors in upstream's recorded state dict
(``tests/data/upstream_anima_parity.json``: 4 outside its blocks, 19 per block); the checkpoint's keys are those of
upstream's tiny ``Anima`` (``tests/data/upstream_anima_parity.safetensors``) with ``net.`` in front.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from library.base.errors import UserError
from library.config import validate
from library.families.anima.builtin import build_tiny_dit
from library.families.anima.checkpoint_files import write_anima_checkpoint
from library.families.anima.fine_tune_config import AnimaFineTuneConfig
from library.families.anima.fine_tuning import param_groups
from library.families.anima.loading import load_dit
from library.families.anima.model import AnimaTransformer
from library.families.anima.params import ANIMA
from library.families.anima.spec import FINE_TUNE
from library.families.checkpoint_flags import CheckpointFormat
from library.families.model_files import CONFIG_METADATA_KEY
from library.train.full_model import build_trained_model
from tests.config_helpers import build_parser, parse_args

DATA = Path(__file__).resolve().parents[3] / "data"
BASE = ["--pretrained_model_name_or_path", "builtin:tiny-anima", "--output_dir", "out", "--train_data_dir", "data"]
SAFETENSORS = CheckpointFormat(single_file=True, safetensors=True)

# docs/anima-upstream-facts.md section 9: (tensors, parameters) per group of the real DiT
REAL_SPLIT = {"base": (5, 17_049_600), "self_attn": (168, 469_769_216), "cross_attn": (168, 352_328_704),
              "mlp": (56, 939_524_096), "mod": (170, 177_733_632), "llm_adapter": (118, 134_663_680)}
# the tiny DiT (2 blocks, a 2-block adapter): per block 6 self-attention, 6 cross-attention, 2 MLP and 6 modulation
# tensors, the final layer's 2 modulation tensors, the 5 base tensors; the adapter 4 + 2 x 19
TINY_COUNTS = {"base": 5, "self_attn": 12, "cross_attn": 12, "mlp": 4, "mod": 14, "llm_adapter": 42}


def test_the_section_holds_upstreams_anima_flags_with_their_defaults_and_choices():
    """``tests/data/upstream_anima_train_flags.json`` (``tests/data/upstream_anima_flags.py``): the Anima flags of
    upstream's ``anima_train.setup_parser()`` and its checkpoint flags, with upstream's defaults and choices (None,
    upstream's default of ``--save_model_as``, is no choice to give)."""
    upstream = json.loads((DATA / "upstream_anima_train_flags.json").read_text())
    lora = json.loads((DATA / "upstream_anima_train_network_flags.json").read_text())
    by_dest = {flag["dest"]: flag for flag in upstream["flags"]}
    fields = {f.name: f for f in dataclasses.fields(AnimaFineTuneConfig)}
    assert set(fields) == {*lora["anima_only"], "save_model_as", "use_safetensors"}
    for name, field in fields.items():
        assert field.default == by_dest[name]["default"], name
        choices = [c for c in by_dest[name]["choices"] or [] if c is not None]
        assert list(field.metadata["choices"] or []) == choices, name


def section(*argv: str) -> AnimaFineTuneConfig:
    cfg, _ = parse_args(BASE + list(argv), script="anima_train.py")
    return cfg.family_config


def upstream_tiny_keys() -> set[str]:
    return {key.removeprefix("anima.") for key in load_file(str(DATA / "upstream_anima_parity.safetensors"))
            if key.startswith("anima.")}


def test_the_real_dit_splits_as_upstreams():
    with torch.device("meta"):
        dit = AnimaTransformer(ANIMA)
    groups, frozen = param_groups(dit, section(), 1e-4)
    assert {g.name: (len(g.params), sum(p.numel() for p in g.params)) for g in groups} == REAL_SPLIT
    assert [g.name for g in groups] == ["base", "self_attn", "cross_attn", "mlp", "mod", "llm_adapter"]
    assert frozen == [] and {g.learning_rate for g in groups} == {1e-4}


def test_each_component_rate_sets_its_group_and_zero_freezes_it():
    dit = build_tiny_dit()
    groups, frozen = param_groups(dit, section("--self_attn_lr", "2e-5", "--mod_lr", "0", "--llm_adapter_lr",
                                               "3e-5"), 1e-4)
    assert [(g.name, len(g.params), g.learning_rate) for g in groups] == [
        ("base", TINY_COUNTS["base"], 1e-4), ("self_attn", TINY_COUNTS["self_attn"], 2e-5),
        ("cross_attn", TINY_COUNTS["cross_attn"], 1e-4), ("mlp", TINY_COUNTS["mlp"], 1e-4),
        ("llm_adapter", TINY_COUNTS["llm_adapter"], 3e-5)]
    names = {id(p): name for name, p in dit.named_parameters()}
    assert len(frozen) == TINY_COUNTS["mod"]
    assert all("adaln_modulation" in names[id(p)] for p in frozen)
    assert sum(len(g.params) for g in groups) + len(frozen) == len(names)


def test_the_optimizer_gets_the_named_groups_and_the_frozen_ones_no_gradient():
    """Through the shared trainer's ``build_trained_model``, as ``anima_train.py`` runs it."""
    model = FINE_TUNE.load().load(_model_cfg(), section(), torch.float32)
    trained, train_te = build_trained_model(FINE_TUNE, section("--mlp_lr", "0", "--cross_attn_lr", "5e-5"), model,
                                            1e-3, torch.float32, SAFETENSORS)
    groups, names = trained.prepare_optimizer_params(None, None, 1e-3)
    assert names == ["base", "self_attn", "cross_attn", "mod", "llm_adapter"] and not train_te
    assert [(len(g["params"]), g["lr"]) for g in groups] == [
        (TINY_COUNTS["base"], 1e-3), (TINY_COUNTS["self_attn"], 1e-3), (TINY_COUNTS["cross_attn"], 5e-5),
        (TINY_COUNTS["mod"], 1e-3), (TINY_COUNTS["llm_adapter"], 1e-3)]
    named = dict(model.unet.named_parameters())
    mlp = [p for name, p in named.items() if name.startswith("blocks.") and ".mlp." in name]
    assert len(mlp) == TINY_COUNTS["mlp"] and not any(p.requires_grad for p in mlp)
    adapter_mlp = [p for name, p in named.items() if name.startswith("llm_adapter.") and ".mlp." in name]
    assert adapter_mlp and all(p.requires_grad for p in adapter_mlp)  # "llm_adapter" is tested first
    assert not any(p.requires_grad for p in model.qwen3.parameters())


def _model_cfg():
    from library.config import ModelConfig

    return ModelConfig(pretrained_model_name_or_path="builtin:tiny-anima")


def problems(*argv: str, script: str = "anima_train.py") -> list[str]:
    cfg, _ = parse_args(BASE + list(argv), script=script)
    try:
        validate(cfg)
    except UserError as error:
        return error.messages
    return []


def test_the_component_rates_and_caching_are_taken_here_but_refused_by_the_lora_script():
    argv = ("--mlp_lr", "1e-5", "--mod_lr", "0", "--cache_text_encoder_outputs")
    assert not any("--mlp_lr" in m or "--cache_text_encoder_outputs" in m for m in problems(*argv))
    lora = problems(*argv, script="anima_train_network.py")
    assert any("--mlp_lr, --mod_lr: per-component learning rates" in m for m in lora)
    assert any("--network_train_unet_only" in m for m in lora)
    help_text = build_parser(script="anima_train.py").format_help()
    assert "network_reg_lrs" not in help_text and "--llm_adapter_lr" in help_text


@pytest.mark.parametrize(("argv", "said"), [
    (("--self_attn_lr=-1e-5",), "--self_attn_lr -1e-05: must not be negative"),
    (("--save_model_as", "ckpt"), "--save_model_as ckpt: anima_train.py writes one .safetensors file"),
    (("--blocks_to_swap", "2"), "--blocks_to_swap 2: a swapped block's weights are stepped inside backward"),
    (("--blocks_to_swap", "2", "--fused_backward_pass", "--gradient_accumulation_steps", "2"),
     "--blocks_to_swap 2 with --gradient_accumulation_steps 2"),
    (("--unsloth_offload_checkpointing",), "--unsloth_offload_checkpointing is not provided here"),
    (("--attn_mode", "flash"), "--attn_mode flash: not provided here"),
    (("--learning_rate", "0"), "every trained part has learning rate 0"),
    (("--full_fp16", "--mixed_precision", "bf16"), "--full_fp16"),
])
def test_refusals_say_what_to_do(argv, said):
    found = problems(*argv)
    assert any(message.startswith(said) or said in message for message in found), found


@pytest.mark.parametrize(("argv", "full_bf16"), [(("--mixed_precision", "bf16"), False),
                                                 (("--mixed_precision", "bf16", "--full_bf16"), True)])
def test_the_dit_trains_in_fp32_unless_full_bf16(argv, full_bf16):
    """Upstream's anima_train.py casts the DiT to fp32 unless --full_bf16 / --full_fp16 (nothing implies them, unlike
    flux_train.py's bf16)."""
    cfg, _ = parse_args(BASE + list(argv), script="anima_train.py")
    assert cfg.precision.full_bf16 is full_bf16


@pytest.mark.parametrize(("script", "argv", "dtype"), [
    ("anima_train.py", ("--mixed_precision", "bf16"), torch.float32),
    ("anima_train.py", ("--mixed_precision", "bf16", "--full_bf16"), torch.bfloat16),
    ("anima_train_network.py", ("--mixed_precision", "bf16"), torch.bfloat16)])
def test_the_noisy_input_and_timesteps_are_in_the_dits_dtype(script, argv, dtype):
    """Upstream casts them to the DiT's weight dtype: ``dit_weight_dtype`` in anima_train.py (fp32 unless
    --full_bf16), ``weight_dtype`` (the mixed dtype) in anima_train_network.py."""
    from library.families.registry import model_family

    cfg, _ = parse_args(BASE + list(argv), script=script)
    objective = model_family("anima").objective(None, cfg, torch.device("cpu"))
    latents = torch.randn(2, 16, 4, 4)
    seen = {}

    def predict(noisy, timesteps):
        seen.update(noisy=noisy.dtype, timesteps=timesteps.dtype)
        return torch.zeros_like(latents)

    objective.loss(latents, predict, torch.ones(2), None, noise=cfg.noise, loss=cfg.loss,
                   generator=torch.Generator().manual_seed(0), host_generator=None)
    assert seen == {"noisy": dtype, "timesteps": dtype}


def test_the_checkpoint_has_upstreams_keys_and_loads_back(tmp_path):
    dit = build_tiny_dit()
    with torch.no_grad():
        next(dit.parameters()).add_(0.5)  # not the built-in's weights any more
    path = tmp_path / "model.safetensors"
    write_anima_checkpoint(SimpleModel(dit), path, SAFETENSORS, torch.bfloat16, {"modelspec.title": "t"}, 1, 2)
    saved = load_file(path)
    assert set(saved) == {f"net.{key}" for key in upstream_tiny_keys()}
    assert {tensor.dtype for tensor in saved.values()} == {torch.bfloat16}
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and meta["modelspec.title"] == "t"
    assert json.loads(meta[CONFIG_METADATA_KEY])["model_channels"] == dit.params.model_channels
    loaded = load_dit(path, torch.float32)
    for key, value in dit.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value.bfloat16().float()), key
    assert not list(tmp_path.glob("*.tmp*"))


class SimpleModel:
    """What the writer reads of a loaded model: its DiT (``unet``)."""

    def __init__(self, dit: AnimaTransformer):
        self.unet = dit
