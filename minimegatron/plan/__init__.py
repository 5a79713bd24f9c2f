"""The parallelism planner (chapter 08): which 5D layouts of a model fit a cluster, and which
should be fastest, from formulas only; `python -m minimegatron.plan --help`.

One concept per file:

  cluster.py           Cluster, CLUSTERS         GPUs per node, memory, peak FLOP/s, bandwidths;
                                                 where a group's ranks sit
  models.py            planner_model, MODELS     Llama 3 8B/70B/405B, Mixtral 8x7B, DeepSeek-V3
                                                 (approximate), analysis.REAL_MODELS, the presets
  megatron_formulas.py megatron_flops,           Megatron-LM's num_floating_point_operations and
                       megatron_theoretical_memory  theoretical memory, re-derived and checked
  rank_memory.py       rank_memory               what one rank of a stage holds (the book's
                                                 analysis: parameters, ZeRO, activations in flight)
  step_time.py         step_estimate             FLOPs, bytes per dimension, exposed communication,
                                                 bubble, step time, MFU
  search.py            search, Layout, Plan      enumerate, reject with the first failing check
                                                 (validate_layout among them), rank
  table.py             format_plan               the printout
  __main__.py          the command line

The planner may import every layer of the library but the training loop; nothing imports it.
"""

from .cluster import CLUSTERS, Cluster
from .megatron_formulas import (megatron_activation_bytes, megatron_flops, megatron_theoretical_memory,
                                megatron_weight_and_optimizer_bytes)
from .models import model_names, planner_model
from .rank_memory import rank_memory
from .search import Layout, Plan, SearchResult, search
from .step_time import step_estimate
from .table import format_plan

__all__ = ["Cluster", "CLUSTERS", "megatron_flops", "megatron_weight_and_optimizer_bytes", "megatron_activation_bytes",
           "megatron_theoretical_memory", "model_names", "planner_model", "rank_memory", "Layout", "Plan",
           "SearchResult", "search", "step_estimate", "format_plan"]
