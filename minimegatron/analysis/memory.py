"""The memory of training that does not depend on the batch: parameters, gradients, optimizer.

Shape legend (the one of model/gpt.py): N parameters, dp data-parallel size.

Per parameter, training with Adam keeps

    the parameter itself           2 bytes (bf16/fp16) or 4 (fp32)
    its gradient                   same dtype as the parameter (or fp32, if asked)
    Adam's exp_avg (m)             4 bytes when the optimizer steps fp32 weights
    Adam's exp_avg_sq (v)          4 bytes
    an fp32 master copy            4 bytes, only in mixed precision

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", Section 3.1: mixed-precision Adam holds 2 + 2 + 12 = 16 bytes per parameter (fp16
parameter and gradient, and K = 12 bytes of optimizer state: fp32 master weights, momentum,
variance). Plain fp32 AdamW holds 4 + 4 + 8 = 16 bytes too: no master copy is needed because
the weights already are fp32. A 7B-parameter model therefore needs 112 GB before it has seen
a single token.

ZeRO (Section 5) removes the data-parallel redundancy: each of the dp ranks keeps a 1/dp shard
of the optimizer state (stage 1), also of the gradients (stage 2), also of the parameters
(stage 3). Chapter 01 builds all three; `training_memory(..., zero_stage, dp)` is the formula
its measurements are compared with.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelConfig, dtype_from_name
from ..dp import DataParallel, storage_bytes
from ..optim import Optimizer, is_expert_parameter
from .params import count_parameters

_DTYPE_ALIASES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16,
                  "fp16": torch.float16, "float16": torch.float16}


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch.dtype from a dtype or a name ("float32", "bfloat16", "bf16", "fp16", ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[dtype]
    return dtype_from_name(dtype)


def bytes_per_element(dtype: torch.dtype | str) -> int:
    """Bytes of one element: 2 for bf16/fp16, 4 for fp32, 8 for fp64 (and int64)."""
    return as_dtype(dtype).itemsize


def adam_bytes_per_parameter(param_dtype: torch.dtype | str, master_weights: bool = False,
                             grad_dtype: torch.dtype | str | None = None) -> dict:
    """Bytes that training with Adam(W) keeps for ONE parameter.

    Args:
      param_dtype:    dtype of the model's weights (the ones forward and backward use).
      master_weights: mixed precision: the optimizer updates an fp32 copy of each weight and
                      casts it back to param_dtype after every step.
      grad_dtype:     dtype of the gradients; default: param_dtype (what autograd produces).

    Returns a dict of bytes:
      "params"          size(param_dtype)
      "grads"           size(grad_dtype)
      "master_weights"  4 with master weights, else 0
      "exp_avg"         Adam's first moment m
      "exp_avg_sq"      Adam's second moment v
      "optimizer"       master_weights + exp_avg + exp_avg_sq   (the ZeRO paper's K)
      "total"           params + grads + optimizer

    The moments have the dtype of the weights the optimizer steps: fp32 under master weights,
    otherwise param_dtype (torch.optim.AdamW allocates them with `zeros_like(param)`).

        bf16 + master weights:  2 + 2 + (4 + 4 + 4) = 16   (ZeRO, Rajbhandari et al. 2020, 3.1)
        fp32, no master copy:   4 + 4 + (0 + 4 + 4) = 16
        bf16, no master copy:   2 + 2 + (0 + 2 + 2) = 8    (cheap, but small updates round away)
    """
    # BEGIN EXERCISE 0.3: memory of Adam training | hint: which copy of the weights does Adam step, and in what dtype does zeros_like create its two moments? Check your dict against the docstring's three worked lines (ZeRO, section 3.1)
    params = bytes_per_element(param_dtype)
    grads = bytes_per_element(param_dtype if grad_dtype is None else grad_dtype)
    master = 4 if master_weights else 0
    moment = 4 if master_weights else params
    optimizer = master + moment + moment
    return {"params": params, "grads": grads, "master_weights": master, "exp_avg": moment,
            "exp_avg_sq": moment, "optimizer": optimizer, "total": params + grads + optimizer}
    # END EXERCISE


def zero_held(n: int, dp: int, zero_stage: int) -> dict[str, int]:
    """{"params", "grads", "optimizer"}: how many of n parameters' elements of each one rank of dp
    holds under ZeRO stage zero_stage; a shard is ceil(n / dp) (the last rank's padded)."""
    shard = math.ceil(n / dp)
    return {"params": shard if zero_stage >= 3 else n, "grads": shard if zero_stage >= 2 else n,
            "optimizer": shard if zero_stage >= 1 else n}


def training_memory(config: ModelConfig, *, param_dtype: torch.dtype | str | None = None,
                    grad_dtype: torch.dtype | str | None = None, optimizer: str = "adam",
                    master_weights: bool = False, zero_stage: int = 0, dp: int = 1) -> dict:
    """Bytes ONE data-parallel rank holds for parameters, gradients and optimizer state.

    With N = count_parameters(config)["total"] and the per-parameter bytes of
    `adam_bytes_per_parameter` (p params, g grads, K optimizer state):

        zero_stage 0 (plain DP):   p N + g N + K N              every rank holds everything
        zero_stage 1 (P_os):       p N + g N + K N / dp         optimizer state sharded
        zero_stage 2 (P_os+g):     p N + (g + K) N / dp         ... and gradients
        zero_stage 3 (P_os+g+p):   (p + g + K) N / dp           ... and parameters

    Rajbhandari et al. 2020 (ZeRO), Sections 5.1-5.3 and Figure 1, where p = g = 2 and K = 12.
    A shard holds ceil(N / dp) elements (the last rank is padded, as Megatron's distributed
    optimizer does), so the numbers are exact bytes per rank, not averages.

    optimizer: "adam"/"adamw" (the two moments), or "sgd" (plain SGD: no state; a master
    copy still counts if master_weights).

    Returns {"num_parameters", "bytes_per_parameter", "params", "grads", "master_weights",
    "exp_avg", "exp_avg_sq", "optimizer", "total", "zero_stage", "dp"} (bytes per rank).
    Activations come on top: see `activation_memory`.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage} is not 0, 1, 2 or 3")
    if dp < 1:
        raise ValueError(f"dp={dp} must be >= 1")
    if optimizer not in ("adam", "adamw", "sgd"):
        raise ValueError(f"optimizer={optimizer!r} is not 'adam', 'adamw' or 'sgd'")
    param_dtype = config.dtype if param_dtype is None else param_dtype

    per_param = dict(adam_bytes_per_parameter(param_dtype, master_weights, grad_dtype))
    if optimizer == "sgd":
        per_param["exp_avg"] = per_param["exp_avg_sq"] = 0
        per_param["optimizer"] = per_param["master_weights"]
        per_param["total"] = per_param["params"] + per_param["grads"] + per_param["optimizer"]

    n = count_parameters(config)["total"]
    held = zero_held(n, dp, zero_stage)
    result = {
        "num_parameters": n,
        "bytes_per_parameter": per_param,
        "params": held["params"] * per_param["params"],
        "grads": held["grads"] * per_param["grads"],
        "master_weights": held["optimizer"] * per_param["master_weights"],
        "exp_avg": held["optimizer"] * per_param["exp_avg"],
        "exp_avg_sq": held["optimizer"] * per_param["exp_avg_sq"],
    }
    result["optimizer"] = result["master_weights"] + result["exp_avg"] + result["exp_avg_sq"]
    result["total"] = result["params"] + result["grads"] + result["optimizer"]
    result["zero_stage"], result["dp"] = zero_stage, dp
    return result


# ---------------------------------------------------------------------------------------
# measured: what a rank holds (train.py records it after the last step; run_report.py sets
# it beside training_memory and rank_parameters)
# ---------------------------------------------------------------------------------------
def held_parameters(chunks: list[nn.Module]) -> list[nn.Parameter]:
    """This rank's parameters over its chunks, each once (a tied weight is one parameter)."""
    return list({id(p): p for c in chunks for p in c.parameters()}.values())


def local_parameter_counts(chunks: list[nn.Module]) -> dict[str, int]:
    """{"dense", "experts"}: the parameter elements this rank holds (rank_parameters is their formula)."""
    held = held_parameters(chunks)
    return {"dense": sum(p.numel() for p in held if not is_expert_parameter(p)),
            "experts": sum(p.numel() for p in held if is_expert_parameter(p))}


def held_state_bytes(chunks: list[nn.Module], optimizer: Optimizer) -> dict[str, int]:
    """The bytes this rank keeps from step to step: "parameters" (a tied weight once),
    "gradients" (what the data-parallel wrappers hold, their memory_tensors(): DDP's buffers,
    ZeRO-2's and ZeRO-3's shards; with none, the .grad backward gives each parameter, as many
    bytes as the parameter), "main_parameters" (mixed precision: the optimizer's float32
    copies) and "optimizer" (AdamW's two moments; its step counters left out)."""
    params = held_parameters(chunks)
    grads = [t for c in chunks if isinstance(c, DataParallel) for t in c.memory_tensors()["grads"]]
    moments = [t for state in optimizer.state.values() for name, t in state.items() if name in ("exp_avg", "exp_avg_sq")]
    copies = [m for m, seg in zip(optimizer.main_params, optimizer.segments) if m is not seg.param]
    size = lambda tensors: sum(t.nbytes for t in tensors)     # noqa: E731
    return {"parameters": size(params), "gradients": storage_bytes(grads) if grads else size(params),
            "main_parameters": size(copies), "optimizer": size(moments)}


__all__ = ["as_dtype", "bytes_per_element", "adam_bytes_per_parameter", "zero_held", "training_memory",
           "held_parameters", "local_parameter_counts", "held_state_bytes"]
