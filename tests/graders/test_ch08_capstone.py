"""Graders of chapter 08's checkpoints: a shard's global offsets (8.1) and the identity that
deduplicates the pieces every rank could write (8.2, spot the bug).

The oracles: for 8.1, a single-device tensor of distinct numbers (arange) cut the way the
tensor-parallel layers cut it (padded, then each stride block chunked over the ranks, written
here from the definition), so that local[local box] == full[global box] can be checked element
by element, and the boxes must hold every real element the rank has, once; for 8.2, pieces
that hold the same numbers (replicas) against pieces that hold different elements of one
tensor (tensor-parallel shards, ZeRO's runs on different data-parallel ranks)."""

from __future__ import annotations

import pytest
import torch

from booktools.exercises import implementation
from minimegatron.placement import Placement, Split


def _local(full: torch.Tensor, dim: int, tp: int, rank: int, stride: int, padded: int) -> torch.Tensor:
    """This rank's local tensor: `full` padded along `dim` to `padded` rows with -1, then each of
    the `stride` blocks chunked over tp ranks, this rank's chunks concatenated in block order."""
    pad_shape = list(full.shape)
    pad_shape[dim] = padded - full.shape[dim]
    whole = torch.cat([full, torch.full(pad_shape, -1, dtype=full.dtype)], dim)
    return torch.cat([block.chunk(tp, dim)[rank] for block in whole.chunk(stride, dim)], dim)


CASES = [  # (shape, dim, tp, stride, padded size along dim)
    ((6, 4), None, 1, 1, None),                # unsplit
    ((8, 4), 0, 2, 1, 8),                      # column-parallel rows
    ((8, 6), 1, 2, 1, 6),                      # row-parallel columns
    ((8, 4), 0, 2, 2, 8),                      # SwiGLU's [gate; up]: two blocks, each cut
    ((12, 3), 0, 3, 2, 12),
    ((257, 4), 0, 2, 1, 258),                  # a padded vocabulary: the last rank holds a padding row
    ((5, 2), 0, 4, 1, 8),                      # the last rank holds only padding
]


@pytest.mark.exercise("8.1")
@pytest.mark.parametrize("shape, dim, tp, stride, padded", CASES)
def test_every_local_element_sits_at_its_global_offset(shape, dim, tp, stride, padded):
    boxes_of_local = implementation("8.1")
    full = torch.arange(torch.Size(shape).numel()).view(shape)
    for rank in range(tp):
        split = None if dim is None else Split(dim, None, tp, rank, stride)
        record = Placement("w", shape, split=split)
        local = full if dim is None else _local(full, dim, tp, rank, stride, padded)
        boxes = boxes_of_local(record, tuple(local.shape))
        covered = torch.zeros(local.shape, dtype=torch.int64)
        for glob, loc in boxes:
            g = tuple(slice(lo, hi) for lo, hi in glob)
            l_ = tuple(slice(lo, hi) for lo, hi in loc)
            assert all(0 <= lo < hi <= n for (lo, hi), n in zip(loc, local.shape)), \
                f"rank {rank}: local box {loc} is not inside the local shape {list(local.shape)}"
            assert torch.equal(local[l_], full[g]), f"rank {rank}: local{loc} is not full{glob}"
            covered[l_] += 1
        real = local >= 0                                       # the padding is -1
        assert torch.equal(covered[real], torch.ones_like(covered[real])), \
            f"rank {rank}: every real element must be in exactly one box (counts {covered.tolist()})"
        assert not covered[~real].any(), f"rank {rank}: a padding element is in a box"


def _piece(kind="exp_avg", name="w", boxes=(((0, 4), (0, 8)), ((0, 4), (0, 8))), local_shape=(4, 8), flat=(0, 32)):
    return {"kind": kind, "name": name, "shape": [8, 8], "local_shape": list(local_shape),
            "boxes": [[list(map(list, glob)), list(map(list, loc))] for glob, loc in [boxes]], "flat": list(flat)}


@pytest.mark.exercise("8.2")
def test_replicas_are_one_piece_and_different_parts_are_not():
    identity = implementation("8.2")
    same = identity(_piece()), identity(_piece())
    assert same[0] == same[1] and hash(same[0]) == hash(same[1]), "two replicas of one piece must be one identity"
    others = {
        "another kind (the parameter, not its moment)": _piece(kind="model"),
        "another tensor": _piece(name="v"),
        "another tensor-parallel shard (other global rows)": _piece(boxes=(((4, 8), (0, 8)), ((0, 4), (0, 8)))),
        "another ZeRO run of the same local tensor (another data-parallel rank's)": _piece(flat=(16, 32)),
    }
    for what, piece in others.items():
        assert identity(piece) != same[0], f"{what} has the same identity: only one of them would be written"
