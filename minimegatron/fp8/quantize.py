"""FP8 numbers and the four ways to scale a tensor into them (chapter 06).

An FP8 number has 8 bits: a sign, e exponent bits and m mantissa bits.

    format  bits       largest normal      smallest normal  smallest subnormal  torch dtype
    e4m3    1 + 4 + 3  448 = 1.75 x 2^8    2^-6             2^-9                float8_e4m3fn (no inf)
    e5m2    1 + 5 + 2  57344 = 1.75 x 2^15 2^-14            2^-16               float8_e5m2 (IEEE-like)
    e8m0    0 + 8 + 0  2^127               2^-127           -                   (MX scales: powers of 2)

e4m3 keeps one more mantissa bit (relative rounding 2^-4 = 6.25%), e5m2 twice the exponent range:
the forward's inputs and weights take e4m3, the backward's output gradients, whose range is
wider, e5m2 (the "hybrid" format). Eight bits cover far less range than bf16, so every tensor is
multiplied by a scale s before the cast and the GEMM divides it out again:

    x_fp8 = cast(clamp(x * s, -max, max))          x ~ x_fp8 / s

The recipes differ in how many scales a tensor has and where they come from:

    tensorwise (current)  one scale per tensor, from this tensor's amax: s = max / amax
    delayed               one scale per tensor ROLE, from the amaxes of earlier casts
                          (fp8/scaling.py: DelayedScaling)
    blockwise             one scale per 1 x 128 tile (inputs, output gradients) or 128 x 128
                          block (weights), a power of 2 (DeepSeek-V3's tiles, whose scales are
                          not rounded; the power of 2 is TE's Float8BlockScaling default)
    mxfp8                 one e8m0 scale (a power of 2) per 32 consecutive elements (the OCP MX
                          format; the scale rounded up as TE's MXFP8BlockScaling does)

A block's elements run along the dimension the GEMM sums over (its K), so each product of the
GEMM pairs two blocks with one scale each: x [T, K] is cut along K for the forward, along T for
the weight gradient dy^T x (TE quantizes "rowwise" and "columnwise" copies for that reason).

Every function returns a `Quantized`: the FP8 data and the scales, `dequantize()` giving back
data / scale in float32. The book's GEMMs on this CPU are emulated: dequantize both operands
and multiply in float32 (bit for bit what torch._scaled_mm returns with tensorwise scales here,
PLATFORM.md); on an H100 the same FP8 bytes go to the tensor cores.

Sources (checked 2026-11-27): torchao's float8 (float8_utils.amax_to_scale: amax in float64,
clamped at 1e-12; to_fp8_saturated: clamp, then cast), Transformer Engine's recipe docs
(Float8BlockScaling: scale = max / amax with the mantissa bits zeroed, i.e. rounded down to a
power of 2, its default unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1; MXFP8: the e8m0
exponent of amax / max rounded up by float_to_e8m0, so no element saturates; the OCP MX
spec's own rule, 2^(floor(log2 amax) - 8) for e4m3, can clamp a block's largest elements),
DeepSeek-V3's technical report section 3.3 (the 1 x 128 and 128 x 128 tiles).

torch's own casts (torch 2.13): float8_e4m3fn saturates at +-448, inf included, and keeps NaN
(older releases gave NaN from 480 up); float8_e5m2 gives inf from 61440 up. cast_to_fp8
clamps first, so it does not depend on either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FORMATS", "Quantized", "tensorwise_scale", "cast_to_fp8", "quantize_tensorwise", "quantize_blockwise",
           "quantize_mxfp8", "BLOCK", "MX_BLOCK"]

# name -> (torch dtype, largest finite value)
FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "e4m3": (torch.float8_e4m3fn, 448.0),
    "e5m2": (torch.float8_e5m2, 57344.0),
}
EPS = 1e-12        # torchao's floor on amax: an all-zero tensor gets a finite scale
BLOCK = 128        # blockwise tiles: 1 x 128 (inputs, gradients), 128 x 128 (weights)
MX_BLOCK = 32      # MXFP8: 32 consecutive elements share one e8m0 scale


@dataclass
class Quantized:
    """FP8 `data` with float32 `scale`: one number (block None), or one per block of the last
    dimension (block an int: data [.., K'] holds K'/block tiles, scale [.., K'/block]) or per
    block x block tile of a matrix (block a pair). Blocked data is zero-padded to whole blocks
    (K' >= K); `shape` is the tensor's own, which dequantize() returns."""
    data: torch.Tensor
    scale: torch.Tensor
    block: int | tuple[int, int] | None = None
    shape: tuple[int, ...] | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """data x (1 / scale) in `dtype`: float32, as a GEMM with FP8 inputs accumulates (with
        the reciprocal, as torch._scaled_mm takes it: the product of two dequantized operands
        then equals its result bit for bit), or float64 (a float64 model's emulation)."""
        x = self.data.to(dtype)
        if self.block is None:
            return x * self.scale.reciprocal().to(dtype)
        if isinstance(self.block, tuple):                                   # tiles of a matrix
            (rows, cols), (r, c) = x.shape, self.block
            x = (x.view(rows // r, r, cols // c, c) / self.scale.to(dtype)[:, None, :, None]).view(rows, cols)
        else:
            x = (x.unflatten(-1, (-1, self.block)) / self.scale.to(dtype).unsqueeze(-1)).flatten(-2)
        return x[tuple(slice(0, n) for n in self.shape)]


def _pad_to(x: torch.Tensor, multiple: int, dims: tuple[int, ...]) -> torch.Tensor:
    """x with zeros appended along `dims` up to a multiple of `multiple` (a partial last block:
    zeros change no amax). TE asks for whole blocks (for speed); the book's small models do not
    have them."""
    pad = []
    for d in range(x.dim() - 1, -1, -1):                  # F.pad lists the last dimension first
        pad += [0, (-x.shape[d]) % multiple if d in dims else 0]
    return torch.nn.functional.pad(x, pad) if any(pad) else x


def tensorwise_scale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """fp8_max / max(amax, 1e-12), computed in float64 and rounded to float32 (torchao's
    amax_to_scale, so that the book's casts equal torchao's bit for bit)."""
    return (fp8_max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """clamp(x * scale, -max, max) cast to the format: saturating, as torchao and TE cast.
    Without the clamp e4m3fn would saturate anyway but e5m2 would overflow to inf.
    x: any shape and dtype; scale: float32, one number or broadcastable to x. Returns x's shape
    in the format's torch dtype (FORMATS[fmt][0])."""
    # BEGIN EXERCISE 6.2: an FP8 cast with its scale and saturation | hint: multiply in float32; what must happen to a product beyond the format's largest number before the cast, and in which format would the cast alone make it infinite?
    dtype, fp8_max = FORMATS[fmt]
    return (x.to(torch.float32) * scale).clamp(-fp8_max, fp8_max).to(dtype)
    # END EXERCISE


def quantize_tensorwise(x: torch.Tensor, fmt: str, amax: torch.Tensor | None = None) -> Quantized:
    """One scale for the whole tensor, from its amax (or the `amax` given: reduced over the
    ranks that hold parts of the same tensor, fp8/linear.py)."""
    amax = x.detach().abs().max().to(torch.float32) if amax is None else amax
    scale = tensorwise_scale(amax, FORMATS[fmt][1])
    return Quantized(cast_to_fp8(x, scale, fmt), scale)


def _power_of_two_below(scale: torch.Tensor) -> torch.Tensor:
    """The largest power of 2 <= scale (TE zeroes the float32 mantissa bits), for finite positive scales."""
    _, exponent = torch.frexp(scale)                      # scale = mantissa x 2^exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(scale), exponent - 1)


def quantize_blockwise(x: torch.Tensor, fmt: str, two_d: bool = False) -> Quantized:
    """TE's Float8BlockScaling (DeepSeek-V3's tiles). two_d=False: x [.., K] in 1 x 128 tiles along its
    last dimension; two_d=True: a matrix [R, C] in 128 x 128 blocks. Each block's scale is
    fp8_max / amax rounded down to a power of 2 (an all-zero block: 1), so its largest element
    never saturates. No scale is shared across blocks, so no rank needs another rank's amax."""
    fp8_max = FORMATS[fmt][1]
    x32 = _pad_to(x.detach().to(torch.float32), BLOCK, (0, 1) if two_d else (x.dim() - 1,))
    if two_d:
        rows, cols = x32.shape
        tiles = x32.view(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
        amax = tiles.abs().amax(dim=(1, 3))                                        # [R/128, C/128]
        scale = torch.where(amax > 0, _power_of_two_below(fp8_max / amax.clamp(min=EPS)), torch.ones_like(amax))
        data = cast_to_fp8(tiles, scale[:, None, :, None], fmt).view(rows, cols)
        return Quantized(data, scale, (BLOCK, BLOCK), tuple(x.shape))
    tiles = x32.unflatten(-1, (-1, BLOCK))                                         # [.., K/128, 128]
    amax = tiles.abs().amax(dim=-1)                                                # [.., K/128]
    scale = torch.where(amax > 0, _power_of_two_below(fp8_max / amax.clamp(min=EPS)), torch.ones_like(amax))
    return Quantized(cast_to_fp8(tiles, scale.unsqueeze(-1), fmt).flatten(-2), scale, BLOCK, tuple(x.shape))


def quantize_mxfp8(x: torch.Tensor, fmt: str) -> Quantized:
    """TE's MXFP8BlockScaling (the OCP MX format): 32 consecutive elements along the last dimension
    share a power-of-2 scale 2^-E, E = ceil(log2(amax / fp8_max)) (TE's rounding up: the block's
    largest element lands at or below fp8_max, never saturating), stored as an e8m0 exponent
    in [-127, 127]; an all-zero block gets 2^127 (E = -127), like TE's."""
    fp8_max = FORMATS[fmt][1]
    tiles = _pad_to(x.detach().to(torch.float32), MX_BLOCK, (x.dim() - 1,)).unflatten(-1, (-1, MX_BLOCK))
    amax = tiles.abs().amax(dim=-1)                                                # [.., K/32]
    exponent = torch.ceil(torch.log2(amax / fp8_max)).clamp(-127, 127)            # log2(0) = -inf -> -127
    scale = torch.exp2(-exponent)                                                  # x * scale fits in the format
    return Quantized(cast_to_fp8(tiles, scale.unsqueeze(-1), fmt).flatten(-2), scale, MX_BLOCK, tuple(x.shape))
