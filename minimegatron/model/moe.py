"""A mixture of experts in place of the MLP: the single-device GPT-MoE of chapter 05.

Shape legend as in model/gpt.py, plus T = b s tokens, E experts (num_experts), k experts per
token (moe_router_topk), f_e an expert's inner width (moe_ffn_hidden_size).

    x [b, s, h] -> tokens [T, h]
      router: logits = tokens W_r^T [T, E] -> probs, routing_map [T, E]  (model/router.py)
      capacity (optional): each expert keeps at most ceil(T k / E * factor) of its tokens
      experts: expert e runs its own MLP on the tokens routed to it; every output row is
               weighted by its probability and added to its token's row:
                   y[t] = sum over chosen e of probs[t, e] * expert_e(tokens[t])
      shared expert (optional): one more MLP that every token takes, added unweighted
    -> [b, s, h]

Two forms of the experts, equal to rounding (tests/test_moe.py): `experts_loop`, one expert at
a time on its tokens (Megatron-Core's SequentialMLP), and `experts_grouped`, every expert in
one batched matrix product over tokens sorted by expert and padded to the largest count (what
a grouped GEMM does without the padding: Megatron's TEGroupedMLP).

Auxiliary losses (the load-balancing loss and the z-loss, model/router.py) do not change the
output. `MoEAuxLossAutoScaler` attaches them to it: the forward returns the output unchanged, the
backward adds d(aux)/d(logits) scaled by `aux_loss_scale`, which the training step sets to one
micro-batch's share (1 / number of micro-batches, as the language-model loss is scaled):
Megatron-Core's MoEAuxLossAutoScaler. The values are kept in `aux_losses` for logging.

Parameter names follow Megatron-Core's MoELayer: mlp.router.weight [E, h],
mlp.experts.local_experts.{e}.linear_fc1 / linear_fc2 (e the global expert index on every
layout), mlp.shared_experts.linear_fc1 / linear_fc2.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .mlp import MLP, mlp_activation
from .router import apply_token_dropping, aux_loss, topk_routing, z_loss

__all__ = ["MoELayer", "MoEAuxLossAutoScaler", "experts_loop", "experts_grouped", "set_moe_aux_loss_scale"]


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """forward(output, aux_loss, scale) -> output unchanged; backward: the output's gradient
    passes through, and aux_loss receives `scale` as its gradient, so its own backward adds
    scale * d(aux_loss) to the router's gradients."""

    @staticmethod
    def forward(ctx, output, aux, scale):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux, ctx.scale), None


def experts_loop(tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                 experts: dict[int, nn.Module]) -> torch.Tensor:
    """sum over the chosen experts of probs[t, e] * expert_e(tokens[t]): tokens [T, h], probs and
    routing_map [T, E], experts {global index e: MLP} (a rank may hold only some). -> [T, h]."""
    out = torch.zeros_like(tokens)
    for e, expert in experts.items():
        rows = routing_map[:, e].nonzero(as_tuple=True)[0]                   # [T_e] tokens routed to e
        if rows.numel():
            y = expert(tokens[rows]) * probs[rows, e].unsqueeze(-1).to(tokens.dtype)   # [T_e, h]
            out = out.index_add(0, rows, y)
    return out


def experts_grouped(tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                    experts: dict[int, nn.Module]) -> torch.Tensor:
    """The same as `experts_loop`, with every expert in one batched matrix product: the tokens
    sorted by expert into [E_local, C, h] (C the largest count, zero rows as padding), fc1 and fc2
    of all experts stacked into [E_local, f, h] and [E_local, h, f]."""
    ids = list(experts)
    mine = routing_map[:, ids]                                                # [T, E_local]
    expert_slot, rows = mine.t().nonzero(as_tuple=True)                       # sorted by expert, then token
    counts = mine.sum(0)                                                      # [E_local]
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(rows.numel(), device=tokens.device) - starts[expert_slot]
    capacity = int(counts.max()) if rows.numel() else 0
    grouped = tokens.new_zeros(len(ids), capacity, tokens.shape[-1])          # [E_local, C, h]
    grouped[expert_slot, position] = tokens[rows]
    first = next(iter(experts.values()))
    w1 = torch.stack([experts[e].linear_fc1.weight for e in ids])             # [E_local, f1, h]
    w2 = torch.stack([experts[e].linear_fc2.weight for e in ids])             # [E_local, h, f]
    y = grouped @ w1.transpose(1, 2)                                          # [E_local, C, f1]
    if first.linear_fc1.bias is not None:
        y = y + torch.stack([experts[e].linear_fc1.bias for e in ids]).unsqueeze(1)
    y = mlp_activation(y, first.swiglu) @ w2.transpose(1, 2)                  # [E_local, C, h]
    if first.linear_fc2.bias is not None:
        y = y + torch.stack([experts[e].linear_fc2.bias for e in ids]).unsqueeze(1)
    weights = probs[rows, torch.tensor(ids, device=tokens.device)[expert_slot]].to(tokens.dtype)
    return torch.zeros_like(tokens).index_add(0, rows, y[expert_slot, position] * weights.unsqueeze(-1))


class TopKRouter(nn.Module):
    """tokens [T, h] -> logits [T, E] (weight [E, h], no bias: Megatron's router.weight)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens @ self.weight.t()


class MoELayer(nn.Module):
    """[b, s, h] -> [b, s, h], the module docstring's computation. `grouped` picks the experts'
    form (False: experts_loop). aux_loss_scale: the backward scale of the auxiliary losses
    (set_moe_aux_loss_scale); aux_losses: their last values, {"load_balancing", "z_loss"}."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.router = TopKRouter(config)
        self.experts = nn.Module()
        self.experts.local_experts = nn.ModuleDict({str(e): MLP(config, config.moe_ffn_size)
                                                    for e in range(config.num_experts)})
        shared = config.moe_shared_expert_intermediate_size
        self.shared_experts = MLP(config, shared) if shared else None
        self.grouped = False
        self.aux_loss_scale = 1.0
        self.aux_losses: dict[str, float] = {}

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [T, h] -> (logits [T, E], probs [T, E], routing_map [T, E]), capacity applied."""
        cfg = self.config
        logits = self.router(tokens)                                              # [T, E]
        probs, routing_map = topk_routing(logits, cfg.moe_router_topk, score_function=cfg.moe_router_score_function,
                                          pre_softmax=cfg.moe_router_pre_softmax)
        if cfg.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_token_dropping(probs, routing_map, cfg.moe_router_topk,
                                                      cfg.moe_expert_capacity_factor, cfg.moe_token_drop_policy)
        return logits, probs, routing_map

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)                                              # [T, h]
        logits, probs, routing_map = self.route(tokens)
        experts = {int(e): m for e, m in self.experts.local_experts.items()}
        out = (experts_grouped if self.grouped else experts_loop)(tokens, probs, routing_map, experts)   # [T, h]
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        if self.training and (cfg.moe_aux_loss_coeff or cfg.moe_z_loss_coeff):
            balance = aux_loss(logits, routing_map, cfg.moe_router_topk, cfg.moe_aux_loss_coeff,
                               score_function=cfg.moe_router_score_function)
            stability = z_loss(logits, cfg.moe_z_loss_coeff)
            self.aux_losses = {"load_balancing": balance.item(), "z_loss": stability.item()}
            out = MoEAuxLossAutoScaler.apply(out, balance + stability, self.aux_loss_scale)
        return out.view(b, s, h)


def set_moe_aux_loss_scale(models: list[nn.Module], scale: float) -> None:
    """Give every MoE layer of `models` the backward scale of its auxiliary losses (the training
    step: 1 / number of micro-batches, the same share as each micro-batch's language-model loss)."""
    for model in models:
        for module in model.modules():
            if isinstance(module, MoELayer):
                module.aux_loss_scale = scale
