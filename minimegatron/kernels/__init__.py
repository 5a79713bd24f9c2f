"""Kernels written in Triton (chapter 07): FlashAttention-2, RMSNorm, LayerNorm and SwiGLU, forward
and backward, each beside the book's PyTorch function it replaces and checked against it, and the
output layer fused with the cross-entropy, chunked over tokens (cross_entropy.py; standalone).

Triton compiles them for a GPU. On a CPU (no CUDA device) they run in Triton's interpreter:
importing `minimegatron` sets TRITON_INTERPRET=1 there (minimegatron/triton_mode.py), which
Triton reads when it is first imported, so `minimegatron` must come before any `import triton`
of the process, or torch module that imports it (or set the variable yourself). The
interpreter is exact in float32 and hundreds of times slower than PyTorch: it is for reading and
testing the programs, not for speed. Without the `triton` package the kernels cannot be
imported (`available()` says why).
"""

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
    """Run `model`'s transformer layers through the Triton kernels (kernels "triton"), through
    torch.compile ("compile", _compile_layers), or leave it as it is ("torch"). Triton: each RMSNorm (the final one too) through rmsnorm.rms_norm, each
    LayerNorm likewise through layernorm.layer_norm, the
    attention core through flash_attention.flash_attention (the SelfAttention.core_attention
    seam), and a SwiGLU MLP's activation, the experts' too, through swiglu.swiglu (MLP.activation).
    GELU stays PyTorch's. parallelize.validate_layout has refused what the kernels
    cannot run (attention dropout, context parallelism, a head size that is not a power of 2).
    Returns the model."""
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
    """kernels "compile": each transformer layer's forward through torch.compile (Inductor; on a
    CPU it writes C++ that fuses the elementwise work: the norms, RoPE, the activation, the
    residual adds). The collectives run eagerly between the compiled pieces
    (comm.compile_barriers: each collective a graph break), so the ledger and the process groups work as without it. SwiGLU goes
    back to autograd's plain form (silu(gate) * up): the book's hand-written backward
    (model/mlp.py) writes into views, which the compiler cannot trace, and Inductor fuses the
    plain one anyway. Compiled on the first forward (seconds per distinct layer shape)."""
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
    """Give Inductor a cache folder of its own for each ATEN_CPU_CAPABILITY a process sets.
    Inductor picks its vector ISA from that variable ("default": none) but its cache key leaves the
    choice out (torch 2.13), so code generated for AVX-512 is fetched from the shared cache and
    compiled without AVX-512's headers (`'at::vec' has not been declared`). Call before the first
    compilation; the folder is the default one with "-aten_<capability>" added, set in the
    environment so spawned ranks share it. An unset variable, or a TORCHINDUCTOR_CACHE_DIR of your
    own, is left as it is."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if not capability or os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) != default_cache_dir():
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}-aten_{capability}"


def _fused_output_and_loss(model, unfused, x, labels):
    """GPTModel.output_and_loss through cross_entropy.linear_cross_entropy: the output layer
    and the loss in one op, vocabulary-parallel under TP (the group, the real vocabulary and
    sequence parallelism read from the tensor-parallel output layer and loss); logits
    (labels None) as before."""
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
