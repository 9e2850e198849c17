"""The trainer's optimizers: AdamW that the rollout's engine can follow, and a resumed optimizer given the run's
settings."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def adamw(parameters: list[torch.nn.Parameter], lr: float, weight_decay: float, eps: float, fused: bool,
          betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.AdamW:
    """AdamW whose every step marks its parameters modified (their in-place version counters).

    The engine and the rollout policies recompute their cast and stacked weights when a parameter's version
    changes. torch's fused AdamW kernel writes the parameters without counting a version (the foreach and
    per-tensor ones count), so after a fused step the engine would keep sampling from the weights it first
    saw; the hook counts one for every step, fused or not. Sharded parameters (FSDP) are left out: they reach
    the engine through the rollout copy, whose filling counts.
    """
    optimizer = torch.optim.AdamW(parameters, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, fused=fused)
    whole = [p for p in parameters if not isinstance(p, DTensor)]
    if whole:
        optimizer.register_step_post_hook(lambda *_: torch.autograd.graph.increment_version(whole))
    return optimizer


def apply_optimizer_settings(optimizer: torch.optim.Optimizer, lr: float, weight_decay: float, eps: float,
                             betas: tuple[float, float], scheduler: torch.optim.lr_scheduler.LambdaLR | None = None,
                             ) -> None:
    """Give ``optimizer``'s groups the run's settings, after a checkpoint's state has loaded: loading brings back
    the rate, decay, eps and betas it was saved with, so a resume that sets ``optim.actor_lr`` and the like would
    otherwise train with the old ones. With a ``scheduler``, ``lr`` is its base rate and each group's rate the base
    times the schedule's factor at the scheduler's step (what its next step would give, so an unchanged base
    gives the saved rate to the bit)."""
    if scheduler is not None:
        scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    for index, group in enumerate(optimizer.param_groups):
        group.update(weight_decay=weight_decay, eps=eps, betas=betas)
        if scheduler is None:
            group["lr"] = lr
        else:
            group["initial_lr"] = lr
            group["lr"] = lr * scheduler.lr_lambdas[index](scheduler.last_epoch)
