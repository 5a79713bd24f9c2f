"""The attention core every context-parallel variant calls: one block at a time, with its
log-sum-exp, so partial results can be merged exactly.

q [b, a, sq, d], k, v [b, g, sk, d] (query head i uses key/value head i // (a / g)); lse
[b, a, sq] the log-sum-exp of a query row's scaled scores over the block's keys:

    lse_i = log sum_j exp(q_i . k_j / sqrt(d))        out_i = sum_j exp(q_i . k_j / sqrt(d) - lse_i) v_j

Two blocks merge exactly (`merge_attention`):
lse = log(exp(lse_A) + exp(lse_B)), out = out_A exp(lse_A - lse) + out_B exp(lse_B - lse).
Backward per block from the FINAL out and lse, P = exp(S_B - lse), D = rowsum(dout * out):

    dV_B = P^T dout      dS = P * (dout V_B^T - D)      dQ += dS K_B / sqrt(d)      dK_B = dS^T Q / sqrt(d)

summed over blocks, the single-device gradients (`attention_block_backward`).

Backends: "naive" (scores stored; the oracle) and "sdpa" (PyTorch's CPU flash kernel with lse;
elsewhere the naive path). `causal`: query row i sees key columns j <= i of a square block.
`same_document` [b, sq, sk] masks packed documents (naive path) with OUTSIDE_DOCUMENT, finite
so that a block without any of a row's keys gives lse ~ -1e30 (merge weight 0), not nan."""

from __future__ import annotations

import math

import torch

from ..model.linear import compute_dtype

__all__ = ["attention_block_forward", "attention_block_backward", "merge_attention", "flash_kernel_available"]

OUTSIDE_DOCUMENT = -1e30     # the score of a key in another document (see the module docstring)


def flash_kernel_available(t: torch.Tensor) -> bool:
    """True when PyTorch's CPU flash-attention kernel (with lse) can run on `t`."""
    return t.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, g, sk, d] -> [b, a, sk, d]: key/value head i // (a/g) for query head i."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _scores(q, k, causal, same_document=None):
    """Scaled scores [b, a, sq, sk] in the compute dtype, -inf above the diagonal if causal,
    OUTSIDE_DOCUMENT where same_document [b, sq, sk] is False."""
    dtype = compute_dtype(q)
    scores = (q.to(dtype) @ _repeat_kv(k, q.shape[1]).to(dtype).transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if same_document is not None:
        scores = scores.masked_fill(~same_document.unsqueeze(1), OUTSIDE_DOCUMENT)
    if causal:
        sq, sk = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores


def attention_block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                            backend: str = "sdpa", same_document: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one block of keys: (out [b, a, sq, d] in q's dtype, lse [b, a, sq] float32
    for 16-bit inputs, else q's dtype); same_document [b, sq, sk] masks packed documents. No
    autograd (the callers use attention_block_backward)."""
    with torch.no_grad():
        if backend == "sdpa" and flash_kernel_available(q) and same_document is None:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
            return out, lse.to(compute_dtype(q))
        scores = _scores(q, k, causal, same_document)                          # [b, a, sq, sk]
        lse = torch.logsumexp(scores, dim=-1)                                  # [b, a, sq]
        probs = torch.exp(scores - lse.unsqueeze(-1))
        out = probs @ _repeat_kv(v, q.shape[1]).to(probs.dtype)               # [b, a, sq, d]
        return out.to(q.dtype), lse


def attention_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, causal: bool, backend: str = "sdpa",
                             same_document: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share (dq [b, a, sq, d], dk, dv [b, g, sk, d]) given the FINAL out and lse of the
    query rows (module docstring); grouped heads' dk, dv summed over their group."""
    with torch.no_grad():
        if backend == "sdpa" and flash_kernel_available(q) and same_document is None:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout.contiguous(), q, k, v, out.contiguous(), lse.to(compute_dtype(q)).contiguous(), 0.0, causal)
        dtype = compute_dtype(q)
        heads, groups = q.shape[1], k.shape[1]
        probs = torch.exp(_scores(q, k, causal, same_document) - lse.unsqueeze(-1).to(dtype))  # [b, a, sq, sk]
        dout_, q_ = dout.to(dtype), q.to(dtype)
        dv = probs.transpose(-2, -1) @ dout_                                     # [b, a, sk, d]
        dprobs = dout_ @ _repeat_kv(v, heads).to(dtype).transpose(-2, -1)         # [b, a, sq, sk]
        delta = (dout_ * out.to(dtype)).sum(-1, keepdim=True)                    # [b, a, sq, 1]
        dscores = probs * (dprobs - delta) / math.sqrt(q.shape[-1])
        dq = dscores @ _repeat_kv(k, heads).to(dtype)                            # [b, a, sq, d]
        dk = dscores.transpose(-2, -1) @ q_                                      # [b, a, sk, d]
        if groups != heads:                                                      # sum each group's heads
            b, _, sk, d = dk.shape
            dk = dk.view(b, groups, heads // groups, sk, d).sum(2)
            dv = dv.view(b, groups, heads // groups, sk, d).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over blocks A and B from the attention over each.

    out_a, out_b [b, a, sq, d]: each block's attention output (softmax over that block's keys
    only); lse_a, lse_b [b, a, sq]: each block's log-sum-exp of the scaled scores,
    lse = log sum_j exp(q . k_j / sqrt(d)). The softmax over A and B together weighs block A by
    exp(lse_a) / (exp(lse_a) + exp(lse_b)), so

        lse = log(exp(lse_a) + exp(lse_b))     out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)

    computed without overflow (torch.logaddexp: scores of thousands are fine), the weights in
    lse's dtype. Returns (out in out_a's dtype, lse in lse_a's dtype). Exact: merging the
    blocks of a sequence one by one, in any order, gives softmax attention over all of it."""
    # BEGIN EXERCISE 4.1: merge two partial attention results | hint: in log space the union of two blocks adds their softmax denominators, and each block's output counts by its share of that sum; keep every exponent <= 0 and mind the spec's dtypes (Transformer Engine: flash_attn_fwd_out_correction)
    lse = torch.logaddexp(lse_a, lse_b)                                          # [b, a, sq]
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1)                              # [b, a, sq, 1]
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1)
    out = out_a.to(lse.dtype) * weight_a + out_b.to(lse.dtype) * weight_b        # [b, a, sq, d]
    return out.to(out_a.dtype), lse
    # END EXERCISE
