"""The MLP of a transformer layer, and its activation (shared with the experts of model/moe.py).

Shape legend as in model/gpt.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..config import ModelConfig
from .linear import Linear


class SwiGLU(torch.autograd.Function):
    """silu(gate) * up on y = [gate; up] [..., 2f] -> [..., f], with a hand-written backward.

    Values and gradients as autograd's `gate, up = y.chunk(2, -1); F.silu(gate) * up`, but both
    halves of dy are written straight into one [..., 2f] tensor (no concatenation pass):
        d up   = d out * silu(gate)
        d gate = d out * up * silu'(gate)           silu'(x) = sig(x) (1 + x (1 - sig(x)))
    Saves y and silu(gate). Megatron-LM: megatron/core/fusions/fused_bias_swiglu.py (SwiGLUFunction)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        gate, up = y.chunk(2, dim=-1)                    # [..., f] each (views of y)
        act = F.silu(gate)                               # [..., f]
        ctx.save_for_backward(y, act)
        return act * up                                  # [..., f]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> torch.Tensor:
        y, act = ctx.saved_tensors
        gate, up = y.chunk(2, dim=-1)
        grad_y = torch.empty_like(y)                     # [..., 2f]
        grad_gate, grad_up = grad_y.chunk(2, dim=-1)     # views: written in place below
        torch.mul(grad_out, act, out=grad_up)
        # silu's own derivative kernel (the one autograd runs for F.silu), into the gate half
        torch.ops.aten.silu_backward.grad_input(grad_out * up, gate, grad_input=grad_gate)
        return grad_y


def mlp_activation(y: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """The MLP's nonlinearity on fc1's output y [..., f] (GELU) or [..., 2f] (SwiGLU: [gate; up]
    stacked on the last dim) -> [..., f]."""
    if swiglu:
        return SwiGLU.apply(y)                           # silu(gate) * up
    return F.gelu(y)


class MLP(nn.Module):
    """[b, s, h] (or [T, h]) -> the same shape: fc1, activation, fc2.

    GELU:   fc2(gelu(fc1 x))                         fc1: [f, h]
    SwiGLU: fc2(silu(gate x) * (up x)), with fc1 = [gate; up] stacked: [2f, h]

    ffn_hidden_size: the inner width f (default config.ffn_size; an expert passes
    config.moe_ffn_size, a shared expert moe_shared_expert_intermediate_size).
    """

    def __init__(self, config: ModelConfig, ffn_hidden_size: int | None = None):
        super().__init__()
        self.swiglu = config.activation == "swiglu"
        h, f = config.hidden_size, ffn_hidden_size or config.ffn_size
        self.linear_fc1 = Linear(h, 2 * f if self.swiglu else f, bias=config.add_bias_linear)
        self.linear_fc2 = Linear(f, h, bias=config.add_bias_linear)

    def activation(self, y: torch.Tensor) -> torch.Tensor:
        """fc1's output [.., f] or [.., 2f] -> [.., f] (chapter 07's "moe_act" recomputes an
        expert's in the backward)."""
        return mlp_activation(y, self.swiglu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_fc1(x)                           # [b, s, f] or [b, s, 2f]
        return self.linear_fc2(self.activation(y))       # [b, s, h]
