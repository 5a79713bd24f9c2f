"""Layout-independent initialisation: each parameter is a function of (seed, name) only, so a
parallel layer asks for the full value with `initial_value` and keeps its slice: every layout
starts from the single-device weights.

Megatron-LM's rules (init_method_normal / scaled_init_method_normal): weights ~ N(0, std),
std = init_method_std (0.02); linear_proj and linear_fc2 use std / sqrt(2 L); biases 0; norm
weights 1."""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from ..config import ModelConfig


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from (seed, name); stable across runs, machines and layouts."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def initial_value(name: str, shape: tuple[int, ...], config: ModelConfig) -> torch.Tensor:
    """The full initial value of parameter `name` (its single-device name) in config.dtype, drawn in
    float32 from a generator seeded by (config.seed, name), then cast."""
    if "layernorm" in name:                        # input_layernorm, pre_mlp_layernorm, final_layernorm
        value = torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    elif name.endswith("bias"):
        value = torch.zeros(shape)
    else:
        std = config.init_method_std
        if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            std = std / math.sqrt(2.0 * config.num_layers)
        generator = torch.Generator().manual_seed(parameter_seed(config.seed, name))
        value = torch.randn(shape, generator=generator, dtype=torch.float32) * std
    return value.to(config.dtype)


def init_name(name: str, config: ModelConfig) -> str:
    """The name whose initial value a parameter takes (a pipeline's last-stage tied
    `output_layer.weight` takes the word embedding's)."""
    if name == "output_layer.weight" and not config.untie_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    return name


@torch.no_grad()
def init_parameters(model: nn.Module, config: ModelConfig) -> None:
    """Set every parameter of `model` (named with global names) to its initial value."""
    for name, param in model.named_parameters():
        param.data = initial_value(init_name(name, config), tuple(param.shape), config)
