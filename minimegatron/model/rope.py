"""Rotary position embedding (RoPE), Su et al. 2021, in Megatron-LM's default layout.

Shape legend: b batch, s sequence, n heads, d head size (kv_channels).

RoPE turns position m into a rotation of each query/key vector: the d channels are seen as
d/2 pairs, pair i rotated by the angle m * theta_i with theta_i = base^(-2i/d). Because a
rotation by m followed by the dot product with a key rotated by n only depends on m - n,
attention scores become functions of relative position.

Which channels form a pair is a convention. Megatron-LM's default (and HF LLaMA's) is the
"rotate half" layout: channel j pairs with channel j + d/2, so that

    rotate_half([x1, x2]) = [-x2, x1]              x1, x2: the two halves of the last dim
    rope(x) = x * cos + rotate_half(x) * sin       cos, sin: [.., d], each half repeated

Positions are passed in explicitly (not assumed to be 0..s-1) so that context parallelism can
give a rank the positions of the sequence chunks it holds.
"""

from __future__ import annotations

import torch


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, base: float = 10000.0,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation table for the given positions.

    position_ids: [s] or [b, s] integer positions.
    Returns cos, sin: [s, d] or [b, s, d] in `dtype`; the angles are computed in float64 so
    that the table does not depend on the model's dtype.
    """
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=position_ids.device)
                        / head_dim)                                                    # [d/2]
    angles = position_ids.to(torch.float64).unsqueeze(-1) * inv_freq                   # [.., s, d/2]
    angles = torch.cat([angles, angles], dim=-1)                                       # [.., s, d]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] along the last dimension (x1, x2 its two halves)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys by their positions (the "rotate half" layout).

    x:   [b, n, s, d] queries or keys, n heads.
    cos: [s, d] or [b, s, d], from `rope_cos_sin` (each half of d holds the same angles).
    sin: same shape as cos.
    Returns [b, n, s, d], same dtype as x. Channel j is paired with channel j + d/2 and the
    pair (x_j, x_{j+d/2}) is rotated by its angle; norms of each pair are preserved.
    """
    # BEGIN EXERCISE 0.2: apply the RoPE rotation | hint: channels j and j + d/2 form one plane, turned by one angle: a 2-D rotation of each pair; rotate_half hands you each channel's partner; where do cos/sin lack the heads axis? (Megatron: _apply_rotary_pos_emb_bshd)
    if cos.dim() == 3:                       # [b, s, d] -> [b, 1, s, d]: same angles for every head
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin    # [b, n, s, d]
    # END EXERCISE
