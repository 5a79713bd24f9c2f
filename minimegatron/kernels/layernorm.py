"""LayerNorm in Triton, forward and backward (chapter 07), beside the same backward in PyTorch.

    y = layer_norm(x, weight, bias, eps)        x [.., h], weight [h], bias [h] -> [.., h]

The book's LayerNorm (model/linear.py) calls F.layer_norm; this is the same computation written
out as one program per block of rows. A program reads its rows once, computes in float32, writes
y, and keeps two numbers per row for the backward: mean = mean(x) and rstd = 1 / sqrt(var + eps)
(var the biased variance, as F.layer_norm's). With xhat = (x - mean) rstd and g = dy w:

    dx = rstd (g - mean(g) - xhat mean(g xhat))     (over the row's h features)
    dw = sum over rows of dy xhat
    db = sum over rows of dy

RMSNorm's backward (rmsnorm.py) is this one without the mean(g) term: centring subtracts the
mean, so its gradient subtracts mean(g). Each program sums dw and db over its own rows only
(BLOCK_ROWS of them) and writes those partial sums; PyTorch adds the programs' partials, so no
two programs write the same address. `layernorm_backward` is the same backward in PyTorch; the
tests check both against autograd through the book's LayerNorm. 16-bit inputs are upcast before
the launch (flash_attention.py says why).

Megatron-LM: Transformer Engine's fused LayerNorm (megatron/core/extensions/transformer_engine.py,
TENorm) or Apex's (megatron/core/fusions/fused_layer_norm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rmsnorm import load_f32

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


@triton.jit
def _layernorm_forward(X, W, B, Y, MEAN, RSTD, rows, h, eps, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    cols = tl.arange(0, BLOCK_H)
    w = load_f32(W, cols, h)
    b = load_f32(B, cols, h)
    for i in range(BLOCK_ROWS):
        row = tl.program_id(0) * BLOCK_ROWS + i
        if row < rows:
            x = load_f32(X + row * h, cols, h)
            mean = tl.sum(x, 0) / h
            xc = tl.where(cols < h, x - mean, 0.0)                 # the padding columns stay 0
            rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / h + eps)
            tl.store(Y + row * h + cols, xc * rstd * w + b, mask=cols < h)
            tl.store(MEAN + row, mean)
            tl.store(RSTD + row, rstd)


@triton.jit
def _layernorm_backward(DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, rows, h,
                        BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    cols = tl.arange(0, BLOCK_H)
    w = load_f32(W, cols, h)
    dw = tl.zeros([BLOCK_H], tl.float32)
    db = tl.zeros([BLOCK_H], tl.float32)
    for i in range(BLOCK_ROWS):
        row = tl.program_id(0) * BLOCK_ROWS + i
        if row < rows:
            x, dy = load_f32(X + row * h, cols, h), load_f32(DY + row * h, cols, h)
            mean, rstd = tl.load(MEAN + row), tl.load(RSTD + row)
            xhat = tl.where(cols < h, (x - mean) * rstd, 0.0)
            g = dy * w                                             # 0 in the padding columns (dy, w are)
            dx = rstd * (g - tl.sum(g, 0) / h - xhat * (tl.sum(g * xhat, 0) / h))
            tl.store(DX + row * h + cols, dx, mask=cols < h)
            dw += dy * xhat
            db += dy
    tl.store(DW_PARTIAL + tl.program_id(0) * h + cols, dw, mask=cols < h)
    tl.store(DB_PARTIAL + tl.program_id(0) * h + cols, db, mask=cols < h)


class LayerNormFunction(torch.autograd.Function):
    """layer_norm as an autograd op; saves x, weight, mean [N] and rstd [N] (float32)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, block_rows: int):
        shape, h, ctx.dtypes = x.shape, x.shape[-1], (x.dtype, weight.dtype, bias.dtype)
        x2, weight, bias = x.reshape(-1, h).float().contiguous(), weight.float(), bias.float()   # the kernels' float32
        n = x2.shape[0]
        y = torch.empty(n, h, dtype=torch.float32, device=x.device)                    # [N, h]
        mean = torch.empty(n, dtype=torch.float32, device=x.device)                    # [N]
        rstd = torch.empty(n, dtype=torch.float32, device=x.device)                    # [N]
        _layernorm_forward[(triton.cdiv(n, block_rows),)](x2, weight, bias, y, mean, rstd, n, h, eps,
                                                          BLOCK_ROWS=block_rows, BLOCK_H=triton.next_power_of_2(h))
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.block_rows, ctx.shape = block_rows, shape
        return y.to(ctx.dtypes[0]).view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        n, h = x2.shape
        programs = triton.cdiv(n, ctx.block_rows)
        dx = torch.empty(n, h, dtype=torch.float32, device=x2.device)                  # [N, h]
        dw = torch.empty(programs, h, dtype=torch.float32, device=x2.device)           # each program's dw
        db = torch.empty(programs, h, dtype=torch.float32, device=x2.device)           # each program's db
        _layernorm_backward[(programs,)](dy.reshape(-1, h).float().contiguous(), x2, weight, mean, rstd, dx, dw, db,
                                         n, h, BLOCK_ROWS=ctx.block_rows, BLOCK_H=triton.next_power_of_2(h))
        return (dx.to(ctx.dtypes[0]).view(ctx.shape), dw.sum(0).to(ctx.dtypes[1]), db.sum(0).to(ctx.dtypes[2]),
                None, None)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               block_rows: int = 8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dimension, computed in float32,
    returned in x's dtype: the book's LayerNorm, fused (the Triton kernels above)."""
    return LayerNormFunction.apply(x, weight, bias, eps, block_rows)
