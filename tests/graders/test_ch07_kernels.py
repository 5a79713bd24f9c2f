"""Graders of chapter 07's kernels: the online-softmax merge inside a FlashAttention tile (7.3)
and RMSNorm's backward (7.4), the PyTorch functions the Triton kernels mirror.

The oracles: torch.softmax and torch.logsumexp over the whole row (merging the blocks one by one
must give them, whatever the block sizes), a row whose first blocks are all masked (it must stay
finite), and autograd through the book's RMSNorm module (model/linear.py), which differentiates
the forward without knowing the closed form."""

from __future__ import annotations

import pytest
import torch

from booktools.exercises import implementation
from minimegatron.model.linear import RMSNorm


# --------------------------------------------------------------------------------------
# 7.3 the online-softmax merge
# --------------------------------------------------------------------------------------
def _merge(scores: torch.Tensor, v: torch.Tensor, block: int):
    step = implementation("7.3")
    r, d = scores.shape[0], v.shape[1]
    m, l, acc = torch.full((r,), float("-inf"), dtype=scores.dtype), torch.zeros(r, dtype=scores.dtype), \
        torch.zeros(r, d, dtype=scores.dtype)
    for start in range(0, scores.shape[1], block):
        m, l, acc = step(m, l, acc, scores[:, start:start + block], v[start:start + block])
    return m, l, acc


@pytest.mark.exercise("7.3")
@pytest.mark.parametrize("block", [1, 3, 4, 12])
def test_merging_the_blocks_gives_the_whole_rows_softmax(block):
    torch.manual_seed(0)
    scores, v = torch.randn(6, 12, dtype=torch.float64) * 3, torch.randn(12, 5, dtype=torch.float64)
    m, l, acc = _merge(scores, v, block)
    torch.testing.assert_close(acc / l[:, None], torch.softmax(scores, -1) @ v, msg="acc / l is not softmax(scores) v")
    torch.testing.assert_close(m + l.log(), scores.logsumexp(-1), msg="m + log l is not the row's log-sum-exp")


@pytest.mark.exercise("7.3")
def test_a_row_masked_so_far_stays_finite_and_then_counts():
    scores, v = torch.randn(2, 8, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    scores[0, :4] = float("-inf")                             # row 0: its whole first block is masked
    step = implementation("7.3")
    m, l, acc = step(torch.full((2,), float("-inf"), dtype=torch.float64), torch.zeros(2, dtype=torch.float64),
                     torch.zeros(2, 3, dtype=torch.float64), scores[:, :4], v[:4])
    assert torch.isfinite(l).all() and torch.isfinite(acc).all(), "a fully masked block made l or acc NaN"
    assert m[0] == float("-inf") and l[0] == 0 and acc[0].abs().sum() == 0, (m[0], l[0], acc[0])
    m, l, acc = step(m, l, acc, scores[:, 4:], v[4:])
    torch.testing.assert_close(acc / l[:, None], torch.softmax(scores, -1) @ v)


# --------------------------------------------------------------------------------------
# 7.4 RMSNorm's backward
# --------------------------------------------------------------------------------------
@pytest.mark.exercise("7.4")
@pytest.mark.parametrize("rows, h", [(1, 2), (7, 48), (16, 64)])
def test_the_gradients_are_autograds_through_the_books_rmsnorm(rows, h):
    torch.manual_seed(rows)
    x, w, dy = torch.randn(rows, h), torch.randn(h), torch.randn(rows, h)
    norm = RMSNorm(h, 1e-5)
    norm.weight.data.copy_(w)
    xr = x.clone().requires_grad_()
    norm(xr).backward(dy)
    rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-5)
    dx, dw = implementation("7.4")(dy, x, w, rstd)
    torch.testing.assert_close(dx, xr.grad, msg="dx differs from autograd through model/linear.py's RMSNorm")
    torch.testing.assert_close(dw, norm.weight.grad, msg="dw differs from autograd (summed over every row?)")


# --------------------------------------------------------------------------------------
# 7.5 the chunked cross-entropy's gradient
# --------------------------------------------------------------------------------------
@pytest.mark.exercise("7.5")
@pytest.mark.parametrize("rows, vocab", [(1, 3), (6, 50), (9, 257)])
def test_the_logits_gradient_is_autograds_through_torchs_cross_entropy(rows, vocab):
    torch.manual_seed(vocab)
    logits, labels = torch.randn(rows, vocab) * 2, torch.randint(0, vocab, (rows,))
    grad = torch.rand(rows)
    grad[0] = 0.0                                                 # a masked token: no gradient at all
    want = torch.func.grad(lambda z: (torch.nn.functional.cross_entropy(z, labels, reduction="none") * grad).sum())(
        logits)
    got = implementation("7.5")(logits.clone(), labels, logits.logsumexp(-1), grad)
    torch.testing.assert_close(got, want, msg="dlogits differs from autograd through F.cross_entropy "
                                              "(each token's own incoming gradient, the softmax, the label's -1?)")


@pytest.mark.exercise("7.5")
def test_a_rank_holding_part_of_the_vocabulary_subtracts_only_its_own_labels():
    torch.manual_seed(1)
    logits, labels = torch.randn(8, 40), torch.randint(0, 40, (8,))
    grad, lse = torch.rand(8), logits.logsumexp(-1)
    want = torch.func.grad(lambda z: (torch.nn.functional.cross_entropy(z, labels, reduction="none") * grad).sum())(
        logits)
    for start in (0, 16, 32):                                    # three ranks' columns [start, start + 16)
        got = implementation("7.5")(logits[:, start:start + 16].clone(), labels - start, lse, grad)
        torch.testing.assert_close(got, want[:, start:start + 16], msg=(
            f"the columns [{start}, {start + 16}) differ: a label outside a rank's columns belongs to another "
            "rank and has no one-hot here (labels are local: label - the rank's first id)"))


@pytest.mark.exercise("7.5")
def test_the_fused_loss_with_your_gradient_equals_the_unfused_one():
    from booktools.exercises import plugged
    from minimegatron.kernels.cross_entropy import linear_cross_entropy
    torch.manual_seed(0)
    x, w, labels = torch.randn(20, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True), \
        torch.randint(0, 30, (20,))
    plugged(lambda: linear_cross_entropy(x, w, labels, chunk=6).sum().backward(), "7.5")()
    dx, dw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    torch.nn.functional.cross_entropy(x @ w.t(), labels, reduction="sum").backward()
    torch.testing.assert_close(dx, x.grad)
    torch.testing.assert_close(dw, w.grad)
