"""Kernels written in Triton (chapter 07): FlashAttention-2, RMSNorm, LayerNorm and SwiGLU, forward
and backward, each beside the PyTorch function it replaces, and the output layer fused with the
cross-entropy, chunked over tokens (cross_entropy.py).

On a CPU they run in Triton's interpreter (exact in float32, slow): importing `minimegatron`
sets TRITON_INTERPRET=1 (triton_mode.py), so `minimegatron` must be imported before triton
(or any torch module that imports it). `available()` says why they cannot run, if so."""

from __future__ import annotations

import torch

from ..triton_mode import TRITON_IMPORTED_FIRST


LOSS_CHUNK_TOKENS = 1024      # tokens whose logits the fused loss holds at a time ([chunk, V/tp])


def available() -> str | None:
    """None when the Triton kernels can run here, else the reason they cannot."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the triton package is not installed (pip install triton; requirements.txt pins it)"
    if TRITON_IMPORTED_FIRST and not torch.cuda.is_available():
        return ("triton was imported before minimegatron could set TRITON_INTERPRET=1 for this CPU; import "
                "minimegatron first, or set TRITON_INTERPRET=1 in the environment")
    return None


def apply_kernels(model, kernels: str):
    """Run `model`'s transformer layers through the Triton kernels ("triton"), torch.compile
    ("compile", _compile_layers), or unchanged ("torch"). Triton: RMSNorm and LayerNorm (the
    final one too) through rms_norm / layer_norm, the attention core through flash_attention
    (SelfAttention.core_attention), a SwiGLU activation (experts' too) through swiglu; GELU stays.
    validate_layout has refused what they cannot run. Returns the model."""
    if kernels == "torch":
        return model
    from functools import partial
    if kernels == "compile":
        return _compile_layers(model)

    from ..model.linear import LayerNorm, RMSNorm
    from ..model.mlp import MLP
    from .flash_attention import flash_attention
    from .swiglu import swiglu
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.forward = partial(_rms_norm_forward, module)
        elif isinstance(module, LayerNorm):
            module.forward = partial(_layer_norm_forward, module)
        elif isinstance(module, MLP) and module.swiglu:
            module.activation = swiglu
    for layer in model.decoder.layers.values():
        layer.self_attention.core_attention = flash_attention
    if model.post_process:
        model.output_and_loss = partial(_fused_output_and_loss, model, model.output_and_loss)
    return model


def _compile_layers(model):
    """"compile": each transformer layer's forward through torch.compile (Inductor), compiled on the
    first forward; collectives run eagerly between the pieces (comm.compile_barriers). SwiGLU goes
    back to plain silu(gate) * up (the hand-written backward writes into views)."""
    import torch.nn.functional as F

    from ..comm import compile_barriers
    from ..model.mlp import MLP
    compile_barriers()                                 # every collective a graph break
    compile_cache_for_this_capability()

    def plain_swiglu(y):
        gate, up = y.chunk(2, dim=-1)                                        # [.., f] each
        return F.silu(gate) * up
    for module in model.modules():
        if isinstance(module, MLP) and module.swiglu:
            module.activation = plain_swiglu
    for layer in model.decoder.layers.values():
        layer.compile()
    return model


def compile_cache_for_this_capability() -> None:
    """Give Inductor a cache folder per ATEN_CPU_CAPABILITY ("-aten_<capability>" added to the
    default, set in the environment for spawned ranks): torch 2.13's cache key leaves the ISA out.
    Call before the first compilation; an unset variable or your own TORCHINDUCTOR_CACHE_DIR is
    left alone."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if not capability or os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) != default_cache_dir():
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}-aten_{capability}"


def _fused_output_and_loss(model, unfused, x, labels):
    """GPTModel.output_and_loss through cross_entropy.linear_cross_entropy (vocabulary-parallel under
    TP, read from the output layer and loss); logits when labels is None."""
    from ..comm import ALONE
    from .cross_entropy import linear_cross_entropy
    if labels is None:
        return unfused(x, labels)
    return linear_cross_entropy(x, model.output_weight(), labels, chunk=LOSS_CHUNK_TOKENS,
                                group=getattr(model.loss, "group", ALONE),
                                vocab_size=getattr(model.loss, "vocab_size", model.config.vocab_size),
                                sequence_parallel=getattr(model.output_layer, "sequence_parallel", False))


def _rms_norm_forward(norm, x):
    from .rmsnorm import rms_norm
    return rms_norm(x, norm.weight, norm.eps)


def _layer_norm_forward(norm, x):
    from .layernorm import layer_norm
    return layer_norm(x, norm.weight, norm.bias, norm.eps)
