"""The optimizer side of a step, written once for every layout: AdamW composed with where the
gradients come from, the global gradient norm and clipping, and mixed precision.

    optimizer = Optimizer([model], cfg)                  # parallelize.build_optimizer composes it
    set_learning_rate(optimizer, learning_rate(step, cfg))
    grad_norm = optimizer.step()                         # the stages below, in order
    optimizer.zero_grad()

The stages of `Optimizer.step()` (Megatron's MixedPrecisionOptimizer.step):

  1. gradients in     each Segment (elements stepped together) says where its gradient lives:
                      p.grad, a dp/ buffer's view, or this rank's ZeRO shard (zeros when there
                      is none: every parameter is stepped every step). With 16-bit parameters,
                      float32 main parameters and gradients (a copy unless already float32).
  2. loss scale       with a grad_scaler: unscale, check for inf/nan on every rank of the norm's
                      groups, and skip the step together if one has.
  3. clip             the norm of the WHOLE single-device gradient, then every gradient
                      scaled by min(1, max_norm / norm).
  4. AdamW            torch's AdamW on the main parameters (weight decay on matrices only).
  5. copy back        main parameters into the model's 16-bit ones, then each source's
                      after_optimizer_step (ZeRO: all-gather the updated shards).

A `GradientSource` (a bare model, `ModelGradients`, or a dp/ wrapper) says its segments, how to
zero them and what follows the step: one optimizer class for every layout.

The norm: for each `NormGroup` (dense; experts) sum the squares of the gradients this rank
counts (`grads_for_norm`: a TP-split slice yes, a TP-replicated tensor on TP rank 0 only, a
tied embedding's second copy no, a ZeRO shard its slice), all-reduce the one number over the
groups that split them (tag "grad-norm"), add the groups, take the root.

Megatron: megatron/core/optimizer/{optimizer,distrib_optimizer,clip_grads}.py.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from . import comm
from .config import TrainConfig
from .placement import Placement, placement_of

__all__ = ["learning_rate", "set_learning_rate", "Segment", "NormGroup", "GradientSource", "ModelGradients",
           "Optimizer", "param_is_not_shared", "is_expert_parameter", "param_is_not_tensor_parallel_duplicate",
           "grads_for_norm", "get_grad_norm", "clip_grad_norm"]


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up from lr/warmup to lr over lr_warmup_iters steps, then cosine decay to
    min_lr at train_iters (Megatron's --lr-decay-style cosine). `step` counts from 0."""
    if step < cfg.lr_warmup_iters:
        return cfg.lr * (step + 1) / cfg.lr_warmup_iters
    decay_steps = max(1, cfg.train_iters - cfg.lr_warmup_iters)
    progress = min(1.0, (step - cfg.lr_warmup_iters) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_learning_rate(optimizer: "Optimizer", lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


# ---------------------------------------------------------------------------------------
# which gradients the norm counts
# ---------------------------------------------------------------------------------------
def param_is_not_shared(param: torch.Tensor | Placement) -> bool:
    """False for a pipeline's last-stage copy of a tied embedding (its placement record is
    marked `shared` by model/gpt.py). Takes a parameter or its record."""
    return not placement_of(param).shared


def is_expert_parameter(param: torch.Tensor | Placement) -> bool:
    """True for a routed expert's parameter (`allreduce = False` in its placement record, set by
    moe.apply_expert_parallel): reduced over the expert-dp group, normed over the experts' groups."""
    return not placement_of(param).allreduce


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor | Placement, tp_rank: int) -> bool:
    """True for a parameter split over the TP group (its record has a split:
    `tensor_model_parallel`), and for a replicated one on TP rank 0 only."""
    return placement_of(param).tensor_model_parallel or tp_rank == 0


def grads_for_norm(pieces: Iterable[tuple[torch.Tensor, torch.Tensor]], tp_rank: int) -> list[torch.Tensor]:
    """The gradients this rank counts toward the global norm.

    pieces: (parameter, gradient) pairs: every gradient this rank holds (a whole p.grad, or
    under ZeRO the part of one in this rank's shard), with the parameter it belongs to (or its
    placement record), which says how the model is split. tp_rank: this rank's index in its TP
    group. Returns the gradients to count so that, summed over the ranks of the groups that
    split the model, every element of the single-device gradient is counted exactly once:
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


@dataclass(frozen=True)
class NormGroup:
    """The parameters whose gradients `select(record)` picks, split over `groups` (as everywhere
    in comm, None is the whole world, and a group of one rank communicates nothing), counted
    once by grads_for_norm with this rank's index `tp_rank` in the group that splits them."""
    select: Callable[[Placement], bool] = lambda record: True
    groups: tuple = ()
    tp_rank: int = 0


# ---------------------------------------------------------------------------------------
# where the gradients come from
# ---------------------------------------------------------------------------------------
@dataclass
class Segment:
    """Elements the optimizer steps together, and where their gradient lives.

    param: a parameter, or a view of a flat ZeRO shard. grad: () -> their gradient (param's shape
    or numel), or None. decay: AdamW's weight decay applies. owners: (record, lo, hi), the
    parameters the elements [lo, hi) belong to (the norm reads them). locations: per owner, (its
    local shape, where element lo sits in it flattened), for checkpoints."""
    param: torch.Tensor
    grad: Callable[[], torch.Tensor | None]
    decay: bool
    owners: list[tuple[Placement, int, int]] = field(default_factory=list)
    locations: list[tuple[torch.Size, int]] = field(default_factory=list)


class GradientSource:
    """What the optimizer asks of whoever holds the gradients: a bare model (ModelGradients)
    or a data-parallel wrapper (dp/naive.py's DataParallel and its subclasses)."""

    def optimizer_segments(self) -> list[Segment]:
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def after_optimizer_step(self) -> None:
        """Work after the parameters were updated (ZeRO: gather every rank's shard)."""


def parameter_segment(p: nn.Parameter, grad: Callable[[], torch.Tensor | None] | None = None) -> Segment:
    """One whole parameter as a segment; its gradient p.grad unless `grad` says otherwise."""
    return Segment(p, grad or (lambda: p.grad), p.dim() >= 2, [(placement_of(p), 0, p.numel())], [(p.shape, 0)])


class ModelGradients(GradientSource):
    """A model without a data-parallel wrapper: each parameter is a segment, its gradient p.grad."""

    def __init__(self, model: nn.Module):
        self.model = model

    def optimizer_segments(self) -> list[Segment]:
        return [parameter_segment(p) for p in self.model.parameters() if p.requires_grad]

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------
# the optimizer
# ---------------------------------------------------------------------------------------
class Optimizer:
    """AdamW over the segments of `sources` (bare models or dp wrappers), in the module's stages.

    norm_groups: how the gradient norm counts (default: one group, nothing split).
    main_params_dtype: the dtype AdamW steps in; parameters of another dtype get main copies,
      copied back after every step. None: no copies.
    grad_scaler: loss scaling (chapter 06's fp16): `scale` and `update(found_inf)`; None: none.
    param_groups and state are torch AdamW's, over the main parameters."""

    def __init__(self, sources: Iterable[nn.Module | GradientSource], cfg: TrainConfig,
                 norm_groups: Iterable[NormGroup] = (NormGroup(),), main_params_dtype: torch.dtype | None = None,
                 grad_scaler=None):
        self.sources = [s if isinstance(s, GradientSource) else ModelGradients(s) for s in sources]
        self.segments = [seg for s in self.sources for seg in s.optimizer_segments()]
        self.norm_groups, self.clip_grad, self.grad_scaler = list(norm_groups), cfg.clip_grad, grad_scaler
        dtype = main_params_dtype
        # 16-bit model parameters: AdamW steps float32 copies (Megatron's main params)
        self.main_params = [seg.param if dtype in (None, seg.param.dtype) else seg.param.detach().to(dtype)
                            for seg in self.segments]
        self._copies = [(m, s.param) for m, s in zip(self.main_params, self.segments) if m is not s.param]
        groups = [{"params": [m for m, s in zip(self.main_params, self.segments) if s.decay == decay],
                   "weight_decay": cfg.weight_decay if decay else 0.0} for decay in (True, False)]
        impl = {"default": {}, "foreach": dict(foreach=True), "fused": dict(fused=True)}[cfg.adam_impl]
        self.adam = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                      **impl)
        self.norm_dtype = dtype or (self.segments[0].param.dtype if self.segments else torch.float32)

    @property
    def param_groups(self) -> list[dict]:
        return self.adam.param_groups

    @property
    def state(self):
        return self.adam.state

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.grad_scaler is None else self.grad_scaler.scale

    def _main_grads_in(self) -> None:
        """Stage 1: every main parameter's .grad is its segment's gradient (a view when the
        dtypes agree, else a copy in the main dtype)."""
        for main, seg in zip(self.main_params, self.segments):
            g = seg.grad()
            if g is None:
                # no gradient this step (an expert that received no token): zeros, so that
                # AdamW still applies its momentum and weight decay, as it does on every layout
                # whose gradients live in a data-parallel buffer (and in Megatron's main_grad);
                # torch's AdamW would skip a parameter whose grad is None
                g = torch.zeros_like(main)
            elif g.dtype != main.dtype:
                g = g.to(main.dtype)                       # 16-bit gradients: a float32 copy
            main.grad = g.view_as(main)

    def grads_for_norm(self, norm_group: NormGroup) -> list[torch.Tensor]:
        """This rank's gradient pieces that `norm_group` counts (grads_for_norm's filter)."""
        pieces = [(record, main.grad.reshape(-1)[lo:hi]) for main, seg in zip(self.main_params, self.segments)
                  if main.grad is not None for record, lo, hi in seg.owners if norm_group.select(record)]
        return grads_for_norm(pieces, norm_group.tp_rank)

    def _found_inf(self) -> bool:
        """Stage 2: unscale, then: does any rank that holds part of the model hold a non-finite
        gradient? One all-reduce (max) of one number per group of the norm (tag "found-inf")."""
        grads = [m.grad for m in self.main_params if m.grad is not None]
        for g in grads:
            g.mul_(1.0 / self.grad_scaler.scale)
        found = torch.tensor([float(any(not bool(torch.isfinite(g).all()) for g in grads))],
                             device=self.main_params[0].device if self.main_params else None)
        for group in dict.fromkeys(g for ng in self.norm_groups for g in ng.groups):
            comm.all_reduce(found, group, op="max", tag="found-inf")
        return bool(found.item())

    @torch.no_grad()
    def step(self) -> float | None:
        """One update (the module docstring's stages). Returns the global gradient norm before
        clipping, or None when the loss scaler found inf/nan and every rank skipped the step."""
        self._main_grads_in()
        if self.grad_scaler is not None:
            found_inf = self._found_inf()
            self.grad_scaler.update(found_inf)
            if found_inf:
                return None
        norm = clip_grad_norm(self, self.clip_grad)
        self.adam.step()
        for main, param in self._copies:
            param.copy_(main)                              # the model's 16-bit copy, refreshed
        for source in self.sources:
            source.after_optimizer_step()
        return norm

    def zero_grad(self) -> None:
        for main in self.main_params:
            main.grad = None
        for source in self.sources:
            source.zero_grad()

    def state_dict(self) -> dict:
        """This rank's optimizer state (a copy): AdamW's, the main parameters when they are
        copies, the loss scaler's, and the segments' layout (elements, decay), which a load checks."""
        return {"segments": [(s.param.numel(), s.decay) for s in self.segments],
                "main_params": [main.detach().clone() for main, _ in self._copies],
                "optimizer": copy.deepcopy(self.adam.state_dict()),
                "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        mine = [(s.param.numel(), s.decay) for s in self.segments]
        theirs = [tuple(x) for x in state["segments"]]
        if theirs != mine:
            raise ValueError(f"optimizer state of another layout: saved {len(theirs)} segments of "
                             f"{sum(n for n, _ in theirs)} elements, this rank has {len(mine)} of "
                             f"{sum(n for n, _ in mine)}")
        with torch.no_grad():
            for (main, _), saved in zip(self._copies, state["main_params"]):
                main.copy_(saved)
        self.adam.load_state_dict(copy.deepcopy(state["optimizer"]))
        if self.grad_scaler is not None and state.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])


def clip_grad_norm(optimizer: Optimizer, max_norm: float) -> float:
    """Stage 3: the global gradient norm (the sum over optimizer.norm_groups of each group's
    squared norm, get_grad_norm), returned before clipping; if max_norm > 0, every gradient the
    optimizer steps is scaled by min(1, max_norm / (norm + 1e-6)) (torch's clip_grad_norm_ rule).
    Reads the main parameters' .grad (Optimizer.step sets them first)."""
    squares = sum(get_grad_norm(optimizer.grads_for_norm(ng), ng.groups, optimizer.norm_dtype)[0] ** 2
                  for ng in optimizer.norm_groups)
    norm = torch.as_tensor(squares, dtype=optimizer.norm_dtype).sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for main in optimizer.main_params:
            if main.grad is not None:
                main.grad.mul_(coef)
    return float(norm)
