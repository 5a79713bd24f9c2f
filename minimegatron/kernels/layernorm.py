"""LayerNorm in Triton, forward and backward (chapter 07), beside the same backward in PyTorch.

    y = layer_norm(x, weight, bias, eps)        x [.., h], weight [h], bias [h] -> [.., h]

The book's LayerNorm (model/linear.py) calls F.layer_norm; this is the same computation written
out as one program per block of rows (rmsnorm.py's kernels, CENTER). A program reads its rows
once, computes in float32, writes y, and keeps two numbers per row for the backward: mean = mean(x) and rstd = 1 / sqrt(var + eps)
(var the biased variance, as F.layer_norm's). With xhat = (x - mean) rstd and g = dy w:

    dx = rstd (g - mean(g) - xhat mean(g xhat))     (over the row's h features)
    dw = sum over rows of dy xhat
    db = sum over rows of dy

RMSNorm's backward (rmsnorm.py) is this one without the mean(g) term: centring subtracts the
mean, so its gradient subtracts mean(g). Each program sums dw and db over its own rows only
(BLOCK_ROWS of them) and writes those partial sums; PyTorch adds the programs' partials, so no
two programs write the same address. `layernorm_backward` is the same backward in PyTorch; the
tests check both against autograd through the book's LayerNorm.

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
