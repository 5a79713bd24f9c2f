"""Graders of chapter 04, sequence and context parallelism: merging partial attention results
(4.1), the zig-zag positions (4.2), the sequence-parallel column linear's backward (4.3) and
the spot-the-bug norm-gradient all-reduce (4.4).

One spawned world of 4 ranks runs the checks of the exercises being graded, each with its own
function plugged into every rank (tests/workers/sp_cp.py: the world and its pairs of ranks, so
"on 2 and on 4 ranks" costs one start-up; booktools/exercises/world.py charges each failure to
its own exercise). The oracles, strongest first: the whole model trained with your
function inside (context parallel 4 and 2 x dp 2, TP 2 + SP x dp 2; float64, AdamW, clipping
active) equals the single-device run (`check_run` of chapters/04_sp_cp/demo.py, which also
holds the ledger of a step against the chapter's formulas); ring attention over 2 and 4 ranks
equals single-device causal attention computed here with torch's softmax and autograd; the
layer's gradients equal autograd on full tensors; softmax over the full scores in float64;
the layout's contract written out from docs/ARCHITECTURE.md ("Contracts"); and the ledger (which collectives ran).
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from booktools.exercises import implementation
from booktools.exercises.world import SharedWorld
from minimegatron.launch import spawn
from booktools.demo import import_chapter
from workers import sp_cp as W                          # tests/workers/sp_cp.py

ch04 = import_chapter("04")                        # chapters/04_sp_cp/demo.py

WORLD = 4
# 4.2: zig-zag over 4 ranks (RoPE: the positions reach the rotation) and over 2 x dp 2 with the
# all-gather variant (learned absolute positions: the embedding reads position_ids)
RUNS_42 = [ch04.make_run(ch04.tiny_model("llama"), cp=4, cp_comm_type="p2p"),
           ch04.make_run(ch04.tiny_model("gpt2"), cp=2, dp=2, cp_comm_type="all_gather")]
# 4.4: TP 2 + SP x dp 2; LLaMA (RMSNorm weights only), GPT-2 (LayerNorm weights and biases, and
# the row-parallel layers' biases)
RUNS_44 = [ch04.make_run(ch04.tiny_model("llama"), tp=2, dp=2, sp=True),
           ch04.make_run(ch04.tiny_model("gpt2"), tp=2, dp=2, sp=True)]


@pytest.fixture(scope="module")
def world(graded_exercises):
    """One world of 4 ranks for the exercises being graded (in the order of grade_world's checks)."""
    return SharedWorld(lambda plan: spawn(W.grade_world, WORLD, RUNS_42, RUNS_44, plan, timeout=400,
                                          collective_timeout=60),
                       ["4.3", "4.2", "4.4", "4.1"], graded_exercises)


def _data(world, eid: str) -> list:
    return world.data(eid)


def _check_runs(runs, per_rank_runs, what: str) -> None:
    """The first line names the run and the first thing that differs (the summary line shows it)."""
    for i, run in enumerate(runs):
        report = ch04.check_run(run, [r[i] for r in per_rank_runs])
        if not report.ok:
            problems = report.equivalence.problems + report.problems
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise AssertionError(f"{run.name()} against one device: {problems[0]}{more}\n"
                                 f"(the run with your {what} inside)\n{report}")


def _close(got, want, what: str, rtol=1e-10, atol=1e-10) -> None:
    assert got is not None and got.shape == want.shape, \
        f"{what}: shape {None if got is None else tuple(got.shape)}, expected {tuple(want.shape)}"
    diff = (got.to(torch.float64) - want).abs().max().item()
    assert torch.allclose(got.to(torch.float64), want, rtol=rtol, atol=atol), f"{what}: max difference {diff:.3e}"


# --------------------------------------------------------------------------------------
# 4.1 merging partial attention results
# --------------------------------------------------------------------------------------
def _block(scores: torch.Tensor, v: torch.Tensor):
    """(out, lse) of one block by definition: softmax over the block's keys, its log-sum-exp."""
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


def _blocks_and_oracle(seed: int, scales):
    """Scores [1, 2, 5, sk] whose key blocks live at very different scales (block i's keys
    multiplied by scales[i]: logits up to thousands, far past exp's range in float64), the
    blocks' (out, lse) and the oracle: softmax over ALL the scores, in float64."""
    g = torch.Generator().manual_seed(seed)
    sizes = [3, 1, 4, 2, 5][:len(scales)]
    q = 4 * torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64)
    ks = [scale * torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n, scale in zip(sizes, scales)]
    vs = [torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in sizes]
    scores = [q @ k.transpose(-2, -1) / math.sqrt(8) for k in ks]
    full = torch.cat(scores, dim=-1)
    oracle = (torch.softmax(full, dim=-1) @ torch.cat(vs, dim=2), torch.logsumexp(full, dim=-1))
    return [_block(s, v) for s, v in zip(scores, vs)], oracle


@pytest.mark.exercise("4.1")
@pytest.mark.parametrize("scales", [(1, 1, 1, 1), (1, 300, 0.01, 40), (500, 500, 1, 800, 0.1)],
                         ids=["similar", "large-logits", "large-logits-5-blocks"])
def test_merging_blocks_in_any_order_is_softmax_attention(scales):
    merge = implementation("4.1")
    blocks, (want_out, want_lse) = _blocks_and_oracle(len(scales), scales)
    if max(scales) > 100:                  # the case must reach what exp() cannot hold in float64
        assert max(lse.abs().max().item() for _, lse in blocks) > 710
    orders = list(itertools.permutations(range(len(blocks))))
    for order in random.Random(0).sample(orders, min(len(orders), 12)):
        out, lse = blocks[order[0]]
        for i in order[1:]:
            out, lse = merge(out, lse, *blocks[i])
        _close(out, want_out, f"out merged one by one in the order {order}", rtol=1e-11, atol=1e-12)
        _close(lse, want_lse, f"lse merged one by one in the order {order}", rtol=1e-11, atol=1e-12)
    # a tree, as the ring merges a rank's partial results: (0 1) (2 3 ...)
    left = merge(*blocks[0], *blocks[1])
    right = blocks[2]
    for b in blocks[3:]:
        right = merge(*right, *b)
    out, lse = merge(*left, *right)
    _close(out, want_out, "out merged as a tree", rtol=1e-11, atol=1e-12)
    _close(lse, want_lse, "lse merged as a tree", rtol=1e-11, atol=1e-12)


@pytest.mark.exercise("4.1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_keeps_the_dtypes(dtype):
    """The spec: out in out_a's dtype, lse in lse_a's dtype (float32 for 16-bit outputs, as the
    flash kernel returns it)."""
    merge = implementation("4.1")
    blocks, (want_out, want_lse) = _blocks_and_oracle(7, (1, 200))
    (out_a, lse_a), (out_b, lse_b) = [(o.to(dtype), l.to(torch.float32)) for o, l in blocks]
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    assert (out.dtype, lse.dtype) == (dtype, torch.float32), \
        f"merge_attention returned out {out.dtype} and lse {lse.dtype}, expected {dtype} and torch.float32"
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    _close(out, want_out, f"out ({dtype})", rtol=tol, atol=tol)
    _close(lse, want_lse, f"lse ({dtype})", rtol=1e-6, atol=1e-4)


@pytest.mark.exercise("4.1")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_merge_weighs_in_lse_dtype_and_rounds_once(dtype):
    """The spec: "the weights in lse's dtype". With 16-bit outputs and a float32 lse (what the
    flash kernel returns), the merge is float32 arithmetic rounded to the output dtype once, at
    the end: within half a unit in the last place of that dtype (plus float32's own error) of
    the exact merge of the same inputs. Weights cast to the output dtype before the merge round
    three times (weight, product, sum) and miss it by tens of units where the two blocks'
    contributions cancel."""
    merge = implementation("4.1")
    g = torch.Generator().manual_seed(11)
    shape = (2, 4, 16, 8)                                          # [b, a, sq, d]
    out_a, out_b = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    lse_a, lse_b = (3 * torch.randn(shape[:-1], generator=g) for _ in range(2))     # float32
    # the exact merge of these very inputs, in float64, from the definition
    la, lb = lse_a.double(), lse_b.double()
    lse = torch.logaddexp(la, lb)
    part_a = out_a.double() * torch.exp(la - lse).unsqueeze(-1)
    part_b = out_b.double() * torch.exp(lb - lse).unsqueeze(-1)
    exact = part_a + part_b
    out, _ = merge(out_a, lse_a, out_b, lse_b)
    assert out.dtype == dtype, f"merge_attention returned out {out.dtype}, expected {dtype} (out_a's dtype)"
    # one rounding to `dtype` costs at most half its unit in the last place at that magnitude
    # (finfo.eps * 2^exponent; tiny: the subnormals' fixed spacing); float32 arithmetic adds a
    # few of its own eps of the terms summed
    fi = torch.finfo(dtype)
    ulp = fi.eps * 2.0 ** torch.floor(torch.log2(exact.abs().clamp_min(fi.tiny)))
    allowed = 0.5 * ulp + 4 * torch.finfo(torch.float32).eps * (part_a.abs() + part_b.abs())
    excess = (out.double() - exact).abs() / allowed
    bad = int((excess > 1).sum())
    name = str(dtype).replace("torch.", "")
    assert bad == 0, (f"out ({name}, lse float32): {bad} of {exact.numel()} elements off the exact merge by more "
                      f"than one rounding to {name} (worst {excess.max().item():.1f}x the allowance)\n"
                      "the spec: the weights in lse's dtype, the result rounded to out_a's dtype once, at the end")


def _causal_attention_oracle():
    """Single-device causal attention over the full sequence with torch's softmax, and its
    gradients for dout, by autograd (GQA: key/value group i // (A / G) for query head i)."""
    full = W.attention_inputs()
    q, k, v = (full[n].clone().requires_grad_() for n in ("q", "k", "v"))
    rep = W.A // W.G
    scores = q @ k.repeat_interleave(rep, 1).transpose(-2, -1) / math.sqrt(W.D)
    scores = scores.masked_fill(torch.ones(W.S, W.S, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v.repeat_interleave(rep, 1)
    out.backward(full["dout"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.exercise("4.1")
def test_ring_attention_built_on_your_merge_is_causal_attention(world):
    per_rank = _data(world, "4.1")
    want = _causal_attention_oracle()
    for rank, results in enumerate(per_rank):
        assert len(results) == 8, f"rank {rank}: {len(results)} ring runs, expected 8"
        for r in results:
            pos = r["positions"]
            what = (f"rank {rank}, ring of {r['cp']}, {'zig-zag' if r['load_balance'] else 'contiguous'}, "
                    f"backend {r['backend']}")
            for name in ("out", "dq", "dk", "dv"):
                _close(r[name], want[name].index_select(2, pos), f"{what}: {name} of positions {pos.tolist()}")


# --------------------------------------------------------------------------------------
# 4.2 the zig-zag positions
# --------------------------------------------------------------------------------------
def _contract(s: int, cp: int, r: int) -> list[int]:
    """docs/ARCHITECTURE.md, "Contracts": the sequence cut into 2 cp chunks; rank r keeps chunk r and chunk 2 cp-1-r, in that order."""
    c = s // (2 * cp)
    chunks = [list(range(i * c, (i + 1) * c)) for i in range(2 * cp)]
    return chunks[r] + chunks[2 * cp - 1 - r]


@pytest.mark.exercise("4.2")
def test_zigzag_positions_by_hand_and_the_contract():
    zigzag_positions = implementation("4.2")
    by_hand = {(8, 2, 0): [0, 1, 6, 7], (8, 2, 1): [2, 3, 4, 5], (4, 1, 0): [0, 1, 2, 3],
               (16, 4, 1): [2, 3, 12, 13], (16, 4, 3): [6, 7, 8, 9], (12, 2, 0): [0, 1, 2, 9, 10, 11]}
    for args, want in by_hand.items():
        got = zigzag_positions(*args)
        assert list(got) == want, f"zigzag_positions{args} = {got}, expected {want}"
    for cp in (1, 2, 3, 4, 8):
        for s in (2 * cp, 4 * cp, 6 * cp):
            for r in range(cp):
                got = zigzag_positions(s, cp, r)
                assert list(got) == _contract(s, cp, r), \
                    f"zigzag_positions({s}, {cp}, {r}) = {got}, expected chunk {r} then chunk {2 * cp - 1 - r}"


@pytest.mark.exercise("4.2")
@pytest.mark.parametrize("s,cp", [(8, 2), (24, 3), (64, 4), (64, 8), (96, 6)])
def test_zigzag_covers_the_sequence_once_with_equal_causal_work(s, cp):
    zigzag_positions = implementation("4.2")
    per_rank = [list(zigzag_positions(s, cp, r)) for r in range(cp)]
    assert all(len(p) == s // cp for p in per_rank), f"s={s} cp={cp}: lengths {[len(p) for p in per_rank]}"
    assert sorted(x for p in per_rank for x in p) == list(range(s)), \
        f"s={s} cp={cp}: the ranks' positions are not a permutation of range({s}): {per_rank}"
    # causal attention: the query at position i attends to i + 1 keys
    work = [sum(i + 1 for i in p) for p in per_rank]
    assert len(set(work)) == 1, f"s={s} cp={cp}: unmasked scores per rank {work}: not balanced"
    assert work[0] * cp == s * (s + 1) // 2


@pytest.mark.exercise("4.2")
@pytest.mark.parametrize("s,cp", [(20, 3), (6, 2), (9, 1)])
def test_zigzag_refuses_a_sequence_that_does_not_cut_into_2cp_chunks(s, cp):
    zigzag_positions = implementation("4.2")
    with pytest.raises(ValueError) as info:
        zigzag_positions(s, cp, 0)
    message = str(info.value)
    assert str(s) in message and str(2 * cp) in message, \
        f"the error should name seq_len={s} and 2 cp = {2 * cp}: {message!r}"


@pytest.mark.exercise("4.2")
def test_context_parallel_training_on_your_positions_trains_like_one_device(world):
    _check_runs(RUNS_42, _data(world, "4.2"), "zigzag_positions")


# --------------------------------------------------------------------------------------
# 4.3 the sequence-parallel column linear's backward
# --------------------------------------------------------------------------------------
def _linear_oracle(bias: bool):
    full = W.linear_inputs()
    x, w = full["x"].clone().requires_grad_(), full["w"].clone().requires_grad_()
    b = full["b"].clone().requires_grad_() if bias else None
    F.linear(x, w, b).backward(full["dy"])
    return {"dx": x.grad, "dw": w.grad, "db": None if b is None else b.grad}


@pytest.mark.exercise("4.3")
def test_sequence_parallel_linear_gradients_equal_autograd(world):
    per_rank = _data(world, "4.3")
    oracle = {bias: _linear_oracle(bias) for bias in (True, False)}
    for rank, results in enumerate(per_rank):
        assert len(results) == 4, f"rank {rank}: {len(results)} layers, expected 4"
        for r in results:
            tp, me, want = r["tp"], r["rank"], oracle[r["bias"]]
            what = f"rank {me} of tp {tp}, bias={r['bias']}"
            _close(r["dx"], want["dx"].chunk(tp, dim=1)[me], f"{what}: dx (this rank's tokens)")
            _close(r["dw"], want["dw"].chunk(tp, dim=0)[me], f"{what}: dW (this rank's rows)")
            if r["bias"]:
                _close(r["db"], want["db"].chunk(tp, dim=0)[me], f"{what}: db (this rank's rows)")
            else:
                assert r["db"] is None, f"{what}: a layer without bias got a bias gradient"


@pytest.mark.exercise("4.3")
def test_sequence_parallel_linear_backward_communicates_one_regather_and_one_reduce_scatter(world):
    per_rank = _data(world, "4.3")
    for rank, results in enumerate(per_rank):
        for r in results:
            tp = r["tp"]
            x = W.LB * W.LS * W.IN * 8                   # bytes of the full [b, s, in] in float64
            want = Counter({("all_gather", "regather", x // tp, tp): 1,        # the saved shard, gathered
                            ("reduce_scatter", "bwd", x, tp): 1})              # dx, the full partial sums
            got = Counter(r["bwd"])
            assert got == want, (f"rank {rank}, tp {tp}, bias={r['bias']}: the backward communicated "
                                 f"{sorted(got.elements())}, expected {sorted(want.elements())} "
                                 "(op, tag, bytes, group size; the ledger counts the "
                                 "shard an all_gather sends and the full input of a reduce_scatter)")


# --------------------------------------------------------------------------------------
# 4.4 spot the bug: the norm-gradient all-reduce of sequence parallelism
# --------------------------------------------------------------------------------------
@pytest.mark.exercise("4.4")
def test_tp_sp_training_with_your_allreduce_trains_like_one_device(world):
    _check_runs(RUNS_44, _data(world, "4.4"), "allreduce_sequence_parallel_grads")


@pytest.mark.exercise("4.4")
def test_one_sp_grads_allreduce_of_every_replicated_gradient_per_step(world):
    per_rank = _data(world, "4.4")
    for i, run in enumerate(RUNS_44):
        cfg = run.model
        L, h = cfg.num_layers, cfg.hidden_size
        if cfg.normalization == "LayerNorm":   # 2 norms per layer + the final one, weight and bias; 2 row biases
            elements = (2 * L + 1) * 2 * h + (2 * L * h if cfg.add_bias_linear else 0)
        else:                                  # RMSNorm: weights only, no linear biases
            elements = (2 * L + 1) * h
        want = [("all_reduce", "sp-grads", elements * 8)]        # float64
        for rank, records in enumerate(per_rank):
            got = [c for c in records[i]["ledger"] if c[1] == "sp-grads"]
            assert got == want, (f"{run.name()} ({cfg.normalization}), rank {rank}: the step's sp-grads "
                                 f"communication was {got}, expected {want}")
