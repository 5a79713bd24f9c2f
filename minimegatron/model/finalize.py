"""The gradient hooks of a step: registered on the model by the transformations, run by
finalize_model_grads.

After the last backward of a step some gradients are not yet the single-device ones. Each
transformation that causes such a debt registers, on the module it transforms, the hook that
pays it, in that module's `grad_finalizers` {name: hook}:

    dp.DataParallel (every wrapper)      "data-parallel": finish_grad_sync of every chunk (01)
    pp.build_stage (pp > 1)              "tied-embedding": sum the two copies' gradients (03)
    tp.apply_tensor_parallel (SP)        "sequence-parallel": sum the norms' gradients over tp (04)
    GPTModel, moe.apply_expert_parallel  "expert-bias": the routers' bias update (05)

`grad_finalizers(chunks)` lists what a rank's chunks hold, in the order `finalize_model_grads`
runs them: each name once, the chunks' modules outermost first (the data-parallel wrapper),
then in the order of registration. A hook takes the list of this rank's chunks (bare or
wrapped) and does its collectives over the groups it was registered with, so every rank runs
the same hooks in the same order. A new chapter registers its hook; finalize_model_grads does
not change.

Megatron-LM: megatron/core/distributed/finalize_model_grads.py, one function that calls each
step in turn, edited per feature; here each feature registers its step.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

__all__ = ["register_grad_finalizer", "grad_finalizers", "finalize_model_grads"]

Hook = Callable[[list[nn.Module]], None]


def register_grad_finalizer(module: nn.Module, name: str, hook: Hook) -> None:
    """Run `hook(chunks)` after the last backward of every step of a model that contains
    `module`: module.grad_finalizers[name] = hook. A second hook of the same name on the same
    module replaces the first in place (apply_expert_parallel gives the expert-bias update its
    process group)."""
    vars(module).setdefault("grad_finalizers", {})[name] = hook


def grad_finalizers(chunks: list[nn.Module]) -> dict[str, Hook]:
    """{name: hook} registered on any module of any chunk, each name once (the first found),
    in the order finalize_model_grads runs them."""
    hooks: dict[str, Hook] = {}
    for chunk in chunks:
        for module in chunk.modules():
            for name, hook in vars(module).get("grad_finalizers", {}).items():
                hooks.setdefault(name, hook)
    return hooks


def finalize_model_grads(chunks: list[nn.Module]) -> None:
    """Finish every gradient of this rank's chunks after the last backward of a step: run each
    of grad_finalizers(chunks) on them (Megatron's finalize_model_grads)."""
    for hook in grad_finalizers(chunks).values():
        hook(chunks)
