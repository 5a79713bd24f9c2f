"""Expert parallelism as a transformation of the one model: `apply_expert_parallel`.

Shape legend as in model/moe.py, plus ep, etp, E_l = E / ep, f_e the expert's inner width.
`apply_expert_parallel(model, layout, dispatcher)` takes a GPTModel (or a pipeline stage) whose
MoE layers hold all E experts with their single-device weights, and in place:

  experts.local_experts      keeps experts ep_rank E_l .. (ep_rank+1) E_l - 1 (keys stay the global
                             index, so names read like the single-device ones; Megatron's
                             modules count 0 .. E_l - 1 on every rank and use the global index
                             only in distributed-checkpoint keys, model/moe.py)
    linear_fc1 [f1, h]       with etp > 1: this etp rank's f_e / etp rows (SwiGLU: of the gate and
                             of the up half, stride 2), like a column-parallel linear
    linear_fc2 [h, f_e]      with etp > 1: its f_e / etp columns, like a row-parallel linear; the
                             etp ranks' partial outputs are summed by the dispatcher
    every expert parameter   marked `allreduce = False` (Megatron's attribute): its gradient is
                             summed over the expert-data-parallel group, not averaged over dp x cp
  token_dispatcher           AllToAllDispatcher(ep, etp) or AllGatherDispatcher(etp x ep)
  aux_group, aux_grad_scale  the tp x cp group and cp (model/moe.py: the auxiliary losses'
                             token set is the micro-batch's, spread over those ranks)

The router and the shared expert are not touched: the router is replicated like a norm (under
sequence parallelism tp.apply_tensor_parallel marks it `sequence_parallel`), the shared expert
is a dense MLP (tensor-parallel over tp like the MLP of a dense layer).

Why expert gradients take another group. A dense weight is replicated over the dp x cp ranks,
each saw its own tokens, so the gradients are averaged there. An expert lives on the ranks of
one expert-data-parallel group (the ranks with the same ep and etp coordinates), and every
token routed to it, from any rank, reached one of them. So its single-device gradient is the
SUM over that group, divided by dp x cp like every gradient (each rank's loss is a mean over
its own tokens): Megatron's DDP scales expert buckets by the same 1/dp and all-reduces them over
the expert-dp group (dp/ddp.py: expert_group).

Megatron-LM (checked 2026-11-24, main at d98e8a6): megatron/core/transformer/moe/experts.py
(SequentialMLP, TEGroupedMLP, the etp split), moe_layer.py (MoELayer), megatron/core/
parallel_state.py (the expert groups), megatron/core/distributed/distributed_data_parallel.py
(the expert buffers and their scaling), finalize_model_grads.py (the expert-bias update after
each step). Megatron's linear layers mark an expert's parameters allreduce=False only when
its expert process groups differ from the dense ones: ep > 1, or etp != tp, or the expert
GTP size != the dense GTP size (expert_gtp_weight_remat_size != gtp_weight_remat_size, its
weight-rematerialising generalized tensor parallelism; tensor_parallel/layers.py, checked on
main d98e8a6, 2026-11-27). Otherwise the expert-dp group is the dense one; the book marks
them in every multi-rank layout, which reduces them over the same ranks in that case. Limits
of the book, refused by name in check_expert_parallel_config: experts train with the bucketed
DDP or ZeRO-1 (dp/zero.py: expert buckets sharded over the expert-dp group, as Megatron's
distributed optimizer keeps them apart), not ZeRO-2/3 or the naive DDP (Megatron shards
experts' gradients and parameters too, with Megatron-FSDP: --use-megatron-fsdp
--data-parallel-sharding-strategy optim_grads or optim_grads_params); etp > 1 needs
bias-free experts.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import group_rank, group_size
from ..config import ConfigError, ModelConfig, TrainConfig
from ..model.finalize import register_grad_finalizer
from ..model.moe import moe_layers, update_expert_bias
from ..optim import is_expert_parameter
from ..placement import Split, set_placement
from .dispatcher import AllGatherDispatcher, AllToAllDispatcher

__all__ = ["check_expert_parallel_config", "apply_expert_parallel", "moe_layers", "update_expert_bias",
           "is_expert_parameter"]


def check_expert_parallel_config(model_cfg: ModelConfig, cfg: TrainConfig, world_size: int) -> None:
    """ConfigError naming the fields and the numbers for an expert layout that cannot run."""
    ep, etp, tp, pp = (cfg.expert_model_parallel_size, cfg.etp, cfg.tensor_model_parallel_size,
                       cfg.pipeline_model_parallel_size)
    if model_cfg.num_experts is None:
        if ep > 1 or cfg.expert_tensor_parallel_size not in (None, tp):
            raise ConfigError(f"expert_model_parallel_size={ep}, expert_tensor_parallel_size="
                              f"{cfg.expert_tensor_parallel_size}: a model without experts (set num_experts)")
        return
    E = model_cfg.num_experts
    if E % ep:
        raise ConfigError(f"num_experts={E} is not divisible by expert_model_parallel_size={ep}")
    if world_size % (etp * ep * pp):
        raise ConfigError(f"world size {world_size} is not divisible by expert_tensor_parallel_size={etp} x "
                          f"expert_model_parallel_size={ep} x pipeline_model_parallel_size={pp}")
    if model_cfg.moe_ffn_size % etp:
        raise ConfigError(f"moe_ffn_hidden_size={model_cfg.moe_ffn_size} is not divisible by "
                          f"expert_tensor_parallel_size={etp}")
    if tp > 1 and not cfg.sequence_parallel:
        raise ConfigError(f"num_experts={E} with tensor_model_parallel_size={tp} needs sequence_parallel "
                          f"(--sequence-parallel), as in Megatron-Core: each tp rank routes its own s/tp tokens")
    if etp > 1 and model_cfg.add_bias_linear:
        raise ConfigError(f"expert_tensor_parallel_size={etp} with add_bias_linear: the etp ranks' partial "
                          f"outputs are summed, which would add an expert's fc2 bias etp times; use "
                          f"--disable-bias-linear (or expert_tensor_parallel_size 1)")
    if world_size > 1 and (cfg.zero_stage >= 2 or (cfg.zero_stage == 0 and cfg.ddp_impl != "bucketed")):
        raise ConfigError(f"num_experts={E} in a world of {world_size} ranks with zero_stage={cfg.zero_stage}, "
                          f"ddp_impl={cfg.ddp_impl!r}: experts reduce their gradients over the expert-data-"
                          f"parallel group in buffers of their own, written here for the bucketed DDP and "
                          f"ZeRO-1 (zero_stage 0 with ddp_impl 'bucketed', or zero_stage 1)")


def _keep_slice(linear: nn.Module, dim: int, group, stride: int) -> None:
    """Replace linear.weight by this etp rank's part of it along `dim` (stride blocks each cut
    alike: SwiGLU's [gate; up]), its record split over the etp group like a tensor-parallel shard
    (so it can be gathered back)."""
    size, rank = group_size(group), group_rank(group)
    with torch.no_grad():
        blocks = linear.weight.chunk(stride, dim)
        shard = torch.cat([b.chunk(size, dim)[rank] for b in blocks], dim).clone()
    old, linear.weight = linear.weight, nn.Parameter(shard)
    set_placement(linear.weight, like=old, split=Split(dim, group, size, rank, stride))


def apply_expert_parallel(model: nn.Module, layout, dispatcher: str = "alltoall") -> nn.Module:
    """Spread the experts of `model`'s MoE layers over layout's ep group, cut each over its etp
    group, and attach the token dispatcher and the auxiliary losses' group (module docstring).
    In place; returns `model`. A no-op for a model without MoE layers and for one rank."""
    layers = moe_layers(model)
    if not layers or layout.world == 1:
        return model
    ep, etp, ep_rank = group_size(layout.ep_group), group_size(layout.etp_group), group_rank(layout.ep_group)
    for layer in layers:
        per_rank = layer.config.num_experts // ep
        mine = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
        for key in [k for k in layer.experts.local_experts if int(k) not in mine]:
            del layer.experts.local_experts[key]
        for expert in layer.experts.local_experts.values():
            if etp > 1:
                _keep_slice(expert.linear_fc1, 0, layout.etp_group, 2 if expert.swiglu else 1)
                _keep_slice(expert.linear_fc2, 1, layout.etp_group, 1)
            for p in expert.parameters():                             # Megatron's allreduce=False
                set_placement(p, allreduce=False, ep_group=layout.ep_group)
        if ep * etp > 1:
            layer.token_dispatcher = (AllToAllDispatcher(layer.config.num_experts, layout.ep_group, layout.etp_group)
                                      if dispatcher == "alltoall" else AllGatherDispatcher(layout.etp_ep_group))
        if group_size(layout.tp_cp_group) > 1:
            layer.aux_group = layout.tp_cp_group
        layer.aux_grad_scale = layout.cp
    register_grad_finalizer(model, "expert-bias", lambda chunks: update_expert_bias(chunks, layout.tp_dp_cp_group))
    return model
