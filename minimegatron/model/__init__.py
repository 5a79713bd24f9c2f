"""The one model of the book: a GPT-2 / LLaMA style decoder-only transformer (see gpt.py).
Every parallelism transforms it (minimegatron/parallelize.py); none forks it."""

from .finalize import finalize_model_grads, grad_finalizers, register_grad_finalizer
from .attention import SelfAttention, causal_attention, sdpa_attention
from .gpt import (Embedding, GPTModel, LanguageModelLoss, TransformerBlock, TransformerLayer, language_model_loss,
                  mean_loss)
from .init import init_parameters, initial_value, parameter_seed
from .linear import LayerNorm, Linear, RMSNorm
from .mlp import MLP
from .moe import MoELayer
from .rope import apply_rotary_pos_emb, rope_cos_sin, rotate_half

__all__ = ["GPTModel", "TransformerBlock", "TransformerLayer", "MLP", "MoELayer", "Embedding", "SelfAttention", "causal_attention",
           "sdpa_attention", "LanguageModelLoss", "language_model_loss", "mean_loss", "init_parameters", "initial_value", "parameter_seed",
           "Linear", "LayerNorm", "RMSNorm", "apply_rotary_pos_emb", "rope_cos_sin", "rotate_half",
           "register_grad_finalizer", "grad_finalizers", "finalize_model_grads"]
