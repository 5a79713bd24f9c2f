"""The small building blocks: the two seams every precision and kernel plugs into, a linear
layer with Megatron's weight layout, and the norms.

The seams (chapters 06 and 07 swap what they return; tp/, moe/ and the model stay as they are):

  compute_dtype(x)   the dtype a norm, a softmax or a loss computes in: float32 for 16-bit
                     inputs, the input's own otherwise (Megatron's --attention-softmax-in-fp32
                     and fp32 residual arithmetic, in one place)
  Gemm               the three matrix products of a linear layer y = x W^T + b: the forward
                     (fprop), the input's gradient (dgrad) and the weight's (wgrad). Every
                     weight matmul of the book goes through a layer's `gemm`: this Linear, the
                     tensor-parallel layers' hand-written backwards (tp/layers.py) and the
                     experts' batched form (model/moe.py). `GEMM` is the plain one; an FP8
                     transformation gives a layer one of its own (Transformer Engine calls the
                     three fprop, dgrad and wgrad, as in its recipes' fp8_gemm_fprop/dgrad/wgrad;
                     torchao output, grad_input and grad_weight).

Parameters are created empty here; their values are set by `minimegatron.model.init`,
which derives each one from (seed, parameter name) only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Norms, softmaxes and losses run in float32 for 16-bit inputs, in the input dtype otherwise."""
    return torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype


class Gemm:
    """The matrix products of a linear layer, W: [out, in] (shape legend of model/gpt.py).

    fprop(x, w, b)  x [.., in] -> x W^T + b [.., out]   (inside a hand-written forward)
    dgrad(dy, w)    dy [.., out] -> dy W [.., in]        (the input's gradient)
    wgrad(dy, x)    dy^T x [out, in], the leading dimensions of dy [.., out] and x [.., in]
                    flattened into one (the weight's gradient)
    linear(x, w, b) fprop as an autograd op (a module's forward; w may be a stack [E, out, in]
                    of the experts' weights with x [E, .., in]); here torch's own backward,
                    whose products are dgrad and wgrad's
    gather_input(x, group, dim, tag)  the sequence-parallel all-gather of a column-parallel
                    layer's input before fprop (comm.all_gather; an FP8 GEMM gathers its FP8
                    bytes instead, chapter 06)
    set_recompute(phase)  chapter 07's recompute tells the layer which forward runs: "checkpointed"
                    (the first, whose activations are dropped), "recomputing" (the same forward
                    again, in the backward), None (an ordinary one); a GEMM with state (FP8's
                    scales) makes the recompute compute what the first forward did
    The default products are torch's; they hold no state, so every layer shares `GEMM`."""

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
    """y = x W^T + b with W: [out_features, in_features] (the layout Megatron stores).

    skip_weight_param_allocation: hold no weight of its own; forward is then given one (a
    tied output layer reads the word embedding, as Megatron's ColumnParallelLinear does).
    gemm: its matrix products (the seam above).
    """

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
