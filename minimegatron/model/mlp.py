"""The MLP of a transformer layer, and its activation (shared with the experts of model/moe.py).

Shape legend as in model/gpt.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .linear import Linear


def mlp_activation(y: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """The MLP's nonlinearity on fc1's output y [..., f] (GELU) or [..., 2f] (SwiGLU: [gate; up]
    stacked on the last dim) -> [..., f]."""
    if swiglu:
        gate, up = y.chunk(2, dim=-1)                    # [..., f] each
        return F.silu(gate) * up
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_fc1(x)                           # [b, s, f] or [b, s, 2f]
        return self.linear_fc2(mlp_activation(y, self.swiglu))   # [b, s, h]
