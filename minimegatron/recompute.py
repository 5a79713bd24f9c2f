"""Activation recompute (chapter 07): keep less for the backward, and compute the rest again
when the backward needs it (Megatron's --recompute-granularity, -method, -num-layers, -modules).

    model = apply_recompute(model, cfg.recompute_granularity, cfg.recompute_method,
                            cfg.recompute_num_layers, cfg.recompute_modules)   # parallelize.build_model

full       the chunk's layers run in units (`recompute_units`: "uniform" every `num_layers`
           consecutive layers, "block" each of the first `num_layers` layers). A unit keeps only
           its input [b, s, h] (and the RoPE tables); its backward runs its forward again.
selective  the named part of every layer is a unit (--recompute-modules): "core_attn" (the
           [b, a, s, s] probabilities), "mlp", "moe", "moe_act" (each expert's activation),
           "layernorm" (both norms).

The recompute computes the very numbers of the first forward (tests/test_recompute.py): the
random states of torch's generator and every tracker stream are saved and set again (exercise
7.1); FP8 per-tensor scales are reused, no amax taken (Gemm.set_recompute); collectives run
again, tagged "recompute <tag>" (comm.retagged).

Megatron: megatron/core/tensor_parallel/random.py (CheckpointFunction) and recompute.py.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import nn

from .comm import retagged
from .tp.random import get_rng_tracker

__all__ = ["checkpoint", "apply_recompute", "recompute_units", "get_rng_states", "set_rng_states"]

def get_rng_states() -> tuple:
    """Every random state a forward draws from: torch's default CPU generator, the CUDA
    generator when there is one, and the tracker's streams."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, get_rng_tracker().get_states()


def set_rng_states(states: tuple) -> None:
    """Set what get_rng_states returned (the tracker's streams must not be forked now)."""
    # BEGIN EXERCISE 7.1: spot the bug in the recompute's random states | hint: dropout draws from more than one generator in this book; which of them does a tensor-parallel layer's dropout use, and would the recompute then draw the same mask?
    cpu, cuda, tracker = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    get_rng_tracker().set_states(tracker)
    # END EXERCISE


class CheckpointFunction(torch.autograd.Function):
    """out = run(*args), keeping only `args` (tensors or None) for the backward; `run` returns one
    tensor. The backward sets the forward's random states, runs `run` again with autograd on
    (collectives retagged "recompute ", the FP8 `gemms` reusing their scales), backpropagates the
    incoming gradient, restores the backward's random states, and returns the gradients of `args`."""

    @staticmethod
    def forward(ctx, run: Callable, gemms: list, *args):
        ctx.run, ctx.gemms, ctx.rng = run, gemms, get_rng_states()
        with torch.no_grad(), _recompute_phase(gemms, "checkpointed"):
            out = run(*args)
        ctx.save_for_backward(*args)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        inputs = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        backward_states = get_rng_states()
        set_rng_states(ctx.rng)
        try:
            with torch.enable_grad(), retagged("recompute"), _recompute_phase(ctx.gemms, "recomputing"):
                out = ctx.run(*inputs)
        finally:
            set_rng_states(backward_states)
        torch.autograd.backward(out, grad_out)
        return (None, None, *[t.grad if t is not None and t.requires_grad else None for t in inputs])


class _recompute_phase:
    """Tell each FP8 gemm of a unit which forward this is ("checkpointed": the first, whose
    activations are recomputed; "recomputing": the recompute), and None after it."""

    def __init__(self, gemms: list, phase: str):
        self.gemms, self.phase = gemms, phase

    def __enter__(self):
        for gemm in self.gemms:
            gemm.set_recompute(self.phase)

    def __exit__(self, *exc):
        for gemm in self.gemms:
            gemm.set_recompute(None)


def checkpoint(run: Callable, gemms: list, *args):
    """run(*args) as a recomputed unit (CheckpointFunction) when a backward will follow (grad
    mode on); plainly otherwise (evaluation, generation). `gemms`: the unit's layers' gemms,
    told the phase (gemms_of)."""
    if not torch.is_grad_enabled():
        return run(*args)
    return CheckpointFunction.apply(run, gemms, *args)


def gemms_of(*modules: nn.Module) -> list:
    """The distinct gemms (model/linear.py's seam) of the linear layers inside `modules`."""
    return list({id(m.gemm): m.gemm for module in modules for m in module.modules() if hasattr(m, "gemm")}.values())


def recompute_units(num_layers: int, method: str, per_unit: int) -> list[tuple[int, int, bool]]:
    """The chunk's layers 0..num_layers-1 as (start, end, recomputed) runs: "uniform" cuts them
    into units of `per_unit` layers (the last may be shorter), all recomputed; "block" gives
    every layer a run of its own, (i, i + 1, ...), recomputed for the first `per_unit` layers
    and not for the rest. Every layer is in exactly one run, in order (Megatron:
    checkpointed_forward in megatron/core/recompute.py)."""
    # BEGIN EXERCISE 7.2: full recompute's units | hint: a unit keeps only its input, so fewer, longer units keep less and recompute the same; which method leaves layers alone, and which cuts them all?
    if method == "uniform":
        return [(i, min(i + per_unit, num_layers), True) for i in range(0, num_layers, per_unit)]
    return [(i, i + 1, i < per_unit) for i in range(num_layers)]
    # END EXERCISE


def _run_layers(layers: list[nn.Module], x: torch.Tensor, cos, sin, document_ids) -> torch.Tensor:
    rope = None if cos is None else (cos, sin)
    for layer in layers:
        x = layer(x, rope, document_ids)                                # [b, s, h]
    return x


def _checkpointed_block_forward(block: nn.Module, units: list[tuple[int, int, bool]], x: torch.Tensor,
                                rope, document_ids=None) -> torch.Tensor:
    """The TransformerBlock's forward under full recompute: its layers in `units`, x [b, s, h]
    -> [b, s, h]. The RoPE tables go in as two tensors (a unit's inputs are tensors)."""
    layers = list(block.layers.values())
    cos, sin = rope if rope is not None else (None, None)
    for start, end, recomputed in units:
        unit = layers[start:end]
        if recomputed:
            x = checkpoint(partial(_run_layers, unit), gemms_of(*unit), x, cos, sin, document_ids)   # [b, s, h]
        else:
            x = _run_layers(unit, x, cos, sin, document_ids)
    return x


def _recompute(module: nn.Module, name: str, gemms: list) -> None:
    """Make `module.<name>` (its forward, or a method its forward calls) a recomputed unit: an
    instance attribute over the class's method, so hooks and parameter names stay as they are."""
    setattr(module, name, partial(checkpoint, getattr(module, name), gemms))


def apply_recompute(model: nn.Module, granularity: str | None, method: str | None = None,
                    num_layers: int | None = None, modules: tuple[str, ...] = ("core_attn",)) -> nn.Module:
    """Recompute `model`'s activations as the module docstring says (granularity None: the model
    unchanged). TrainConfig.validate has checked the combination (Megatron's rules). Returns
    the model."""
    if granularity is None:
        return model
    block = model.decoder
    if granularity == "full":
        units = recompute_units(len(block.layers), method, num_layers)
        block.forward = partial(_checkpointed_block_forward, block, units)
        return model
    from .model.moe import MoELayer
    for layer in block.layers.values():
        moe = isinstance(layer.mlp, MoELayer)
        if "core_attn" in modules:
            _recompute(layer.self_attention, "core_attention_forward", [])
        if "layernorm" in modules:
            _recompute(layer.input_layernorm, "forward", [])
            _recompute(layer.pre_mlp_layernorm, "forward", [])
        if ("mlp" in modules and not moe) or ("moe" in modules and moe):
            _recompute(layer.mlp, "forward", gemms_of(layer.mlp))
        elif "moe_act" in modules and moe:
            for expert in layer.mlp.local_experts().values():
                _recompute(expert, "activation", [])
    return model
