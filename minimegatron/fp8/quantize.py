"""FP8 numbers and the four ways to scale a tensor into them (chapter 06).

    format  bits       largest normal      smallest normal  smallest subnormal  torch dtype
    e4m3    1 + 4 + 3  448 = 1.75 x 2^8    2^-6             2^-9                float8_e4m3fn (no inf)
    e5m2    1 + 5 + 2  57344 = 1.75 x 2^15 2^-14            2^-16               float8_e5m2 (IEEE-like)
    e8m0    0 + 8 + 0  2^127               2^-127           -                   (MX scales: powers of 2)

Every tensor is multiplied by a scale s before the cast, which the GEMM divides out again:
x_fp8 = cast(clamp(x * s, -max, max)), x ~ x_fp8 / s. The recipes:

    tensorwise (current)  one scale per tensor, s = max / amax of this tensor
    delayed               one scale per tensor ROLE, from earlier amaxes (fp8/scaling.py)
    blockwise             one power-of-2 scale per 1 x 128 tile (inputs, output gradients) or
                          128 x 128 block (weights) (TE's Float8BlockScaling, DeepSeek-V3's tiles)
    mxfp8                 one e8m0 scale per 32 consecutive elements, rounded up (OCP MX, TE's
                          MXFP8BlockScaling)

Blocks run along the dimension the GEMM sums over (x [T, K] along K for fprop, along T for
wgrad). Every function returns a `Quantized` (FP8 data and float32 scales). Rounding rules
follow torchao's float8 (amax_to_scale, to_fp8_saturated) and Transformer Engine's recipes."""

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
    """FP8 `data` with float32 `scale`: one number (block None), one per block of the last dimension
    (block an int: data [.., K'], scale [.., K'/block]) or per block x block tile (block a pair).
    Blocked data is zero-padded to whole blocks (K' >= K); `shape` is the tensor's own."""
    data: torch.Tensor
    scale: torch.Tensor
    block: int | tuple[int, int] | None = None
    shape: tuple[int, ...] | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """data x (1 / scale) in `dtype`: float32 (bit for bit what torch._scaled_mm's product of two such
        operands gives) or float64 (a float64 model's emulation); returns `shape`."""
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
    """x with zeros appended along `dims` to a multiple of `multiple` (zeros change no amax)."""
    pad = []
    for d in range(x.dim() - 1, -1, -1):                  # F.pad lists the last dimension first
        pad += [0, (-x.shape[d]) % multiple if d in dims else 0]
    return torch.nn.functional.pad(x, pad) if any(pad) else x


def tensorwise_scale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """fp8_max / max(amax, 1e-12), in float64 rounded to float32 (torchao's amax_to_scale, bit for bit)."""
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
    """TE's Float8BlockScaling: two_d=False, x [.., K] in 1 x 128 tiles along K; two_d=True, a matrix
    [R, C] in 128 x 128 blocks. Each scale is fp8_max / amax rounded down to a power of 2 (all-zero
    block: 1), so nothing saturates and no amax crosses ranks."""
    fp8_max = FORMATS[fmt][1]
    x32 = _pad_to(x.detach().to(torch.float32), BLOCK, (0, 1) if two_d else (x.dim() - 1,))
    if two_d:
        rows, cols = x32.shape
        tiles, dims = x32.view(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK), (1, 3)   # [R/128, 128, C/128, 128]
    else:
        tiles, dims = x32.unflatten(-1, (-1, BLOCK)), (-1,)                         # [.., K/128, 128]
    amax = tiles.abs().amax(dim=dims, keepdim=True)                                 # 1 per tile
    scale = torch.where(amax > 0, _power_of_two_below(fp8_max / amax.clamp(min=EPS)), torch.ones_like(amax))
    data = cast_to_fp8(tiles, scale, fmt).view(x32.shape)
    return Quantized(data, scale.squeeze(dims), (BLOCK, BLOCK) if two_d else BLOCK, tuple(x.shape))


def quantize_mxfp8(x: torch.Tensor, fmt: str) -> Quantized:
    """TE's MXFP8BlockScaling: 32 consecutive elements of the last dimension share 2^-E,
    E = ceil(log2(amax / fp8_max)) (nothing saturates), stored as an e8m0 exponent in [-127, 127];
    an all-zero block gets 2^127."""
    fp8_max = FORMATS[fmt][1]
    tiles = _pad_to(x.detach().to(torch.float32), MX_BLOCK, (x.dim() - 1,)).unflatten(-1, (-1, MX_BLOCK))
    amax = tiles.abs().amax(dim=-1)                                                # [.., K/32]
    exponent = torch.ceil(torch.log2(amax / fp8_max)).clamp(-127, 127)            # log2(0) = -inf -> -127
    scale = torch.exp2(-exponent)                                                  # x * scale fits in the format
    return Quantized(cast_to_fp8(tiles, scale.unsqueeze(-1), fmt).flatten(-2), scale, MX_BLOCK, tuple(x.shape))
