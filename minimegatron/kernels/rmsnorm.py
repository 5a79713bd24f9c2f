"""RMSNorm in Triton, forward and backward (chapter 07), beside the same backward in PyTorch.

    y = rms_norm(x, weight, eps)        x [.., h], weight [h] -> [.., h]

The book's RMSNorm (model/linear.py) is five PyTorch ops, each a pass over [.., h] in memory
(pow, mean, rsqrt, two multiplies), and autograd keeps their inputs. Fused, one program reads a
block of rows once, computes in float32, writes y, and keeps one number per row for the
backward: rstd = 1 / sqrt(mean(x^2) + eps). With xhat = x rstd and g = dy w:

    dx = rstd (g - xhat mean(g xhat))          (over the row's h features)
    dw = sum over rows of dy xhat

Each program sums dw over its own rows only (BLOCK_ROWS of them) and writes that partial sum;
PyTorch adds the programs' partials (one [programs, h] tensor), so no two programs write the
same address. `rmsnorm_backward` is the same backward in PyTorch (exercise 7.4); the tests
check both against autograd through the book's RMSNorm. 16-bit inputs are upcast before the
launch (flash_attention.py says why).

Megatron-LM (main d98e8a6, checked 2026-12-07): Transformer Engine's fused RMSNorm
(megatron/core/extensions/transformer_engine.py, TENorm); without Transformer Engine, PyTorch's
torch.nn.RMSNorm through megatron/core/transformer/torch_norm.py (WrappedTorchNorm). Apex's
megatron/core/fusions/fused_layer_norm.py (FusedLayerNorm) is LayerNorm only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["load_f32", "rms_norm", "rmsnorm_backward"]


def rmsnorm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of y = x rstd w, rstd = 1 / sqrt(mean(x^2) + eps) over the last dimension:
    dy, x [N, h], weight [h], rstd [N] (the forward's) -> (dx [N, h], dw [h]), all float32."""
    # BEGIN EXERCISE 7.4: RMSNorm's backward | hint: x reaches y twice, directly and through rstd, which every feature of the row shares; differentiate the mean of squares, and sum dw over the rows
    xhat = x * rstd[:, None]                                                 # [N, h]
    g = dy * weight                                                          # [N, h]
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    return dx, (dy * xhat).sum(dim=0)
    # END EXERCISE


@triton.jit
def load_f32(PTR, cols, n):
    """PTR[cols] as float32, 0.0 where cols >= n (a block's padding columns); the row kernels' load."""
    return tl.load(PTR + cols, mask=cols < n, other=0.0).to(tl.float32)


@triton.jit
def _norm_forward(X, W, B, Y, MEAN, RSTD, rows, h, eps, CENTER: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """RMSNorm; with CENTER, layernorm.py's LayerNorm (the row's mean subtracted first, kept in MEAN,
    and the bias B added; both unused without it)."""
    cols = tl.arange(0, BLOCK_H)
    w = load_f32(W, cols, h)
    for i in range(BLOCK_ROWS):
        row = tl.program_id(0) * BLOCK_ROWS + i
        if row < rows:
            x = load_f32(X + row * h, cols, h)
            if CENTER:
                mean = tl.sum(x, 0) / h
                x = tl.where(cols < h, x - mean, 0.0)              # the padding columns stay 0
                tl.store(MEAN + row, mean)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / h + eps)
            y = x * rstd * w
            if CENTER:
                y = y + load_f32(B, cols, h)
            tl.store(Y + row * h + cols, y, mask=cols < h)
            tl.store(RSTD + row, rstd)


@triton.jit
def _norm_backward(DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, rows, h, CENTER: tl.constexpr,
                   BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    cols = tl.arange(0, BLOCK_H)
    w = load_f32(W, cols, h)
    dw = tl.zeros([BLOCK_H], tl.float32)
    db = tl.zeros([BLOCK_H], tl.float32)
    for i in range(BLOCK_ROWS):
        row = tl.program_id(0) * BLOCK_ROWS + i
        if row < rows:
            x, dy = load_f32(X + row * h, cols, h), load_f32(DY + row * h, cols, h)
            rstd = tl.load(RSTD + row)
            g = dy * w                                             # 0 in the padding columns (dy, w are)
            if CENTER:
                xhat = tl.where(cols < h, (x - tl.load(MEAN + row)) * rstd, 0.0)
                dx = rstd * (g - tl.sum(g, 0) / h - xhat * (tl.sum(g * xhat, 0) / h))
                db += dy
            else:
                xhat = x * rstd
                dx = rstd * (g - xhat * (tl.sum(g * xhat, 0) / h))
            tl.store(DX + row * h + cols, dx, mask=cols < h)
            dw += dy * xhat
    tl.store(DW_PARTIAL + tl.program_id(0) * h + cols, dw, mask=cols < h)
    if CENTER:
        tl.store(DB_PARTIAL + tl.program_id(0) * h + cols, db, mask=cols < h)


class NormFunction(torch.autograd.Function):
    """rms_norm (bias None) or layer_norm as an autograd op; saves x, weight, rstd [N] and for
    LayerNorm mean [N] (float32)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, block_rows: int):
        shape, h, ctx.dtypes = x.shape, x.shape[-1], (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        x2, weight = x.reshape(-1, h).float().contiguous(), weight.float()        # the kernels' float32
        n, ctx.center = x2.shape[0], bias is not None
        y = torch.empty(n, h, dtype=torch.float32, device=x.device)                    # [N, h]
        rstd = torch.empty(n, dtype=torch.float32, device=x.device)                    # [N]
        mean = torch.empty(n, dtype=torch.float32, device=x.device) if ctx.center else rstd   # [N] (unused: RMSNorm)
        _norm_forward[(triton.cdiv(n, block_rows),)](x2, weight, bias.float() if ctx.center else weight, y, mean, rstd,
                                                     n, h, eps, CENTER=ctx.center, BLOCK_ROWS=block_rows,
                                                     BLOCK_H=triton.next_power_of_2(h))
        ctx.save_for_backward(x2, weight, rstd, *((mean,) if ctx.center else ()))
        ctx.block_rows, ctx.shape = block_rows, shape
        return y.to(ctx.dtypes[0]).view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd, *mean = ctx.saved_tensors
        n, h = x2.shape
        programs = triton.cdiv(n, ctx.block_rows)
        dx = torch.empty(n, h, dtype=torch.float32, device=x2.device)                  # [N, h]
        dw = torch.empty(programs, h, dtype=torch.float32, device=x2.device)           # each program's dw
        db = torch.empty(programs, h, dtype=torch.float32, device=x2.device) if ctx.center else dw   # and db
        _norm_backward[(programs,)](dy.reshape(-1, h).float().contiguous(), x2, weight, mean[0] if mean else rstd,
                                    rstd, dx, dw, db, n, h, CENTER=ctx.center, BLOCK_ROWS=ctx.block_rows,
                                    BLOCK_H=triton.next_power_of_2(h))
        return (dx.to(ctx.dtypes[0]).view(ctx.shape), dw.sum(0).to(ctx.dtypes[1]),
                db.sum(0).to(ctx.dtypes[2]) if ctx.center else None, None, None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, block_rows: int = 8) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, computed in float32, returned
    in x's dtype: the book's RMSNorm, fused (the Triton kernels above)."""
    return NormFunction.apply(x, weight, None, eps, block_rows)
