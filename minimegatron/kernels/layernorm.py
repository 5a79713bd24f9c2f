"""LayerNorm in Triton, forward and backward (chapter 07), beside the same backward in PyTorch.

    y = layer_norm(x, weight, bias, eps)        x [.., h], weight [h], bias [h] -> [.., h]

F.layer_norm written out as rmsnorm.py's kernels with CENTER: a program keeps two numbers per
row, mean = mean(x) and rstd = 1 / sqrt(var + eps) (the biased variance, as F.layer_norm's).
With xhat = (x - mean) rstd and g = dy w:

    dx = rstd (g - mean(g) - xhat mean(g xhat))     (over the row's h features)
    dw = sum over rows of dy xhat
    db = sum over rows of dy

RMSNorm's backward without the mean(g) term: centring subtracts the mean, so its gradient
subtracts mean(g); db is summed from the programs' partials as dw is. `layernorm_backward` is
the same backward in PyTorch.

Megatron-LM: Transformer Engine's fused LayerNorm (megatron/core/extensions/transformer_engine.py,
TENorm) or Apex's (megatron/core/fusions/fused_layer_norm.py).
"""

from __future__ import annotations

import torch

from .rmsnorm import NormFunction

__all__ = ["layer_norm", "layernorm_backward"]


def layernorm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                       rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of y = xhat w + b, xhat = (x - mean) rstd over the last dimension:
    dy, x [N, h], weight [h], mean and rstd [N] (the forward's) -> (dx [N, h], dw [h], db [h]).
    With g = dy w: dx = rstd (g - mean(g) - xhat mean(g xhat)), dw = sum dy xhat, db = sum dy."""
    xhat = (x - mean[:, None]) * rstd[:, None]                                # [N, h]
    g = dy * weight                                                          # [N, h]
    dx = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))   # [N, h]
    return dx, (dy * xhat).sum(dim=0), dy.sum(dim=0)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               block_rows: int = 8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dimension, computed in float32,
    returned in x's dtype: the book's LayerNorm, fused (rmsnorm.py's Triton kernels, centred)."""
    return NormFunction.apply(x, weight, bias, eps, block_rows)
