"""A mixture of experts in place of the MLP: the single-device GPT-MoE of chapter 05.

Shapes as in model/gpt.py, plus T = b s tokens, E experts (num_experts), k experts per token
(moe_router_topk), f_e an expert's inner width (moe_ffn_hidden_size).

    x [b, s, h] -> tokens [T, h]
      router: logits = tokens W_r^T [T, E] -> probs, routing_map [T, E]  (model/router.py)
      capacity (optional): each expert keeps at most ceil(T k / E * factor) of its tokens
      experts: y[t] = sum over chosen e of probs[t, e] * expert_e(tokens[t])
      shared expert (optional): one more MLP every token takes, added unweighted
    -> [b, s, h]

Two forms of the experts, equal to rounding: `experts_loop` (Megatron's SequentialMLP) and
`experts_grouped`, one batched product over tokens sorted by expert (Megatron's TEGroupedMLP).
The auxiliary losses reach the router's gradient through MoEAuxLossAutoScaler, scaled by
`aux_loss_scale` (1 / micro-batches); their values are in `aux_losses`.

Names follow Megatron-Core's MoELayer: mlp.router.weight [E, h],
mlp.experts.local_experts.{e}.linear_fc1 / linear_fc2, mlp.shared_experts.linear_fc1 / linear_fc2,
with e the GLOBAL expert index on every layout (Megatron's modules use the local index)."""

from __future__ import annotations

import torch
from torch import nn

from ..comm import all_reduce, group_size
from ..config import ModelConfig
from .linear import GEMM
from .mlp import MLP
from .router import apply_token_dropping, aux_loss, expert_bias_update, sequence_aux_loss, topk_routing, z_loss

__all__ = ["MoELayer", "MoEAuxLossAutoScaler", "experts_loop", "experts_grouped", "experts_on_sorted_tokens",
           "moe_layers", "set_moe_aux_loss_scale", "update_expert_bias"]


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
    """The same as `experts_loop`, with every expert in one batched matrix product: the (token,
    expert) pairs sorted by expert, then run by `experts_on_sorted_tokens` (grouped)."""
    ids = list(experts)
    expert_slot, rows = routing_map[:, ids].t().nonzero(as_tuple=True)      # sorted by expert, then token
    counts = torch.bincount(expert_slot, minlength=len(ids)).tolist()        # [E_local]
    y = experts_on_sorted_tokens(tokens[rows], counts, list(experts.values()), grouped=True)   # [N, h]
    weights = probs[rows, torch.tensor(ids, device=tokens.device)[expert_slot]].to(tokens.dtype)
    return torch.zeros_like(tokens).index_add(0, rows, y * weights.unsqueeze(-1))


def experts_on_sorted_tokens(x: torch.Tensor, counts: list[int], experts: list[nn.Module],
                             grouped: bool = False) -> torch.Tensor:
    """Each expert on its own rows: x [N, h] holds counts[0] rows for experts[0], then counts[1] for
    experts[1], ... -> [N, h], unweighted. grouped=False: one expert at a time; True: rows padded
    to [E_local, C, h] (C the largest count), fc1/fc2 stacked to [E_local, f1, h] / [E_local, h, f]
    and multiplied by the first expert's gemm (Megatron: TEGroupedMLP, without the padding)."""
    if not grouped:
        return torch.cat([expert(chunk) for expert, chunk in zip(experts, x.split(counts))])
    counts_t = torch.tensor(counts, device=x.device)
    expert_slot = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts_t)   # [N]
    position = torch.arange(x.shape[0], device=x.device) - (torch.cumsum(counts_t, 0) - counts_t)[expert_slot]
    padded = x.new_zeros(len(counts), max(counts, default=0), x.shape[-1])    # [E_local, C, h]
    padded[expert_slot, position] = x
    first, bias = experts[0], experts[0].linear_fc1.bias is not None
    w1 = torch.stack([e.linear_fc1.weight for e in experts])                              # [E_local, f1, h]
    w2 = torch.stack([e.linear_fc2.weight for e in experts])                              # [E_local, h, f]
    b1 = torch.stack([e.linear_fc1.bias for e in experts]) if bias else None              # [E_local, f1]
    b2 = torch.stack([e.linear_fc2.bias for e in experts]) if bias else None              # [E_local, h]
    y = first.linear_fc1.gemm.linear(padded, w1, b1)                                      # [E_local, C, f1]
    y = first.linear_fc2.gemm.linear(first.activation(y), w2, b2)                         # [E_local, C, h]
    return y[expert_slot, position]


class TopKRouter(nn.Module):
    """tokens [T, h] -> logits [T, E] (weight [E, h], no bias; Megatron's has one with
    add_bias_linear). With config.moe_router_enable_expert_bias, buffers expert_bias [E] (saved
    with the model) and local_tokens_per_expert [E] (counts since the last update_expert_bias)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.gemm = GEMM
        self.bias_update_rate = config.moe_router_bias_update_rate
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert", torch.zeros(config.num_experts, dtype=torch.float32),
                                 persistent=False)
        else:
            self.expert_bias = self.local_tokens_per_expert = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gemm.linear(tokens, self.weight)                             # [T, E]


class MoELayer(nn.Module):
    """[b, s, h] -> [b, s, h], the module docstring's computation; `grouped` picks the experts' form.
    aux_losses: last values on this rank, {"load_balancing", "z_loss"}.

    Set by expert parallelism (moe/expert_parallel.py), None or 1 on one device:
      token_dispatcher  callable(tokens, probs, routing_map, local experts, grouped) -> [T, h]
                        (moe/dispatcher.py); None: every expert is here
      aux_group         the tp x cp group, whose tokens together make the micro-batch
      aux_grad_scale    cp: the cp ranks' aux losses are parts of one sum, gradients averaged over
                        dp x cp, so they weigh cp times"""

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
        self.token_dispatcher = None
        self.aux_group = None
        self.aux_grad_scale = 1

    @property
    def tensor_parallel_plan(self) -> dict[str, str]:
        """tp.apply_tensor_parallel's cut: the router replicated (s/tp tokens under SP), the shared expert
        as a dense MLP, the routed experts left to moe.apply_expert_parallel (etp)."""
        plan = {"router": "replicated"}
        if self.shared_experts is not None:
            plan |= {"shared_experts.linear_fc1": "column", "shared_experts.linear_fc2": "row"}
        return plan

    def local_experts(self) -> dict[int, nn.Module]:
        """{global expert index: its MLP} for the experts this rank holds (all of them on one device)."""
        return {int(e): m for e, m in self.experts.local_experts.items()}

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [T, h] -> (logits [T, E], probs [T, E], routing_map [T, E]), capacity applied."""
        cfg = self.config
        logits = self.router(tokens)                                              # [T, E]
        probs, routing_map = topk_routing(logits, cfg.moe_router_topk, score_function=cfg.moe_router_score_function,
                                          pre_softmax=cfg.moe_router_pre_softmax, expert_bias=self.router.expert_bias)
        if cfg.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_token_dropping(probs, routing_map, cfg.moe_router_topk,
                                                      cfg.moe_expert_capacity_factor, cfg.moe_token_drop_policy)
        if self.router.local_tokens_per_expert is not None and self.training and torch.is_grad_enabled():
            self.router.local_tokens_per_expert += routing_map.sum(0)
        return logits, probs, routing_map

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)                                              # [T, h]
        logits, probs, routing_map = self.route(tokens)
        if self.token_dispatcher is None:
            out = (experts_grouped if self.grouped else experts_loop)(tokens, probs, routing_map, self.local_experts())
        else:
            out = self.token_dispatcher(tokens, probs, routing_map, self.local_experts(), self.grouped)   # [T, h]
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).reshape(b * s, h)
        if self.training and (self.config.moe_aux_loss_coeff or self.config.moe_z_loss_coeff):
            out = self.attach_aux_losses(out, logits, b)
        return out.view(b, s, h)

    def attach_aux_losses(self, out: torch.Tensor, logits: torch.Tensor, batch_size: int) -> torch.Tensor:
        """Attach the load-balancing loss and z-loss of this rank's logits [T, E] to `out`'s backward.
        Routed counts (plain top-k, before capacity and bias) are summed over aux_group: one all-reduce
        of E numbers (b E for "seq_aux_loss"), tag "moe-aux"; the z-loss coefficient is divided by its
        size, so the ranks' losses add up to the layer's."""
        cfg = self.config
        k, parts = cfg.moe_router_topk, group_size(self.aux_group) if self.aux_group is not None else 1
        top = torch.zeros_like(logits, dtype=torch.bool).scatter(1, logits.topk(k, dim=-1).indices, True)  # [T, E]
        if cfg.moe_router_load_balancing_type == "seq_aux_loss":
            counts = top.view(batch_size, -1, top.shape[-1]).sum(1).to(logits.dtype)   # [b, E] per sequence
        else:
            counts = top.sum(0).to(logits.dtype)                                        # [E]
        if parts > 1:
            all_reduce(counts, self.aux_group, op="sum", tag="moe-aux")
        if cfg.moe_router_load_balancing_type == "seq_aux_loss":
            balance = sequence_aux_loss(logits, top, k, cfg.moe_aux_loss_coeff, batch_size,
                                        score_function=cfg.moe_router_score_function, tokens_per_expert=counts,
                                        seq_length=logits.shape[0] // batch_size * parts)
        else:
            balance = aux_loss(logits, top, k, cfg.moe_aux_loss_coeff, score_function=cfg.moe_router_score_function,
                               tokens_per_expert=counts, num_tokens=logits.shape[0] * parts)
        stability = z_loss(logits, cfg.moe_z_loss_coeff / parts)
        self.aux_losses = {"load_balancing": balance.item(), "z_loss": stability.item()}
        return MoEAuxLossAutoScaler.apply(out, balance + stability, self.aux_loss_scale * self.aux_grad_scale)


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The MoE layers of a model (or pipeline stage, or its data-parallel wrapper), in model order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def set_moe_aux_loss_scale(models: list[nn.Module], scale: float) -> None:
    """Set every MoE layer's auxiliary-loss backward scale (1 / number of micro-batches)."""
    for model in models:
        for layer in moe_layers(model):
            layer.aux_loss_scale = scale


@torch.no_grad()
def update_expert_bias(models: list[nn.Module], group=None) -> None:
    """After a step's backward, move every expert bias (router.expert_bias_update) by the step's
    counts summed over `group` (tp x dp x cp of this stage; None on one device): one all-reduce of
    the stacked counts, tag "moe-bias"; then reset the counts. No-op without expert biases.
    Megatron: finalize_model_grads.py, _update_router_expert_bias."""
    routers = [layer.router for m in models for layer in moe_layers(m) if layer.router.expert_bias is not None]
    if not routers:
        return
    counts = torch.stack([r.local_tokens_per_expert for r in routers])          # [layers, E]
    if group is not None and group_size(group) > 1:
        all_reduce(counts, group, op="sum", tag="moe-bias")
    for router, c in zip(routers, counts):
        router.expert_bias.copy_(expert_bias_update(c, router.expert_bias, router.bias_update_rate))
        router.local_tokens_per_expert.zero_()
