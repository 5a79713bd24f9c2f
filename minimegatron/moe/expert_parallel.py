"""Expert parallelism as a transformation of the one model: `apply_expert_parallel`.

Shapes as in model/moe.py, plus ep, etp, E_l = E / ep, f_e the expert's inner width.
`apply_expert_parallel(model, layout, dispatcher)` takes a GPTModel (or stage) whose MoE
layers hold all E experts with their single-device weights, and in place sets:

  experts.local_experts      experts ep_rank E_l .. (ep_rank+1) E_l - 1 (global keys)
    linear_fc1 [f1, h]       etp > 1: this etp rank's f_e / etp rows (SwiGLU: stride 2), column-parallel
    linear_fc2 [h, f_e]      etp > 1: its f_e / etp columns, row-parallel (the dispatcher sums)
    every expert parameter   `allreduce = False`: gradient summed over expert-dp, not dp x cp
  token_dispatcher           AllToAllDispatcher(ep, etp) or AllGatherDispatcher(etp x ep)
  aux_group, aux_grad_scale  the tp x cp group and cp (model/moe.py)
  grad_finalizers            "expert-bias" given the tp x dp x cp group

The router and shared expert are tensor parallelism's (MoELayer.tensor_parallel_plan).
check_expert_parallel_config refuses ZeRO-2/3 and the naive DDP with experts, and etp > 1
with expert biases.
Megatron-LM: megatron/core/transformer/moe/experts.py, moe_layer.py, parallel_state.py."""

from __future__ import annotations

import torch
from torch import nn

from ..comm import group_rank, group_size
from ..config import ConfigError, ModelConfig, TrainConfig
from ..model.finalize import register_grad_finalizer
from ..model.moe import moe_layers, update_expert_bias
from ..optim import is_expert_parameter
from ..placement import Split, set_placement
from ..tp.layers import shard_cols, shard_rows
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
    """Replace linear.weight by this etp rank's part along `dim` (stride blocks cut alike), recorded
    as split over the etp group (so it can be gathered back)."""
    with torch.no_grad():
        shard = (shard_rows if dim == 0 else shard_cols)(linear.weight, group, stride)
    old, linear.weight = linear.weight, nn.Parameter(shard)
    set_placement(linear.weight, like=old, split=Split(dim, group, group_size(group), group_rank(group), stride))


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
