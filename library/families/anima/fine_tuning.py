"""What Anima's full fine-tuning script, ``anima_train.py``, trains (its flags and checks: ``fine_tune_config.py``).

As upstream sd-scripts 48d368fa ``anima_train.py`` with ``anima_train_utils.get_anima_param_groups``: the DiT, its
LLM adapter included, trains when ``--learning_rate`` is not 0; Qwen3 stays frozen. The DiT's parameters fall into
six optimizer groups by a substring of their names, tested in this order: ``llm_adapter`` (``--llm_adapter_lr``),
``.self_attn`` (``--self_attn_lr``), ``.cross_attn`` (``--cross_attn_lr``), ``.mlp`` (``--mlp_lr``),
``.adaln_modulation`` (``--mod_lr``: the final layer's, and the blocks' ``adaln_modulation_self_attn`` etc.,
whose names hold no ``.self_attn``), the rest ``base`` (``--learning_rate``). A group's rate is its flag or
``--learning_rate``; a group at 0 is frozen and left out of the optimizer; the groups keep upstream's order (base,
self_attn, cross_attn, mlp, mod, llm_adapter).

Where we differ (``docs/anima-upstream-facts.md`` section 10): upstream names the logged rates by position
(``append_lr_to_logs_with_names``), so they are mislabelled once a group is left out; here each group logs under its
own name (``lr/self_attn``). The training step is the LoRA trainer's (``family.py``, ``objective.py``), so: the LLM
adapter's cross-attention gets the Qwen3 mask (upstream's ``anima_train.py`` passes it where ``Anima.forward``
drops it, so its full fine-tuning attends over the padded positions; its LoRA trainer and every sampler mask them);
``--weighting_scheme``'s per-sample weights multiply each sample's loss before the batch mean (upstream's
``anima_train.py`` multiplies after the per-sample mean, a broadcast that leaves only the batch's mean weight); no
``--attn_mode`` means PyTorch's attention (upstream's ``anima_train.py`` stops at the first step without one). As
upstream, the timesteps are in the DiT's dtype (fp32 without ``--full_bf16``, ``family.objective``); the noisy
latents and Qwen3 states reach the DiT in the ``--mixed_precision`` dtype, which its first layers' autocast casts
upstream's fp32 ones to anyway.
"""

from __future__ import annotations

from typing import Any

from library.families.checkpoint_flags import ParamGroup, TrainedPart

# (group, the substring that puts a parameter in it, the flag of its learning rate), tested in this order;
# a parameter matching none is in "base" (--learning_rate)
GROUP_RULES = (("llm_adapter", "llm_adapter", "llm_adapter_lr"), ("self_attn", ".self_attn", "self_attn_lr"),
               ("cross_attn", ".cross_attn", "cross_attn_lr"), ("mlp", ".mlp", "mlp_lr"),
               ("mod", ".adaln_modulation", "mod_lr"))
GROUP_ORDER = ("base", "self_attn", "cross_attn", "mlp", "mod", "llm_adapter")  # upstream's optimizer order


def group_of(name: str) -> str:
    """The group of the DiT parameter called ``name`` (``GROUP_RULES``)."""
    return next((group for group, part, _ in GROUP_RULES if part in name), "base")


def param_groups(dit: Any, section: Any, learning_rate: float) -> tuple[list[ParamGroup], list[Any]]:
    """The DiT's optimizer groups (``GROUP_ORDER``, empty ones and those at 0 left out) and the parameters frozen
    by a rate of 0."""
    members: dict[str, list[Any]] = {group: [] for group in GROUP_ORDER}
    for name, param in dit.named_parameters():
        members[group_of(name)].append(param)
    rates = {group: getattr(section, flag) for group, _, flag in GROUP_RULES}
    groups, frozen = [], []
    for group in GROUP_ORDER:
        lr = rates.get(group)
        lr = learning_rate if lr is None else lr
        if lr == 0:
            frozen += members[group]
        elif members[group]:
            groups.append(ParamGroup(group, tuple(members[group]), lr))
    return groups, frozen


def anima_fine_tune_parts(model: Any, section: Any, learning_rate: float) -> list[TrainedPart]:
    """The DiT in its groups, or nothing at ``--learning_rate 0`` (upstream trains nothing then; the shared checks
    refuse it before)."""
    if learning_rate == 0:
        return []
    groups, frozen = param_groups(model.unet, section, learning_rate)
    return [TrainedPart("unet", model.unet, learning_rate, tuple(frozen), tuple(groups))] if groups else []
