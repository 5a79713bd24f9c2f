"""The optimizer side of a step, written once for every layout: AdamW and its parameter
groups, the learning-rate schedule, the global gradient norm and clipping.

    optimizer = Optimizer(model.parameters(), cfg, tp_rank, grad_stats_groups)
    norm = clip_grad_norm(optimizer, cfg.clip_grad)        # the norm of the WHOLE model
    set_learning_rate(optimizer, learning_rate(step, cfg)); optimizer.step(); optimizer.zero_grad()

The global gradient norm is the norm of the single-device model's gradient, whatever the
layout. A rank holds only part of it, and some of what it holds is held by other ranks too:

  - tensor parallelism: a split parameter's gradient is this rank's slice (count it); a
    replicated one (a norm, a row-parallel bias) is the same full tensor on every rank of the
    TP group (count it on TP rank 0 only): `param_is_not_tensor_parallel_duplicate`;
  - pipeline parallelism: each stage holds other layers (count them all), but the last stage's
    copy of a tied embedding is the first stage's matrix again (`shared`: count it once):
    `param_is_not_shared`;
  - ZeRO: each data-parallel rank holds a slice of the averaged gradient (dp/zero.py's
    DistributedOptimizer gives its slices, filtered the same way).

So: sum the squares of the counted gradients, all-reduce the one number over each group that
splits the model (`grad_stats_groups`: tp, then pp, then dp under ZeRO), and take the root.
Megatron-LM: megatron/core/optimizer/clip_grads.py (get_grad_norm_fp32, clip_grad_by_total_norm_fp32),
optimizer.py (MegatronOptimizer.get_grads_for_grad_norm, _filter_grads_for_norm) and
tensor_parallel/layers.py
(param_is_not_tensor_parallel_duplicate); its filters have the same names.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from . import comm
from .config import TrainConfig

__all__ = ["learning_rate", "set_learning_rate", "param_groups", "Optimizer", "param_is_not_shared", "is_expert_parameter",
           "param_is_not_tensor_parallel_duplicate", "grads_for_norm", "get_grad_norm", "clip_grad_norm"]


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up from lr/warmup to lr over lr_warmup_iters steps, then cosine decay to
    min_lr at train_iters (Megatron's --lr-decay-style cosine). `step` counts from 0."""
    if step < cfg.lr_warmup_iters:
        return cfg.lr * (step + 1) / cfg.lr_warmup_iters
    decay_steps = max(1, cfg.train_iters - cfg.lr_warmup_iters)
    progress = min(1.0, (step - cfg.lr_warmup_iters) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def param_groups(params: Iterable[torch.Tensor], cfg: TrainConfig, decay=lambda p: p.dim() >= 2) -> list[dict]:
    """AdamW's two groups: weight decay on matrices only, not on biases and norm weights (as
    Megatron). `decay(p)` says which group a tensor joins (ZeRO's shards decide by bucket)."""
    params = list(params)
    return [{"params": [p for p in params if decay(p)], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if not decay(p)], "weight_decay": 0.0}]


def param_is_not_shared(param: torch.Tensor) -> bool:
    """False for a pipeline's last-stage copy of a tied embedding (model/gpt.py marks it)."""
    return not getattr(param, "shared", False)


def is_expert_parameter(param: torch.Tensor) -> bool:
    """True for a routed expert's parameter of a mixture of experts: marked `allreduce = False`
    (Megatron's attribute; moe.apply_expert_parallel sets it). Its gradient is reduced over the
    expert-data-parallel group and counted in the norm over the experts' groups (chapter 05)."""
    return getattr(param, "allreduce", True) is False


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_rank: int) -> bool:
    """True for a parameter split over the TP group (tp/layers.py marks it
    tensor_model_parallel), and for a replicated one on TP rank 0 only."""
    return getattr(param, "tensor_model_parallel", False) or tp_rank == 0


def grads_for_norm(pieces: Iterable[tuple[torch.Tensor, torch.Tensor]], tp_rank: int) -> list[torch.Tensor]:
    """The gradients this rank counts toward the global norm.

    pieces: (parameter, gradient) pairs: every gradient this rank holds (a whole p.grad, or
    under ZeRO the part of one in this rank's shard), with the parameter it belongs to, whose
    attributes say how the model is split. tp_rank: this rank's index in its TP group.
    Returns the gradients to count so that, summed over the ranks of the groups that split
    the model, every element of the single-device gradient is counted exactly once:
    parameters that pass param_is_not_shared AND param_is_not_tensor_parallel_duplicate.

    Spot the bug (exercise 2.4): a first version of this body, and what it did when checked
    against the single-device run, are in chapters/02_tp/exercises/spot_the_bug.md.
    """
    # BEGIN EXERCISE 2.4: spot the bug in the gradient norm's filter | hint: every rank of a TP group holds a full copy of each replicated gradient; how many times does the all-reduce over the group count it? (and a pipeline's tied copy?)
    return [grad for param, grad in pieces
            if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param, tp_rank)]
    # END EXERCISE


def get_grad_norm(grads: list[torch.Tensor], groups: Iterable, dtype: torch.dtype) -> torch.Tensor:
    """sqrt(sum of squares of `grads`, summed over each process group in `groups`): a [1]
    tensor of `dtype`, the same on every rank of the groups. One comm.all_reduce (sum) of one
    element per group, tag "grad-norm" (none for a group of one rank)."""
    squares = torch.zeros(1, dtype=dtype, device=grads[0].device if grads else None)
    for g in grads:
        squares += g.pow(2).sum()
    for group in groups:
        comm.all_reduce(squares, group, op="sum", tag="grad-norm")
    return squares.sqrt()


def clip_grad_norm(optimizer: "Optimizer", max_norm: float) -> float:
    """The global gradient norm before clipping; if max_norm > 0, scale every gradient the
    optimizer steps by min(1, max_norm / (norm + 1e-6)) (torch.nn.utils.clip_grad_norm_'s rule)."""
    norm = get_grad_norm(optimizer.grads_for_norm(), optimizer.grad_stats_groups, optimizer.norm_dtype)[0]
    if getattr(optimizer, "expert_grad_stats_groups", None) is not None:
        # a mixture's experts (chapter 05) are split over etp x ep x pp, not tp x pp: their sum of
        # squares is taken over those groups and added (Megatron's ChainedOptimizer)
        experts = get_grad_norm(optimizer.expert_grads_for_norm(), optimizer.expert_grad_stats_groups,
                                optimizer.norm_dtype)[0]
        norm = (norm.square() + experts.square()).sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return float(norm)


class Optimizer(torch.optim.AdamW):
    """torch's AdamW over this rank's parameters (param_groups: decay on matrices), plus what
    `clip_grad_norm` needs: `grads_for_norm()` and `grad_stats_groups`, the process groups
    that split the model (tp, pp; as everywhere in comm, None is the whole world, and a group
    of one rank, or no torch.distributed at all, communicates nothing).
    dp/zero.py's DistributedOptimizer is the same with sharded state."""

    def __init__(self, params: Iterable[nn.Parameter], cfg: TrainConfig, tp_rank: int = 0,
                 grad_stats_groups: Iterable = (), decay=lambda p: p.dim() >= 2,
                 expert_grad_stats_groups: Iterable | None = None, expert_tp_rank: int = 0):
        params = list(params)
        super().__init__(param_groups(params, cfg, decay), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                         eps=cfg.adam_eps)
        self.tp_rank, self.grad_stats_groups = tp_rank, list(grad_stats_groups)
        # experts (marked allreduce=False, chapter 05): counted over their own groups (etp, ep, pp)
        self.expert_grad_stats_groups = None if expert_grad_stats_groups is None else list(expert_grad_stats_groups)
        self.expert_tp_rank = expert_tp_rank
        self.norm_dtype = params[0].dtype if params else torch.float32

    def _pieces(self, experts: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        split = self.expert_grad_stats_groups is not None
        return [(p, p.grad) for group in self.param_groups for p in group["params"] if p.grad is not None
                and (split and is_expert_parameter(p)) == experts]

    def grads_for_norm(self) -> list[torch.Tensor]:
        return grads_for_norm(self._pieces(experts=False), self.tp_rank)

    def expert_grads_for_norm(self) -> list[torch.Tensor]:
        return grads_for_norm(self._pieces(experts=True), self.expert_tp_rank)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
