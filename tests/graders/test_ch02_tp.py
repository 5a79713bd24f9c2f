"""Graders of chapter 02, tensor parallelism: the column-parallel backward (2.1), the
row-parallel forward (2.2), the vocab-parallel cross-entropy (2.3) and the spot-the-bug
filter of the global gradient norm (2.4).

Each exercise runs in one spawned world of 4 ranks with your function plugged into every rank
(`spawn(plugged(worker, id))`, workers in tests/workers/tp.py). The oracles, strongest first:
the whole tensor-parallel model (TP 2 x DP 2) with your function inside trains exactly like
the single-device run (float64, AdamW, gradient clipping active; `check_run` of
chapters/02_tp/demo.py); your layer's outputs and gradients on every rank equal the
single-device computation on full tensors, here, with torch's autograd; and the communication
it issues equals the formula (the ledger: numbers alone cannot tell an all-reduce in the
forward from one in the backward).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from booktools.exercises import plugged
from minimegatron.launch import spawn
from booktools.demo import import_chapter
from workers import tp as W                          # tests/workers/tp.py

demo = import_chapter("02")                     # chapters/02_tp/demo.py

WORLD = 4


def _run(style: str, zero_stage: int = 0):
    return demo.make_run(demo.tiny_model(style), tp=2, dp=2, zero_stage=zero_stage, steps=2)


def _check_runs(runs, results) -> None:
    for i, run in enumerate(runs):
        report = demo.check_run(run, [r["runs"][i] for r in results])
        if not report.ok:          # the first line names the first difference (the summary shows it)
            problems = report.equivalence.problems + report.problems
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise AssertionError(f"{run.name()} against one device: {problems[0]}{more}\n"
                                 f"(the run with your function inside)\n{report}")


def _full(shard_dim_tensors, dim):
    return torch.cat(shard_dim_tensors, dim=dim)


# --------------------------------------------------------------------------------------
# 2.1 the column-parallel linear's backward, 2.2 the row-parallel linear's forward
# --------------------------------------------------------------------------------------
# LLaMA: SwiGLU (stride 2), GQA, untied output layer; GPT-2: biases (added once?), tied embeddings
LAYER_RUNS = [_run("llama"), _run("gpt2")]


@pytest.fixture(scope="module")
def column_world():
    return spawn(plugged(W.grade_linear_layers, "2.1"), WORLD, LAYER_RUNS, timeout=300)


@pytest.fixture(scope="module")
def row_world():
    return spawn(plugged(W.grade_linear_layers, "2.2"), WORLD, LAYER_RUNS, timeout=300)


def _column_expected(bias: bool) -> dict[str, torch.Tensor]:
    t = W.layer_inputs()
    x = t["x"].clone().requires_grad_()
    w = t["w_col"].clone().requires_grad_()
    b = t["b_col"].clone().requires_grad_() if bias else None
    y = F.linear(x, w, b)
    y.backward(t["dy_col"])
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad, "db": None if b is None else b.grad}


@pytest.mark.exercise("2.1")
@pytest.mark.parametrize("bias", [True, False])
def test_column_layer_outputs_and_gradients_equal_one_device(column_world, bias):
    want = _column_expected(bias)
    got = [r["column"][bias] for r in column_world]
    torch.testing.assert_close(_full([g["y"] for g in got], -1), want["y"], rtol=1e-12, atol=1e-12)
    for rank, g in enumerate(got):
        torch.testing.assert_close(g["dx"], want["dx"], rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"rank {rank}: dx is not the full gradient of x (the sum over "
                                                 f"the ranks of dy_r W_r): {m}")
    torch.testing.assert_close(_full([g["dw"] for g in got], 0), want["dw"], rtol=1e-12, atol=1e-12,
                               msg=lambda m: f"the ranks' weight gradients are not the rows of dW = dy^T x: {m}")
    if bias:
        torch.testing.assert_close(_full([g["db"] for g in got], 0), want["db"], rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"the bias gradients are not the rows of sum(dy): {m}")
    else:
        assert all(g["db"] is None for g in got), "a layer without bias got a bias gradient"


@pytest.mark.exercise("2.1")
def test_column_backward_all_reduces_dx_once(column_world):
    for rank, r in enumerate(column_world):
        for bias, g in r["column"].items():
            assert g["fwd"] == [], f"rank {rank}: the column layer's forward communicated: {g['fwd']}"
            assert g["bwd"] == [("all_reduce", (W.B, W.S, W.IN), "bwd")], (
                f"rank {rank} (bias={bias}): the backward issued {g['bwd']}; expected exactly one all-reduce of "
                f"dx [{W.B}, {W.S}, {W.IN}] with tag 'bwd'")


@pytest.mark.exercise("2.1")
def test_tp_model_with_your_column_backward_trains_like_one_device(column_world):
    _check_runs(LAYER_RUNS, column_world)


@pytest.mark.exercise("2.2")
def test_row_layer_outputs_and_gradients_equal_one_device(row_world):
    t = W.layer_inputs()
    x = W.row_input().requires_grad_()
    w = t["w_row"].clone().requires_grad_()
    b = t["b_row"].clone().requires_grad_()
    y = F.linear(x, w, b)
    y.backward(t["dy_row"])
    got = [r["row"] for r in row_world]
    for rank, g in enumerate(got):
        torch.testing.assert_close(g["y"], y.detach(), rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"rank {rank}: the output is not x W^T + b (is the bias added "
                                                 f"once, after the sum?): {m}")
        torch.testing.assert_close(g["db"], b.grad, rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"rank {rank}: the bias gradient is not sum(dy): {m}")
    torch.testing.assert_close(_full([g["dx"] for g in got], -1), x.grad, rtol=1e-12, atol=1e-12,
                               msg=lambda m: f"the input gradients are not the slices of dy W: {m}")
    torch.testing.assert_close(_full([g["dw"] for g in got], 1), w.grad, rtol=1e-12, atol=1e-12,
                               msg=lambda m: f"the weight gradients are not the columns of dW: {m}")


@pytest.mark.exercise("2.2")
def test_row_forward_all_reduces_once_and_backward_not_at_all(row_world):
    for rank, r in enumerate(row_world):
        assert r["row"]["fwd"] == [("all_reduce", (W.B, W.S, W.IN), "fwd")], (
            f"rank {rank}: the forward issued {r['row']['fwd']}; expected one all-reduce of the partial sums "
            f"[{W.B}, {W.S}, {W.IN}] (comm.reduce_from_tensor_model_parallel_region)")
        assert r["row"]["bwd"] == [], f"rank {rank}: the backward communicated {r['row']['bwd']} (g is the identity)"


@pytest.mark.exercise("2.2")
def test_tp_model_with_your_row_forward_trains_like_one_device(row_world):
    _check_runs(LAYER_RUNS, row_world)


# --------------------------------------------------------------------------------------
# 2.3 vocab-parallel cross-entropy
# --------------------------------------------------------------------------------------
LOSS_RUNS = [_run("gpt2")]          # tied embeddings: the embedding matrix makes the logits


@pytest.fixture(scope="module")
def loss_world():
    return spawn(plugged(W.grade_vocab_parallel_loss, "2.3"), WORLD, LOSS_RUNS, timeout=300)


@pytest.mark.exercise("2.3")
def test_loss_and_gradient_equal_one_device_with_a_padded_vocabulary(loss_world):
    t = W.loss_inputs()
    logits = t["logits"].clone().requires_grad_()
    loss = F.cross_entropy(logits.transpose(1, 2), t["labels"], reduction="none")      # [2, 5]
    loss.backward(t["dloss"])
    padded = loss_world[0]["padded"]
    grad = torch.cat([r["grad"] for r in loss_world], dim=-1)                          # [2, 5, Vp]
    for rank, r in enumerate(loss_world):
        torch.testing.assert_close(r["loss"], loss.detach(), rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"rank {rank}: the per-token losses differ from F.cross_entropy "
                                                 f"over the {W.VOCAB} real ids: {m}")
    torch.testing.assert_close(grad[..., :W.VOCAB], logits.grad, rtol=1e-12, atol=1e-12,
                               msg=lambda m: f"the logits' gradients are not (softmax - onehot) * dloss: {m}")
    assert torch.equal(grad[..., W.VOCAB:], torch.zeros(2, 5, padded - W.VOCAB, dtype=torch.float64)), \
        "the padding columns got a gradient"


@pytest.mark.exercise("2.3")
def test_three_all_reduces_of_b_s_numbers_and_no_logits_gathered(loss_world):
    for rank, r in enumerate(loss_world):
        assert r["fwd"] == [("all_reduce", (2, 5), "fwd")] * 3, (
            f"rank {rank}: the forward issued {r['fwd']}; expected exactly three all-reduces of [b, s] = [2, 5] "
            "(max, target logit, sum of exponentials) and nothing of the logits' size")
        assert r["bwd"] == [], f"rank {rank}: the backward communicated {r['bwd']}; it needs nothing"


@pytest.mark.exercise("2.3")
def test_tp_model_with_your_loss_trains_like_one_device(loss_world):
    _check_runs(LOSS_RUNS, loss_world)


# --------------------------------------------------------------------------------------
# 2.4 spot the bug: the filter of the global gradient norm
# --------------------------------------------------------------------------------------
# GPT-2 style (tied; replicated position table, biases and norms); DDP and ZeRO-1 both use it
NORM_RUNS = [_run("gpt2", zero_stage=0), _run("gpt2", zero_stage=1)]


@pytest.fixture(scope="module")
def norm_world():
    return spawn(plugged(W.grade_grad_norm, "2.4"), WORLD, NORM_RUNS, timeout=300)


@pytest.mark.exercise("2.4")
def test_replicated_gradients_count_once_and_a_shared_copy_not_at_all(norm_world):
    # the replicated [3, 4] once (25), plus every rank's shard [k, 2k], k = rank + 1: 5 k^2;
    # the pipeline's shared copy [10, 10] (200 per rank) not at all
    expected = 25.0 + sum(5.0 * (rank + 1) ** 2 for rank in range(WORLD))
    for rank, r in enumerate(norm_world):
        got = r["squares"]
        assert got == pytest.approx(expected, rel=1e-12), (
            f"rank {rank}: squared norm {got}, expected {expected}: the replicated [3, 4] counted once (25), "
            f"every rank's split shard [k, 2k] (5 k^2 each), the pipeline's shared copy [10, 10] not at all")
        assert r["ledger"] == [("all_reduce", (1,), "grad-norm")], \
            f"rank {rank}: issued {r['ledger']}; expected one all-reduce of one element, tag 'grad-norm'"


@pytest.mark.exercise("2.4")
def test_tp_model_with_your_filter_clips_like_one_device(norm_world):
    _check_runs(NORM_RUNS, norm_world)
