"""Rank functions for tests/test_gemm_seam.py: every weight matmul goes through a layer's `gemm`.

A stand-in for chapter 06's FP8: a Gemm whose weight gradient is zero. Swapped into every module
that has a `gemm` (a transformation: nothing in tp/, moe/ or model/ changes), it must leave every
weight matrix without a gradient, through the tensor-parallel layers' hand-written backwards, the
sequence-parallel ones, the experts (loop and batched) and the router; with the plain Gemm the
same matrices get gradients.
"""

from __future__ import annotations

import torch

from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.model.linear import GEMM, Gemm
from minimegatron.parallelize import build_model
from minimegatron.placement import placement_of
from minimegatron.resume import initialize_layout


class _NoWeightGrad(torch.autograd.Function):
    """y = x W^T + b (W [out, in] or a stack [E, out, in]); backward: dx and db, but dW = 0."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(w)
        ctx.bias = b is not None
        return GEMM.linear(x, w, b)

    @staticmethod
    def backward(ctx, dy):
        (w,) = ctx.saved_tensors
        db = dy.sum(dim=tuple(range(dy.dim() - 1))) if ctx.bias and w.dim() == 2 else \
            dy.sum(dim=-2) if ctx.bias else None
        return dy @ w, torch.zeros_like(w), db


class NoWeightGradGemm(Gemm):
    """The plain products, except that a weight never gets a gradient."""

    def wgrad(self, dy, x):
        return torch.zeros(dy.shape[-1], x.shape[-1], dtype=dy.dtype, device=dy.device)

    def linear(self, x, w, b=None):
        return _NoWeightGrad.apply(x, w, b)


def weight_grads(grouped: bool | None, swap: bool) -> dict[str, float]:
    """TP 2 + SP with a mixture of experts (etp 2; their loop form, or `grouped`) and a shared
    expert, or (grouped None) a dense TP 2 model without SP: {matrix name: |grad|} after one
    forward and backward, with every gemm swapped for NoWeightGradGemm if `swap`."""
    moe = dict(num_experts=2, moe_router_topk=1, moe_shared_expert_intermediate_size=64, moe_aux_loss_coeff=1e-2)
    model_cfg = ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                                  max_position_embeddings=16, params_dtype="float64",
                                  **(moe if grouped is not None else {}))
    cfg = TrainConfig(seq_length=16, tensor_model_parallel_size=2, sequence_parallel=grouped is not None)
    chunk = build_model(model_cfg, cfg, initialize_layout(cfg))[0]
    for module in chunk.modules():
        if isinstance(vars(module).get("gemm"), Gemm):
            module.gemm = NoWeightGradGemm() if swap else module.gemm
        if type(module).__name__ == "MoELayer":
            module.grouped = grouped
    tokens = torch.randint(0, model_cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    chunk(tokens, labels=tokens.roll(-1, 1)).mean().backward()
    return {placement_of(p).name: float(p.grad.abs().sum()) for p in chunk.parameters()
            if p.dim() >= 2 and "embedding" not in placement_of(p).name}
