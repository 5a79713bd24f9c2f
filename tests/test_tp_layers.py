"""Tests for minimegatron.tp: column/row parallel linear, vocab-parallel embedding and
cross-entropy, each against the single-device computation in float64.

ONE spawned world of 4 ranks; tensor-parallel groups of 2 ([0, 1], [2, 3], Megatron's
contiguous TP groups), of 4 (the world) and of 1 (a rank alone: nothing communicated).
Every rank builds the same full tensors from a fixed seed, computes the single-device
reference itself, and compares its shard (or the reassembled full gradient) with it.
"""


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minimegatron.comm import copy_to_tensor_model_parallel_region, record_communication
from minimegatron.config import ModelConfig
from minimegatron.launch import spawn
from workers.checks import rank_failures, run_named_checks
from minimegatron.model.init import initial_value
from minimegatron.model.linear import Linear
from minimegatron.tp import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                             pad_vocab_size, shard_cols, shard_rows,
                             vocab_parallel_cross_entropy)

WORLD = 4
CHECKS = []
F64 = dict(rtol=1e-12, atol=1e-12)
E = 8  # bytes per float64


def check(fn):
    CHECKS.append(fn)
    return fn


def randn(seed, *shape):
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def gather_shards(t, group, dim):
    """Reassemble shards with plain torch.distributed (not the code under test, not counted)."""
    n = dist.get_world_size(group)
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def reference_linear(w, b, x, dy):
    """Single-device Linear: output and gradients of x, W, b."""
    lin = Linear(w.shape[1], w.shape[0], bias=b is not None).double()
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    x = x.clone().requires_grad_()
    y = lin(x)
    y.backward(dy)
    return y.detach(), x.grad, lin.weight.grad, None if b is None else lin.bias.grad


# ---------------------------------------------------------------------- shards and init

@check
def check_shards_come_from_the_single_device_initial_values(rank, G):
    cfg = ModelConfig(params_dtype="float64")
    name = "decoder.layers.0.mlp.linear_fc1"
    full = initial_value(f"{name}.weight", (8, 6), cfg)
    for tp, group in G["tps"]:
        r = dist.get_rank(group)
        # apply_tensor_parallel's way: a layer of this rank's shapes, loaded from the full tensor
        col = ColumnParallelLinear(6, 8, group, bias=False, params_dtype=cfg.dtype)
        col.load_full(full)
        assert col.weight.dtype == torch.float64
        torch.testing.assert_close(col.weight, full[r * 8 // tp:(r + 1) * 8 // tp], rtol=0, atol=0)
        row = RowParallelLinear(8, 6, group, bias=False, params_dtype=cfg.dtype)
        full2 = initial_value("x.linear_fc2.weight", (6, 8), cfg)
        row.load_full(full2)
        torch.testing.assert_close(row.weight, full2[:, r * 8 // tp:(r + 1) * 8 // tp], rtol=0, atol=0)
        # reassembled shards are the full tensor, for rows, columns and strided rows
        torch.testing.assert_close(gather_shards(shard_rows(full, group), group, 0), full, rtol=0, atol=0)
        torch.testing.assert_close(gather_shards(shard_cols(full2, group), group, 1), full2, rtol=0, atol=0)
        strided = gather_shards(shard_rows(full, group, stride=2), group, 0)
        gate, up = full.chunk(2)
        want = torch.cat([torch.cat([gate.chunk(tp)[i], up.chunk(tp)[i]]) for i in range(tp)])
        torch.testing.assert_close(strided, want, rtol=0, atol=0)
        emb = VocabParallelEmbedding(257, 4, group, params_dtype=cfg.dtype)
        full_e = initial_value("embedding.word_embeddings.weight", (257, 4), cfg)
        emb.load_full(full_e)
        got = gather_shards(emb.weight.detach(), group, 0)
        assert got.shape == (pad_vocab_size(257, tp), 4)
        torch.testing.assert_close(got[:257], full_e, rtol=0, atol=0)
        assert not got[257:].any(), "padding rows must start at zero"
    with pytest.raises(ValueError, match="6 is not divisible by the tensor-parallel size 4"):
        ColumnParallelLinear(4, 6, G["world"])
    with pytest.raises(ValueError, match="in_features 6 is not divisible"):
        RowParallelLinear(6, 4, G["world"])
    # SwiGLU's fc1: 2 stacked blocks of 6 rows; each block must split tp = 4 ways
    with pytest.raises(ValueError, match="out_features 12 in 2 stacked blocks, each is not divisible by "
                                         "the tensor-parallel size 4"):
        ColumnParallelLinear(4, 12, G["world"], stride=2)


# ---------------------------------------------------------------------- linear layers

@check
def check_column_parallel_linear_equals_linear(rank, G):
    x, w, b = randn(1, 2, 3, 6), randn(2, 8, 6), randn(3, 8)
    dy = randn(4, 2, 3, 8)
    for tp, group in G["tps"]:
        r = dist.get_rank(group)
        rows = slice(r * 8 // tp, (r + 1) * 8 // tp)
        for bias in (True, False):
            ref_y, ref_dx, ref_dw, ref_db = reference_linear(w, b if bias else None, x, dy)
            for gather in (False, True):
                layer = ColumnParallelLinear(6, 8, group, bias=bias, gather_output=gather).double()
                layer.load_full(w, b if bias else None)
                xi = x.clone().requires_grad_()
                with record_communication() as fwd:
                    y = layer(xi)
                with record_communication() as bwd:
                    y.backward(dy if gather else dy[..., rows])
                torch.testing.assert_close(y, ref_y if gather else ref_y[..., rows], **F64)
                torch.testing.assert_close(xi.grad, ref_dx, **F64)
                torch.testing.assert_close(gather_shards(layer.weight.grad, group, 0), ref_dw, **F64)
                if bias:
                    torch.testing.assert_close(gather_shards(layer.bias.grad, group, 0), ref_db, **F64)
                if tp == 1:
                    assert len(fwd) == len(bwd) == 0
                    continue
                # f: nothing forward, one all-reduce of dx [b, s, in] backward
                assert fwd.count() == (1 if gather else 0), fwd.records
                if gather:
                    assert fwd.count("all_gather") == 1 and fwd.total_bytes() == 2 * 3 * 8 // tp * E
                assert bwd.count() == 1 and bwd.count("all_reduce", group, "bwd") == 1, bwd.records
                assert bwd.total_bytes() == 2 * 3 * 6 * E


@check
def check_row_parallel_linear_equals_linear(rank, G):
    x, w, b = randn(5, 2, 3, 8), randn(6, 6, 8), randn(7, 6)
    dy = randn(8, 2, 3, 6)
    for tp, group in G["tps"]:
        r = dist.get_rank(group)
        cols = slice(r * 8 // tp, (r + 1) * 8 // tp)
        for bias in (True, False):
            ref_y, ref_dx, ref_dw, ref_db = reference_linear(w, b if bias else None, x, dy)
            for parallel_input in (True, False):
                layer = RowParallelLinear(8, 6, group, bias=bias,
                                          input_is_parallel=parallel_input).double()
                layer.load_full(w, b if bias else None)
                xi = (x[..., cols] if parallel_input else x).clone().requires_grad_()
                with record_communication() as fwd:
                    y = layer(xi)
                with record_communication() as bwd:
                    y.backward(dy)
                torch.testing.assert_close(y, ref_y, **F64)   # bias added once, not tp times
                torch.testing.assert_close(xi.grad, ref_dx[..., cols] if parallel_input else ref_dx, **F64)
                torch.testing.assert_close(gather_shards(layer.weight.grad, group, 1), ref_dw, **F64)
                if bias:
                    torch.testing.assert_close(layer.bias.grad, ref_db, **F64)
                if tp == 1:
                    assert len(fwd) == len(bwd) == 0
                    continue
                # g: one all-reduce of y [b, s, out] forward, nothing backward
                assert fwd.count() == 1 and fwd.count("all_reduce", group, "fwd") == 1, fwd.records
                assert fwd.total_bytes() == 2 * 3 * 6 * E
                assert bwd.count() == (0 if parallel_input else 1), bwd.records


@check
def check_column_then_row_mlp_equals_the_single_device_mlp(rank, G):
    """GELU: fc1 column-parallel, fc2 row-parallel. SwiGLU: fc1 [2f, h] = [gate; up] cut
    with stride 2, so each rank's local output chunks into its gate and up slices."""
    h, f = 6, 8
    x, dy = randn(10, 2, 3, h), randn(11, 2, 3, h)
    for activation, rows1 in (("gelu", f), ("swiglu", 2 * f)):
        w1, b1, w2, b2 = randn(12, rows1, h), randn(13, rows1), randn(14, h, f), randn(15, h)

        def act(y):
            if activation == "gelu":
                return F.gelu(y)
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up

        ref = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
        ref_y = F.linear(act(F.linear(ref[0], ref[1], ref[2])), ref[3], ref[4])
        ref_y.backward(dy)
        for tp, group in G["tps"]:
            fc1 = ColumnParallelLinear(h, rows1, group, stride=2 if activation == "swiglu" else 1).double()
            fc2 = RowParallelLinear(f, h, group).double()
            fc1.load_full(w1, b1)
            fc2.load_full(w2, b2)
            xi = x.clone().requires_grad_()
            with record_communication() as ledger:
                y = fc2(act(fc1(xi)))
                y.backward(dy)
            torch.testing.assert_close(y, ref_y.detach(), **F64)
            torch.testing.assert_close(xi.grad, ref[0].grad, **F64)
            stride = 2 if activation == "swiglu" else 1
            dw1 = gather_shards(fc1.weight.grad, group, 0)
            torch.testing.assert_close(dw1, gather_shards(shard_rows(ref[1].grad, group, stride), group, 0), **F64)
            torch.testing.assert_close(gather_shards(fc2.weight.grad, group, 1), ref[3].grad, **F64)
            torch.testing.assert_close(fc2.bias.grad, ref[4].grad, **F64)
            # the MLP's whole pattern: one all-reduce forward (g), one backward (f)
            assert ledger.count() == (2 if tp > 1 else 0), ledger.records
            if tp > 1:
                assert ledger.count("all_reduce", tag="fwd") == ledger.count("all_reduce", tag="bwd") == 1


# ---------------------------------------------------------------------- embedding

@check
def check_vocab_parallel_embedding_equals_embedding(rank, G):
    h = 4
    for vocab in (257, 256):
        full = randn(20, vocab, h)
        tokens = torch.tensor([[0, 1, 63, 64, 65, 127], [128, 129, 255, vocab - 1, 5, 0]])
        dy = randn(21, 2, 6, h)
        ref = torch.nn.Embedding(vocab, h).double()
        with torch.no_grad():
            ref.weight.copy_(full)
        ref_y = ref(tokens)
        ref_y.backward(dy)
        for tp, group in G["tps"]:
            emb = VocabParallelEmbedding(vocab, h, group).double()
            emb.load_full(full)
            assert emb.padded_vocab_size == pad_vocab_size(vocab, tp) and emb.padded_vocab_size % tp == 0
            with record_communication() as fwd:
                y = emb(tokens)
            with record_communication() as bwd:
                y.backward(dy)
            torch.testing.assert_close(y, ref_y.detach(), **F64)
            grad = gather_shards(emb.weight.grad, group, 0)
            torch.testing.assert_close(grad[:vocab], ref.weight.grad, **F64)
            assert not grad[vocab:].any(), "padding rows got a gradient"
            if tp > 1:
                assert fwd.count() == 1 and fwd.count("all_reduce", group, "fwd") == 1
                assert fwd.total_bytes() == 2 * 6 * h * E and len(bwd) == 0
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 257\)"):
        VocabParallelEmbedding(257, h, G["world"])(torch.tensor([[257]]))


# ---------------------------------------------------------------------- cross-entropy

@check
def check_vocab_parallel_cross_entropy_equals_cross_entropy(rank, G):
    b, s = 2, 5
    for vocab in (257, 256):
        labels = torch.tensor([[0, 1, 64, 65, vocab - 1], [128, 129, 200, 255, 7]])
        full = randn(30, b, s, vocab) * 3
        dloss = randn(31, b, s)
        ref_z = full.clone().requires_grad_()
        ref_loss = F.cross_entropy(ref_z.reshape(b * s, vocab), labels.reshape(-1),
                                   reduction="none").view(b, s)
        ref_loss.backward(dloss)
        for tp, group in G["tps"]:
            padded = pad_vocab_size(vocab, tp)
            # padding columns get huge logits: if they leaked into the softmax, the loss
            # would be ~60 and every real column's gradient ~0
            z_full = torch.cat([full, torch.full((b, s, padded - vocab), 60.0, dtype=torch.float64)], -1)
            z = shard_cols(z_full.view(b * s, padded), group).view(b, s, padded // tp)
            z = z.clone().requires_grad_()
            with record_communication() as fwd:
                loss = vocab_parallel_cross_entropy(z, labels, group, vocab_size=vocab)
            with record_communication() as bwd:
                loss.backward(dloss)
            torch.testing.assert_close(loss, ref_loss.detach(), **F64)
            grad = gather_shards(z.grad.view(b * s, -1), group, 1).view(b, s, padded)
            torch.testing.assert_close(grad[..., :vocab], ref_z.grad, **F64)
            assert not grad[..., vocab:].any(), "padding columns got a gradient"
            if tp > 1:
                # max, target logit, sum of exponentials: 3 all-reduces of [b, s], never [b, s, V]
                assert fwd.count() == 3 and fwd.count("all_reduce", group, "fwd") == 3, fwd.records
                assert [r.shape for r in fwd] == [(b, s)] * 3
                assert fwd.total_bytes() == 3 * b * s * E
                assert len(bwd) == 0
    with pytest.raises(ValueError, match=r"labels must be in \[0, 257\)"):
        vocab_parallel_cross_entropy(torch.zeros(1, 1, 65, dtype=torch.float64),
                                     torch.tensor([[257]]), G["world"], vocab_size=257)


@check
def check_cross_entropy_of_a_tied_vocab_parallel_output_layer(rank, G):
    """Embedding -> logits with the same (padded) table -> loss: equals the single-device
    tied model; the zero padding rows stay without gradient."""
    vocab, h = 257, 4
    table = randn(40, vocab, h)
    tokens = torch.tensor([[3, 200, 256, 64]])
    labels = torch.tensor([[200, 256, 0, 130]])
    ref_w = table.clone().requires_grad_()
    x = F.embedding(tokens, ref_w)
    ref = F.cross_entropy((x @ ref_w.t()).view(4, vocab), labels.view(4), reduction="none")
    ref.sum().backward()
    for tp, group in G["tps"]:
        emb = VocabParallelEmbedding(vocab, h, group).double()
        emb.load_full(table)
        hidden = emb(tokens)                                              # [b, s, h]
        logits = copy_to_tensor_model_parallel_region(hidden, group) @ emb.weight.t()     # [b, s, Vp/tp]
        loss = vocab_parallel_cross_entropy(logits, labels, group, vocab_size=vocab)
        loss.sum().backward()
        torch.testing.assert_close(loss.view(4), ref.detach(), **F64)
        grad = gather_shards(emb.weight.grad, group, 0)
        torch.testing.assert_close(grad[:vocab], ref_w.grad, **F64)
        assert not grad[vocab:].any()


# ---------------------------------------------------------------------- the spawned world

def run_checks():
    rank = dist.get_rank()
    # every rank creates every group, in the same order (a collective rule of new_group)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    solos = [dist.new_group([r]) for r in range(WORLD)]
    G = {"world": dist.group.WORLD,
         "tps": [(1, solos[rank]), (2, pairs[rank // 2]), (4, dist.group.WORLD)]}
    return run_named_checks(CHECKS, rank, G)


@pytest.fixture(scope="module")
def world_results():
    return spawn(run_checks, WORLD, timeout=120.0, collective_timeout=20.0)


@pytest.mark.parametrize("name", [fn.__name__ for fn in CHECKS])
def test_in_world_of_4(world_results, name):
    failures = rank_failures(world_results, name)
    assert not failures, failures
