"""What stops a run that trains nothing but inf and nan, on every rank together (train.py calls them).

    check_finite_step        a loss or global gradient norm that is inf or nan (every iteration)
    check_skipped_steps      a loss scale that cannot go lower and overflows on every step of a window
    check_finite_parameters  parameters that are not finite when a checkpoint is due (nothing is saved)
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .analysis.memory import held_parameters
from .comm import all_reduce
from .config import TrainConfig
from .dp import unwrap
from .grad_scaler import ConstantGradScaler, DynamicGradScaler
from .optim import Optimizer

__all__ = ["NonFiniteError", "check_finite_step", "SKIPPED_STEPS_WINDOW", "scale_cannot_go_lower",
           "check_skipped_steps", "check_finite_parameters"]


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm of an iteration is inf or nan, the parameters about to be
    saved are, or the loss scaler skipped every step of a window: the run stops."""


def check_finite_step(iteration: int, loss: float, grad_norm: float | None, optimizer: Optimizer) -> None:
    """NonFiniteError naming `iteration` (counted from 1, as the checkpoints iter_N) when its
    loss or global gradient norm is inf or nan, the same numbers on every rank (all-reduced), so
    every rank stops together. With a loss scaler (fp16) too: its signal is an inf or nan in the
    scaled gradients (the step is skipped: no norm, no error); a non-finite loss comes before any
    scale and no scale can undo it. Megatron-LM: check_for_nan_in_loss_and_grad (off under
    dynamic loss scaling there)."""
    bad = ([f"the loss is {loss}"] if not math.isfinite(loss) else []) + \
          ([f"the gradient norm is {grad_norm}"] if grad_norm is not None and not math.isfinite(grad_norm) else [])
    if bad:
        lr = optimizer.param_groups[0]["lr"]
        scaler = (f" at loss scale {optimizer.loss_scale:g}" if optimizer.grad_scaler is not None else "")
        raise NonFiniteError(f"iteration {iteration}: {' and '.join(bad)}{scaler}; training stopped before saving "
                             f"it (its learning rate was {lr:.3g}: too large a --lr, --init-method-std or loss weight "
                             f"is the usual cause)")


# skipped steps in a row, at a loss scale that cannot go lower, that stop the run: a skipped step
# keeps the weights, so only the batch changed, and ten batches that overflow say the scale is too large
SKIPPED_STEPS_WINDOW = 10


def scale_cannot_go_lower(optimizer: Optimizer) -> bool:
    """Is the optimizer's loss scale where an overflow leaves it: constant (--loss-scale), or
    the dynamic one at --min-loss-scale? False without a loss scaler."""
    scaler = optimizer.grad_scaler
    return isinstance(scaler, ConstantGradScaler) or (isinstance(scaler, DynamicGradScaler)
                                                       and scaler.scale <= scaler.min_scale)


def check_skipped_steps(iteration: int, in_a_row: int, steps_run: int, cfg: TrainConfig,
                        optimizer: Optimizer) -> None:
    """NonFiniteError naming the loss scale when the last `in_a_row` steps (up to `iteration`)
    were all skipped at a scale that cannot go lower (scale_cannot_go_lower), and they are a
    whole window: SKIPPED_STEPS_WINDOW steps, or every step this run has made
    (`steps_run`) once it reaches its last iteration. Every rank decides alike (the skip is
    agreed on every rank)."""
    window = min(SKIPPED_STEPS_WINDOW, steps_run if iteration == cfg.train_iters else SKIPPED_STEPS_WINDOW)
    if in_a_row == 0 or in_a_row < window:
        return
    scale = optimizer.loss_scale
    source = (f"--loss-scale {scale:g}" if cfg.loss_scale is not None else
              f"--min-loss-scale {cfg.min_loss_scale:g}, where the dynamic scale stopped")
    raise NonFiniteError(f"iterations {iteration - in_a_row + 1}-{iteration}: the loss scaler skipped every step: the "
                         f"gradients, scaled by {scale:g} ({source}), overflow on every batch, and the scale "
                         f"cannot go lower; training stopped before saving iteration {iteration}. Give a smaller "
                         f"{'--loss-scale (a power of 2)' if cfg.loss_scale is not None else '--min-loss-scale'}")


def check_finite_parameters(chunks: list[nn.Module], optimizer: Optimizer, step: int) -> None:
    """NonFiniteError before saving iteration `step` when a parameter this run would save (the
    model's, or the optimizer's float32 main copies) holds an inf or nan on any rank: a
    checkpoint is never written with non-finite weights. One all-reduce (max) over the world."""
    tensors = held_parameters(chunks) + list(optimizer.main_params)
    bad = sorted({name for c in chunks for name, p in unwrap(c).named_parameters() if not bool(torch.isfinite(p).all())})
    found = torch.tensor([float(bool(bad) or any(not bool(torch.isfinite(t).all()) for t in tensors))],
                         device=tensors[0].device if tensors else None)
    all_reduce(found, None, op="max", tag="checkpoint")
    if found.item():
        where = f" ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})" if bad else ""
        raise NonFiniteError(f"iteration {step}: parameters are not finite{where}; the checkpoint was not saved")
