"""The one model of the book: a GPT-2 / LLaMA style decoder-only transformer (see gpt.py).
Every parallelism transforms it (minimegatron/parallelize.py); none forks it."""

from .finalize import finalize_model_grads, grad_finalizers, register_grad_finalizer
from .attention import causal_attention, sdpa_attention
from .gpt import GPTModel, language_model_loss, mean_loss
from .init import initial_value
from .moe import MoELayer
from .rope import apply_rotary_pos_emb, rope_cos_sin

__all__ = ["GPTModel", "MoELayer", "causal_attention", "sdpa_attention", "language_model_loss", "mean_loss",
           "initial_value", "apply_rotary_pos_emb", "rope_cos_sin", "register_grad_finalizer", "grad_finalizers",
           "finalize_model_grads"]
