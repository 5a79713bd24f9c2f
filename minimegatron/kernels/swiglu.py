"""SwiGLU in Triton, forward and backward (chapter 07).

    out = swiglu(y)             y [.., 2f] = [gate; up] (fc1's output, model/mlp.py) -> [.., f]

out = silu(gate) up = gate sigmoid(gate) up. One program reads a block of rows' gate and up once
and writes out; the backward reads them again with dout and writes both halves of dy:

    d up   = dout silu(gate)
    d gate = dout up sigmoid(gate) (1 + gate (1 - sigmoid(gate)))

so it keeps only y, as Megatron's fused SwiGLU does (megatron/core/fusions/fused_bias_swiglu.py,
which torch.compile fuses on the GPU); the book's PyTorch SwiGLU (model/mlp.py) keeps silu(gate)
as well. Computed in float32 (16-bit inputs upcast before the launch), returned in y's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rmsnorm import load_f32

__all__ = ["swiglu"]


@triton.jit
def _swiglu_forward(Y, OUT, rows, f, BLOCK_ROWS: tl.constexpr, BLOCK_F: tl.constexpr):
    cols = tl.arange(0, BLOCK_F)
    for i in range(BLOCK_ROWS):
        row = tl.program_id(0) * BLOCK_ROWS + i
        if row < rows:
            gate, up = load_f32(Y + row * 2 * f, cols, f), load_f32(Y + row * 2 * f + f, cols, f)
            tl.store(OUT + row * f + cols, gate * tl.sigmoid(gate) * up, mask=cols < f)


@triton.jit
def _swiglu_backward(DOUT, Y, DY, rows, f, BLOCK_ROWS: tl.constexpr, BLOCK_F: tl.constexpr):
    cols = tl.arange(0, BLOCK_F)
    for i in range(BLOCK_ROWS):
        row = tl.program_id(0) * BLOCK_ROWS + i
        if row < rows:
            gate, up = load_f32(Y + row * 2 * f, cols, f), load_f32(Y + row * 2 * f + f, cols, f)
            dout = load_f32(DOUT + row * f, cols, f)
            sig = tl.sigmoid(gate)
            tl.store(DY + row * 2 * f + cols, dout * up * sig * (1.0 + gate * (1.0 - sig)), mask=cols < f)
            tl.store(DY + row * 2 * f + f + cols, dout * gate * sig, mask=cols < f)


class SwiGLUFunction(torch.autograd.Function):
    """swiglu as an autograd op; saves y only."""

    @staticmethod
    def forward(ctx, y, block_rows: int):
        two_f, ctx.dtype = y.shape[-1], y.dtype
        y2 = y.reshape(-1, two_f).float().contiguous()                              # the kernels' float32
        n, f = y2.shape[0], two_f // 2
        out = torch.empty(n, f, dtype=torch.float32, device=y.device)
        _swiglu_forward[(triton.cdiv(n, block_rows),)](y2, out, n, f, BLOCK_ROWS=block_rows,
                                                       BLOCK_F=triton.next_power_of_2(f))
        ctx.save_for_backward(y2)
        ctx.block_rows, ctx.shape = block_rows, y.shape
        return out.to(ctx.dtype).view(*y.shape[:-1], f)

    @staticmethod
    def backward(ctx, dout):
        (y2,) = ctx.saved_tensors
        n, f = y2.shape[0], y2.shape[1] // 2
        dy = torch.empty(n, 2 * f, dtype=torch.float32, device=y2.device)
        _swiglu_backward[(triton.cdiv(n, ctx.block_rows),)](dout.reshape(-1, f).float().contiguous(), y2, dy, n, f,
                                                            BLOCK_ROWS=ctx.block_rows,
                                                            BLOCK_F=triton.next_power_of_2(f))
        return dy.to(ctx.dtype).view(ctx.shape), None


def swiglu(y: torch.Tensor, block_rows: int = 8) -> torch.Tensor:
    """silu(gate) * up on y = [gate; up] [.., 2f] -> [.., f] (the Triton kernels above)."""
    return SwiGLUFunction.apply(y, block_rows)
