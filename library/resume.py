"""``--resume``: put a ``--save_state`` folder back into the network, optimizer, scheduler and generators.
"""

from __future__ import annotations

import torch

from library.errors import UserError
from library.position import Position
from library.schedule import StepPlan


def restore(resume: tuple[dict, dict], network, optimizer, scheduler, noise_generator: torch.Generator,
            plan: StepPlan) -> Position:
    """Load a ``--save_state`` folder; mismatches are explained instead of surfacing as tensor errors."""
    state, train_state = resume
    try:
        network.load_state_dict(state["network"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise UserError(f"--resume: the saved state does not fit this run ({exc}); resume with the same network "
                        "and optimizer settings as the run that saved it") from exc
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    noise_generator.set_state(state["noise_rng"])
    step = int(train_state["current_step"])
    if step >= plan.max_train_steps:
        raise UserError(f"--resume: the saved state is at step {step}, which already reaches --max_train_steps "
                        f"{plan.max_train_steps}; raise the step or epoch count to train further")
    return Position(epoch=step // plan.updates_per_epoch, step=step)
