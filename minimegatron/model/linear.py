"""The small building blocks: a linear layer with Megatron's weight layout, and the norms.

Parameters are created empty here; their values are set by `minimegatron.model.init`,
which derives each one from (seed, parameter name) only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Norms and losses run in float32 for 16-bit inputs, in the input dtype otherwise."""
    return torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype


class Linear(nn.Module):
    """y = x W^T + b with W: [out_features, in_features] (the layout Megatron stores).

    skip_weight_param_allocation: hold no weight of its own; forward is then given one (a
    tied output layer reads the word embedding, as Megatron's ColumnParallelLinear does).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 skip_weight_param_allocation: bool = False):
        super().__init__()
        self.weight = None if skip_weight_param_allocation else nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        return F.linear(x, weight, self.bias)                      # [.., in] -> [.., out]


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dimension."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.bias = nn.Parameter(torch.empty(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.to(_compute_dtype(x)), x.shape[-1:], self.weight.to(_compute_dtype(x)),
                         self.bias.to(_compute_dtype(x)), self.eps)
        return y.to(x.dtype)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension (no centring, no bias)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x.to(_compute_dtype(x))
        y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(xc.dtype)).to(x.dtype)


def build_norm(kind: str, hidden_size: int, eps: float) -> nn.Module:
    return LayerNorm(hidden_size, eps) if kind == "LayerNorm" else RMSNorm(hidden_size, eps)
