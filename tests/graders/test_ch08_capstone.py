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
from differences import assert_close, assert_equal, differs
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
        given = (f"Placement('w', {shape}, split={split}), local shape {list(local.shape)}" + (
            "" if dim is None else f" (dim {dim} padded to {padded}, then each of the {stride} stride block(s) cut "
                                   f"over tp {tp})") + f"; your boxes (global, local): {boxes}")
        covered = torch.zeros(local.shape, dtype=torch.int64)
        for glob, loc in boxes:
            g = tuple(slice(lo, hi) for lo, hi in glob)
            l_ = tuple(slice(lo, hi) for lo, hi in loc)
            if not all(0 <= lo < hi <= n for (lo, hi), n in zip(loc, local.shape)):
                raise AssertionError(differs(f"rank {rank}'s local box", loc, f"[lo, hi) inside {list(local.shape)}, "
                                             "lo < hi", given=given))
            if not torch.equal(local[l_], full[g]):
                raise AssertionError(differs(
                    f"rank {rank}: local{loc} against full{glob}", f"{local[l_].flatten()[:6].tolist()} ...",
                    f"{full[g].flatten()[:6].tolist()} ...", given=given,
                    why="local[local box] must hold the numbers of full[global box] (full = arange: each number is "
                        "its own single-device flat index)"))
            covered[l_] += 1
        real = local >= 0                                       # the padding is -1
        counts = covered[real]
        assert_equal((int((counts == 0).sum()), int((counts > 1).sum())), (0, 0),
                     f"rank {rank}'s real elements in no box, in more than one box", given=given,
                     why=f"every real element of the local tensor ({int(real.sum())} of them) is in exactly one box")
        assert_equal(int(covered[~real].sum()), 0, f"rank {rank}'s padding elements in a box", given=given,
                     why="padding rows (past the single-device size) are in no box")


def _piece(kind="exp_avg", name="w", boxes=(((0, 4), (0, 8)), ((0, 4), (0, 8))), local_shape=(4, 8), flat=(0, 32)):
    return {"kind": kind, "name": name, "shape": [8, 8], "local_shape": list(local_shape),
            "boxes": [[list(map(list, glob)), list(map(list, loc))] for glob, loc in [boxes]], "flat": list(flat)}


@pytest.mark.exercise("8.2")
def test_replicas_are_one_piece_and_different_parts_are_not():
    identity = implementation("8.2")
    first = _piece()
    same = identity(first), identity(_piece())
    assert_equal((same[0] == same[1], hash(same[0]) == hash(same[1])), (True, True),
                 "(identities equal, hashes equal) of two replicas", given=f"the same descriptor twice: {first}",
                 why="replicas hold equal tensors: one identity, written once")
    others = {
        "another kind (the parameter, not its moment)": _piece(kind="model"),
        "another tensor": _piece(name="v"),
        "another tensor-parallel shard (other global rows)": _piece(boxes=(((4, 8), (0, 8)), ((0, 4), (0, 8)))),
        "another ZeRO run of the same local tensor (another data-parallel rank's)": _piece(flat=(16, 32)),
    }
    for what, piece in others.items():
        if identity(piece) == same[0]:
            changed = {k: (first[k], v) for k, v in piece.items() if v != first[k]}
            raise AssertionError(differs(
                f"identity of {what}", "equal to the first piece's", "a different one",
                given=f"the first piece {first}; this one differs in " + ", ".join(
                    f"{k}: {a} -> {b}" for k, (a, b) in changed.items()),
                why="the two hold different elements: with one identity only one of them would be written"))


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
    given = (f"b {b}, a {a} query heads, g {g} key/value heads, d {d}, {T} positions fed in steps of {chunks} "
             f"(float64, torch.manual_seed(0)), a cache of {T + 3} positions, no padding")
    assert_close(torch.cat(outs, 2), _causal(q, k, v), "the steps' outputs, concatenated", given=given,
                 why="they are causal attention over the whole sequence (F.scaled_dot_product_attention, is_causal, "
                     "each key/value head copied to its a/g query heads)")
    assert_close(cache_k[:, :, :T], k, "cache_k[:, :, :T] after the steps", given=given,
                 why="every key is written at its own position")


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
    given = f"b {b}, a {a}, g {g}, d {d}, {T} positions in one step from start 0, the first {pad} left padding"
    assert_equal(int((~torch.isfinite(out)).sum()), 0, "the non-finite elements of the output", given=given,
                 why="a padding query sees no real key: it attends to itself alone, so that no softmax row is empty")
    assert_close(out[:, :, pad:], _causal(q[:, :, pad:], k[:, :, pad:], v[:, :, pad:]),
                 "the real tokens' outputs", given=given,
                 why="causal attention over the real tokens alone: the padding is never a key")


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
    per_token = {"mlp": 6 * 5_637_144_576, "attention": 6 * 1_342_177_280, "core": 6_442_450_944,
                 "logits": 6 * 525_336_576}
    want = {k: 8192 * n for k, n in per_token.items()}
    want["total"] = sum(want.values())
    _check_flops(flops, want, "megatron_flops(llama3-8b, batch 1, seq 8192)", {
        "mlp": "3 GEMMs x 2 FLOPs x 4096 x 3 x 14336 x 32 layers a token (SwiGLU: gate, up, down)",
        "attention": "6 x 32 layers x (4096 x 6144 for q, k, v with 8 groups + 4096 x 4096 for the output) a token",
        "core": "6 a d L s a token, s = 8192: the scores and the values over the causal half of 12 a d L s",
        "logits": "6 x 4096 x 128256 a token (128256 is already a multiple of 128: no padding at tp 1)",
        "total": "the sum of the four"})


def _check_flops(got: dict, want: dict, call: str, why: dict) -> None:
    """Every key of `want` in `got` with its value; a failure names the key and its formula."""
    for key in want:
        assert_equal(key in got, True, f"{call} has the key {key!r}", given=f"your keys: {sorted(got)}",
                     why="megatron_flops returns {'mlp', 'attention', 'core', 'logits', 'total'}")
    for key in want:
        if got[key] != want[key]:
            ratio = f" (x{got[key] / want[key]:.4g})" if want[key] else ""
            raise AssertionError(differs(f"{call}[{key!r}]", got[key], want[key], given=f"your dict: {got}",
                                         why=f"{why[key]}; got/want{ratio}"))


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
    fwd = book["forward"]
    core = 3 * (fwd["attention_scores"] + fwd["attention_over_values"])
    router = 3 * fwd.get("router", 0)
    want = {"mlp": 3 * sum(fwd.get(k, 0) for k in ("fc1", "fc2", "experts_fc1", "experts_fc2", "shared_fc1",
                                                       "shared_fc2")),
            "attention": 3 * (fwd["qkv"] + fwd["proj"]),
            "core": core // 2,
            "logits": 3 * fwd["logits"] * 1024 // 1000}                     # 1000 -> 1024 at tp 2
    want["total"] = book["total"] - core // 2 - router + 6 * B * s * 64 * (1024 - 1000)
    assert want["total"] == sum(want[k] for k in ("mlp", "attention", "core", "logits"))    # the oracle's own sums
    layers = "MoE layers 0 and 2 (4 experts, top 2, width 96, a shared expert of 32), dense 1 and 3" if moe else "dense"
    _check_flops(implementation("8.4")(config, B, s, tp), want, f"megatron_flops(gpt2 h 64, B {B}, s {s}, tp {tp})", {
        "mlp": f"3 x the book's forward fc1 + fc2 (every GEMM of the MLPs; {layers}): the same GEMMs",
        "attention": "3 x the book's forward qkv + proj",
        "core": "half of 3 x the book's forward scores + values: Megatron counts only the causal half",
        "logits": "3 x the book's forward logits over V 1000, padded to Vp 1024 (a multiple of 16 x tp 2)",
        "total": "the book's total - core / 2 - the router's 6 B s h E + 6 B s h (Vp - V)"})


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
            if not torch.equal(got, flat[inside:inside + n]):
                raise AssertionError(differs(
                    f"rank {rank}'s run [{inside}, {inside + n})", f"{got.flatten()[:6].tolist()} ... "
                    f"({got.numel()} elements)", f"{flat[inside:inside + 6].tolist()} ... ({n} elements)",
                    given=f"Placement('w', {shape}, split={split}), local shape {list(local.shape)}, full = arange "
                          f"(each number its own single-device flat index), inside {inside}, n {n}",
                    why="the run counts elements of this rank's local tensor (padding rows zero), flattened"))
