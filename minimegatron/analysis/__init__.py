"""Counting before running: parameters, FLOPs and memory of a model, from its config alone.

One concept per file:

  params.py        count_parameters,                   how many weights, component by component;
                   tensor_parallel_parameters          and on one rank of a tensor-parallel group
  flops.py         flops_per_token_6n, training_flops, the 6N rule (Kaplan), our exact matmul
                   narayanan2021_flops_per_iteration   count, and Narayanan et al. 2021's formula
  memory.py        adam_bytes_per_parameter,           parameters, gradients and Adam's state
                   training_memory                     (ZeRO's 2 + 2 + 12 bytes; ZeRO stages)
  activations.py   activation_memory,                  what autograd saves for backward, op by
                   measure_saved_activation_bytes,     op, and its measurement; Korthikanti et
                   korthikanti_activation_memory       al.'s 16-bit formula
  communication.py rank_parameters,                    what one rank of a 5D layout holds, and
                   step_communication                  what one step hands to the collectives of
                                                       each dimension (run_report, make demo)
  report.py        memory_report, does_it_fit          the table, and why one device stops
                                                       being enough (plot_memory_breakdown of
                                                       chapter 00's make_figures.py draws it)

Every formula here is tested against a measurement of the real model (numel of parameters,
FlopCounterMode, torch.optim.AdamW's state, saved_tensors_hooks), never against itself.
"""

from .activations import INDEX_BYTES, activation_memory, korthikanti_activation_memory, measure_saved_activation_bytes
from .communication import (ROUTING_DEPENDENT, fp8_amax_reductions, gradient_element_size, rank_parameters,
                            step_communication)
from .flops import flops_per_token_6n, megatron_mlp_flops, narayanan2021_flops_per_iteration, training_flops
from .memory import adam_bytes_per_parameter, as_dtype, bytes_per_element, training_memory
from .params import count_parameters, tensor_parallel_parameters
from .report import GiB, REAL_MODELS, does_it_fit, format_memory_report, memory_report, real_model_config

__all__ = [
    "ROUTING_DEPENDENT", "rank_parameters", "step_communication", "fp8_amax_reductions", "gradient_element_size",
    "count_parameters", "tensor_parallel_parameters",
    "flops_per_token_6n", "training_flops", "megatron_mlp_flops", "narayanan2021_flops_per_iteration",
    "adam_bytes_per_parameter", "training_memory", "bytes_per_element", "as_dtype",
    "activation_memory", "korthikanti_activation_memory", "measure_saved_activation_bytes", "INDEX_BYTES",
    "memory_report", "format_memory_report", "does_it_fit",
    "real_model_config", "REAL_MODELS", "GiB",
]
