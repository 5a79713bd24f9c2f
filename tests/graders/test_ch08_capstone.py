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


# --------------------------------------------------------------------------------------
# 8.3 the KV cache's update and the attention over it
# --------------------------------------------------------------------------------------
def _causal(q, k, v):
    """The oracle: PyTorch's causal attention over a whole sequence, k and v copied to every head."""
    n = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(n, 1), v.repeat_interleave(n, 1),
                                                             is_causal=True)


@pytest.mark.exercise("8.3")
@pytest.mark.parametrize("chunks", [[12], [5, 1, 1, 1, 1, 1, 1, 1], [1] * 12, [7, 5]], ids=["one pass", "prefill 5",
                                                                                           "one at a time", "7 + 5"])
def test_feeding_the_sequence_in_steps_is_causal_attention_over_all_of_it(chunks):
    step = implementation("8.3")
    torch.manual_seed(0)
    b, a, g, T, d = 2, 4, 2, 12, 8
    q, k, v = torch.randn(b, a, T, d, dtype=torch.float64), torch.randn(b, g, T, d, dtype=torch.float64), \
        torch.randn(b, g, T, d, dtype=torch.float64)
    cache_k, cache_v = torch.zeros(b, g, T + 3, d, dtype=torch.float64), torch.zeros(b, g, T + 3, d, dtype=torch.float64)
    valid = torch.ones(b, T + 3, dtype=torch.bool)
    outs, start = [], 0
    for s in chunks:
        outs.append(step(q[:, :, start:start + s], k[:, :, start:start + s], v[:, :, start:start + s],
                         cache_k, cache_v, valid, start))
        start += s
    torch.testing.assert_close(torch.cat(outs, 2), _causal(q, k, v), msg="the steps do not add up to causal attention")
    torch.testing.assert_close(cache_k[:, :, :T], k, msg="the cache does not hold every key at its position")


@pytest.mark.exercise("8.3")
def test_left_padding_is_never_attended():
    step = implementation("8.3")
    torch.manual_seed(1)
    b, a, g, T, d, pad = 1, 2, 1, 6, 4, 2
    q, k, v = torch.randn(b, a, T, d, dtype=torch.float64), torch.randn(b, g, T, d, dtype=torch.float64), \
        torch.randn(b, g, T, d, dtype=torch.float64)
    valid = torch.ones(b, T, dtype=torch.bool)
    valid[:, :pad] = False
    out = step(q, k, v, torch.zeros(b, g, T, d, dtype=torch.float64), torch.zeros(b, g, T, d, dtype=torch.float64),
               valid, 0)
    assert torch.isfinite(out).all(), "a padding query with no key to see made NaN"
    torch.testing.assert_close(out[:, :, pad:], _causal(q[:, :, pad:], k[:, :, pad:], v[:, :, pad:]),
                               msg="the real tokens attended to the padding")


# --------------------------------------------------------------------------------------
# 8.4 Megatron's FLOPs of a step (the planner's formula)
# --------------------------------------------------------------------------------------
@pytest.mark.exercise("8.4")
def test_llama3_8b_by_hand():
    """Per token, every GEMM three times at 2 FLOPs: MLP 4096 x 3 x 14336 x 32, attention
    32 x (4096 x 6144 + 4096 x 4096), logits 4096 x 128256; core 6 a d L s, the causal half."""
    from minimegatron.plan import planner_model
    config, _, _ = planner_model("llama3-8b")
    flops = implementation("8.4")(config, 1, 8192)
    assert flops["total"] == 8192 * (6 * (5_637_144_576 + 1_342_177_280 + 525_336_576) + 6_442_450_944), flops


@pytest.mark.exercise("8.4")
@pytest.mark.parametrize("moe", [False, True], ids=["dense, GELU", "MoE with a shared expert"])
def test_it_is_the_books_measured_count_less_what_megatron_leaves_out(moe):
    """The book's analysis.training_flops counts the matmuls the model runs (tested against
    FlopCounterMode in tests/test_analysis.py): all s^2 scores, the router, the unpadded
    vocabulary. Megatron counts half the scores, no router, the padded vocabulary."""
    import dataclasses
    from minimegatron.analysis import training_flops
    from minimegatron.config import ModelConfig
    config = ModelConfig.gpt2(hidden_size=64, num_layers=4, num_attention_heads=4, vocab_size=1000,
                              make_vocab_size_divisible_by=16, max_position_embeddings=128)
    if moe:
        config = dataclasses.replace(config, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96,
                                     moe_layer_freq=2, moe_shared_expert_intermediate_size=32)
    B, s, tp = 3, 128, 2
    book = training_flops(config, B, s)
    core = 3 * (book["forward"]["attention_scores"] + book["forward"]["attention_over_values"])
    router = 3 * book["forward"].get("router", 0)
    expected = book["total"] - core // 2 - router + 6 * B * s * 64 * (1024 - 1000)      # 1000 -> 1024 at tp 2
    assert implementation("8.4")(config, B, s, tp)["total"] == expected


# --------------------------------------------------------------------------------------
# 8.5 spot the bug in the resharding load
# --------------------------------------------------------------------------------------
@pytest.mark.exercise("8.5")
@pytest.mark.parametrize("shape, dim, tp, stride, padded", CASES)
def test_a_run_is_cut_from_the_tensor_this_rank_holds(shape, dim, tp, stride, padded):
    """The oracle: the rank's local tensor written out from the definition (_local: padded with
    -1, each stride block chunked over the ranks), its padding zeroed as the layers leave it,
    flattened; every run [inside, inside + n) of it."""
    segment_run = implementation("8.5")
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).view(shape)
    for rank in range(tp):
        split = None if dim is None else Split(dim, None, tp, rank, stride)
        record = Placement("w", shape, split=split)
        local = full if dim is None else _local(full, dim, tp, rank, stride, padded)
        flat = local.clamp(min=0).reshape(-1)                                  # padding rows are zeros
        for inside, n in ((0, flat.numel()), (1, flat.numel() // 2), (flat.numel() // 3, 3)):
            got = segment_run(record, tuple(local.shape), full, inside, n)
            assert torch.equal(got, flat[inside:inside + n]), \
                f"rank {rank}, run [{inside}, {inside + n}): {got[:6].tolist()} ..., want {flat[inside:inside + 6].tolist()} ..."
