"""The gradient hooks of a step: registered by the transformations, run by finalize_model_grads.

After the last backward of a step, some gradients are not yet the single-device ones: the
data-parallel replicas still hold their own (chapter 01), a sequence-parallel norm holds only
its tokens' share (chapter 04), a tied embedding's two pipeline copies hold one use each
(chapter 03); a router's expert bias moves with the step's counts (chapter 05). Each
transformation that causes such a debt registers the hook that pays it, on the module it
transforms, when it transforms it:

    dp.DataParallel (every wrapper)     "data-parallel": finish_grad_sync of every chunk
    model/moe.py, moe.apply_expert_parallel  "expert-bias": the routers' bias update
    pp.build_stage (pipeline)           "tied-embedding": sum the two copies' gradients
    tp.apply_tensor_parallel (SP)       "sequence-parallel": sum the norms' gradients over tp
    (chapter 06: the FP8 amax reductions; ...)

and `finalize_model_grads(chunks)` runs every hook found on the chunks, each once, the data-
parallel sync first (the wrapper is the outermost module), then in the order they were
registered. A hook takes the list of this rank's chunks (bare or wrapped) and does its
collectives over the groups it was registered with, so every rank runs the same hooks in the
same order. A new chapter registers its hook; finalize_model_grads does not change.

Megatron-LM: megatron/core/distributed/finalize_model_grads.py, one function that calls each
step in turn (finish_grad_sync, _allreduce_conditional_embedding_grads,
_allreduce_non_tensor_model_parallel_grads, _allreduce_word_embedding_grads,
_allreduce_position_embedding_grads, _update_router_expert_bias, ...), edited per feature;
here each feature registers its step.
"""

from __future__ import annotations

import weakref
from typing import Callable

from torch import nn

__all__ = ["register_grad_finalizer", "finalize_model_grads"]

Hook = Callable[[list[nn.Module]], None]
_HOOKS: "weakref.WeakKeyDictionary[nn.Module, dict[str, Hook]]" = weakref.WeakKeyDictionary()


def register_grad_finalizer(module: nn.Module, name: str, hook: Hook) -> None:
    """Run `hook(chunks)` after the last backward of every step of a model that contains
    `module`. A second hook of the same name on the same module replaces the first in place
    (e.g. apply_expert_parallel gives the expert-bias update its process group)."""
    _HOOKS.setdefault(module, {})[name] = hook


def finalize_model_grads(chunks: list[nn.Module]) -> None:
    """Finish every gradient of this rank's chunks after the last backward of a step: each hook
    registered on any module of any chunk, once per name, in the order of the chunks' modules
    (outermost first) and of registration (Megatron's finalize_model_grads)."""
    hooks: dict[str, Hook] = {}
    for chunk in chunks:
        for module in chunk.modules():
            for name, hook in _HOOKS.get(module, {}).items():
                hooks.setdefault(name, hook)
    for hook in hooks.values():
        hook(chunks)
