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
from differences import assert_close, differs
from minimegatron.model.linear import RMSNorm


# --------------------------------------------------------------------------------------
# 7.3 the online-softmax merge
# --------------------------------------------------------------------------------------
def _state(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The oracle, from the docstring's definitions over the keys seen so far (scores [r, n],
    v [n, d]): m the max of the scores, l the sum of exp(score - m), acc the sum of
    exp(score - m) v; a row that has seen only -inf keeps m = -inf, l = 0, acc = 0."""
    m = scores.max(dim=-1).values
    e = torch.exp(scores - torch.where(torch.isinf(m), 0.0, m)[:, None])
    return m, e.sum(dim=-1), e @ v


def _missing_factor(name: str, got, m_old, l_old, acc_old, m_new, scores, v) -> tuple[str, str]:
    """(what is missing, why) for a wrong l or acc: the old sum (or output) added without being
    brought to the new maximum (its factor exp(m_old - m_new)), or the block's terms taken
    against the old maximum instead of the new one; ("", the rule) when it is neither."""
    safe_new, safe_old = (torch.where(torch.isinf(x), 0.0, x) for x in (m_new, m_old))
    p_new, p_old = torch.exp(scores - safe_new[:, None]), torch.exp(scores - safe_old[:, None])
    old = l_old if name == "l" else acc_old
    new_terms, old_terms = (p_new.sum(-1), p_old.sum(-1)) if name == "l" else (p_new @ v, p_old @ v)
    factor = [f"{f:.3g}" for f in torch.exp(m_old - safe_new).tolist()]
    if got.shape == old.shape and torch.allclose(got, old + new_terms):
        return (f"the old {name} lacks its factor exp(m_old - m_new)",
                f"your {name} is the old {name} plus this block's terms: the old {name} was not brought to the new "
                f"maximum. Multiply it by exp(m_old - m_new), here {', '.join(factor)} for the rows")
    if got.shape == old.shape and torch.allclose(got, old * torch.exp(m_old - safe_new).view(-1, *[1] * (old.dim() - 1))
                                                 + old_terms):
        return ("this block's terms lack the factor exp(m_old - m_new)",
                f"your {name} adds this block's exp(score - m_old): take them against the new maximum, "
                f"exp(score - m_new)")
    return "", (f"{name} must be the sum of exp(score - m){'' if name == 'l' else ' v'} over every key seen so far, "
                f"m the running maximum")


def _check_merge(scores: torch.Tensor, v: torch.Tensor, block: int) -> tuple:
    """Feed the blocks one by one; after each, (m, l, acc) must be the state of the keys seen so
    far (_state), the next block starting from that right state. A failure names the output, the
    block and the missing factor."""
    step = implementation("7.3")
    r, d = scores.shape[0], v.shape[1]
    m, l, acc = torch.full((r,), float("-inf"), dtype=scores.dtype), torch.zeros(r, dtype=scores.dtype), \
        torch.zeros(r, d, dtype=scores.dtype)
    blocks = range(0, scores.shape[1], block)
    for i, start in enumerate(blocks):
        part, vp = scores[:, start:start + block], v[start:start + block]
        m_new, l_new, acc_new = step(m, l, acc, part, vp)
        want = _state(scores[:, :start + block], v[:start + block])
        given = (f"{r} rows of {scores.shape[1]} keys in blocks of {block}: block {i + 1} of {len(blocks)}, keys "
                 f"[{start}, {min(start + block, scores.shape[1])}), after the earlier blocks' right state")
        assert_close(m_new, want[0], f"m (the running maximum) after block {i + 1}", given=given,
                     why="m is the maximum of every score seen so far")
        for name, got, w in (("l", l_new, want[1]), ("acc", acc_new, want[2])):
            missing, why = _missing_factor(name, got, m, l, acc, want[0], part, vp)
            quantity = f"{name} (the running {'sum' if name == 'l' else 'output'}) after block {i + 1}"
            assert_close(got, w, f"{missing}: {quantity}" if missing else quantity, given=given, why=why)
        m, l, acc = want
    return m, l, acc


@pytest.mark.exercise("7.3")
@pytest.mark.parametrize("block", [1, 3, 4, 12])
def test_merging_the_blocks_gives_the_whole_rows_softmax(block):
    torch.manual_seed(0)
    scores, v = torch.randn(6, 12, dtype=torch.float64) * 3, torch.randn(12, 5, dtype=torch.float64)
    m, l, acc = _check_merge(scores, v, block)
    given = f"6 rows of 12 keys (float64), blocks of {block}"
    assert_close(acc / l[:, None], torch.softmax(scores, -1) @ v, "acc / l after the last block", given=given,
                 why="it is softmax(scores) v over the whole row")
    assert_close(m + l.log(), scores.logsumexp(-1), "m + log l after the last block", given=given,
                 why="it is the row's log-sum-exp")


@pytest.mark.exercise("7.3")
def test_a_row_masked_so_far_stays_finite_and_then_counts():
    torch.manual_seed(2)
    scores, v = torch.randn(2, 8, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    scores[0, :4] = float("-inf")                             # row 0: its whole first block is masked
    step = implementation("7.3")
    m, l, acc = step(torch.full((2,), float("-inf"), dtype=torch.float64), torch.zeros(2, dtype=torch.float64),
                     torch.zeros(2, 3, dtype=torch.float64), scores[:, :4], v[:4])
    given = "2 rows of 8 keys in blocks of 4, row 0's first block all -inf (masked), from m = -inf, l = 0, acc = 0"
    got = (m[0].item(), l[0].item(), acc[0].tolist())
    if got != (float("-inf"), 0.0, [0.0, 0.0, 0.0]):
        raise AssertionError(differs("row 0's (m, l, acc) after its fully masked block", got,
                                     (float("-inf"), 0.0, [0.0, 0.0, 0.0]), given=given,
                                     why="a row that has seen only -inf keeps m = -inf, l = 0, acc = 0; "
                                         "exp(-inf - (-inf)) is NaN: what must m_new be replaced by?"))
    m, l, acc = _check_merge(scores, v, 4)                    # both blocks, each against its state
    assert_close(acc / l[:, None], torch.softmax(scores, -1) @ v, "acc / l after the second block", given=given,
                 why="softmax(scores) v: the masked keys count for nothing, the others as usual")


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
    given = f"x, dy [{rows}, {h}], w [{h}] (float32, torch.manual_seed({rows})), eps 1e-5"
    assert_close(dx, xr.grad, "dx", given=given, why="autograd through model/linear.py's RMSNorm: x reaches y "
                 "directly and through rstd, which every feature of the row shares")
    assert_close(dw, norm.weight.grad, "dw", given=given,
                 why="autograd through model/linear.py's RMSNorm: dy x rstd, summed over every row")


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
    assert_close(got, want, "dlogits", given=f"logits [{rows}, {vocab}], labels, lse, grad [{rows}] (token 0's grad 0: "
                 f"masked), torch.manual_seed({vocab})",
                 why="autograd through F.cross_entropy: grad[:, None] (softmax - onehot): each token's own incoming "
                     "gradient, the softmax, the label's -1")


@pytest.mark.exercise("7.5")
def test_a_rank_holding_part_of_the_vocabulary_subtracts_only_its_own_labels():
    torch.manual_seed(1)
    logits, labels = torch.randn(8, 40), torch.randint(0, 40, (8,))
    grad, lse = torch.rand(8), logits.logsumexp(-1)
    want = torch.func.grad(lambda z: (torch.nn.functional.cross_entropy(z, labels, reduction="none") * grad).sum())(
        logits)
    for start in (0, 16, 32):                                    # three ranks' columns [start, start + 16)
        got = implementation("7.5")(logits[:, start:start + 16].clone(), labels - start, lse, grad)
        assert_close(got, want[:, start:start + 16], f"dlogits of the columns [{start}, {start + 16})",
                     given=f"a rank's 16 of 40 vocabulary columns, 8 tokens, local labels {(labels - start).tolist()}, "
                           "the whole rows' lse",
                     why="a label outside [0, 16) belongs to another rank and has no one-hot here (labels are local: "
                         "label - the rank's first id)")


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
    given = "x [20, 8], w [30, 8], 20 labels, chunks of 6 tokens, the summed loss"
    why = "the fused loss with your gradient inside, against autograd through F.cross_entropy(x @ w.T)"
    assert_close(dx, x.grad, "dx of linear_cross_entropy", given=given, why=why)
    assert_close(dw, w.grad, "dw of linear_cross_entropy", given=given, why=why)
