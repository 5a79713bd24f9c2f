"""The small building blocks: the two seams every precision and kernel plugs into, a linear
layer with Megatron's weight layout, and the norms.

  compute_dtype(x)   the dtype norms, softmaxes and losses compute in: float32 for 16-bit
                     inputs, else the input's
  Gemm               a linear layer's three products, fprop, dgrad, wgrad; every weight matmul
                     of the book goes through a layer's `gemm` (chapter 06's FP8 gives a layer
                     its own; `GEMM` is the plain, shared one)

Parameters are created empty; `minimegatron.model.init` sets each from (seed, name)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Norms, softmaxes and losses run in float32 for 16-bit inputs, in the input dtype otherwise."""
    return torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype


class Gemm:
    """The matrix products of a linear layer, W: [out, in].

    fprop(x, w, b)  x [.., in] -> x W^T + b [.., out]
    dgrad(dy, w)    dy [.., out] -> dy W [.., in]
    wgrad(dy, x)    dy^T x [out, in] (leading dimensions flattened)
    linear(x, w, b) fprop as an autograd op (w may be a stack [E, out, in] with x [E, .., in])
    gather_input(x, group, dim, tag)  the sequence-parallel all-gather before fprop (comm.all_gather)
    set_recompute(phase)  "checkpointed", "recomputing" or None (chapter 07), for stateful GEMMs
    Transformer Engine names them fprop, dgrad, wgrad too."""

    def set_recompute(self, phase: str | None) -> None:
        pass

    def fprop(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, w, b)

    def dgrad(self, dy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return dy @ w

    def wgrad(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])

    def gather_input(self, x: torch.Tensor, group, dim: int, tag: str) -> torch.Tensor:
        from ..comm import all_gather
        return all_gather(x, group, dim=dim, tag=tag)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if w.dim() == 2:
            return F.linear(x, w, b)
        y = x @ w.transpose(-2, -1)                                 # [E, .., in] x [E, in, out]
        return y if b is None else y + b.unsqueeze(-2)


GEMM = Gemm()


class Linear(nn.Module):
    """y = x W^T + b with W: [out_features, in_features] (Megatron's layout).
    skip_weight_param_allocation: no weight of its own; forward is given one (a tied output layer).
    gemm: its matrix products."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 skip_weight_param_allocation: bool = False):
        super().__init__()
        self.weight = None if skip_weight_param_allocation else nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.gemm = GEMM

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        return self.gemm.linear(x, weight, self.bias)               # [.., in] -> [.., out]


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dimension."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.bias = nn.Parameter(torch.empty(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x)
        y = F.layer_norm(x.to(dtype), x.shape[-1:], self.weight.to(dtype), self.bias.to(dtype), self.eps)
        return y.to(x.dtype)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension (no centring, no bias)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x.to(compute_dtype(x))
        y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(xc.dtype)).to(x.dtype)


def build_norm(kind: str, hidden_size: int, eps: float) -> nn.Module:
    return LayerNorm(hidden_size, eps) if kind == "LayerNorm" else RMSNorm(hidden_size, eps)
