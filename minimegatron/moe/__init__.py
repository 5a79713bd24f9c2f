"""Chapter 05: mixture of experts, expert parallelism and expert-data parallelism.

The single-device GPT-MoE is part of the one model: minimegatron/model/moe.py (MoELayer:
router, experts in a loop and grouped, shared expert, auxiliary losses) and
minimegatron/model/router.py (the routing functions). This package spreads the experts over
ranks. Read in this order:

  router.py            the routing functions where the book's contract names them
                       (docs/ARCHITECTURE.md, "Contracts")
  dispatcher.py        the token dispatchers: all-to-all (permute, exchange counts, exchange
                       rows, re-sort by expert, and back) and all-gather
  expert_parallel.py   apply_expert_parallel (experts over ep, cut over etp, marked
                       allreduce=False), the expert-bias update, the checks of a layout
"""

from .dispatcher import permute, sort_chunks_by_expert, unpermute, unsort_chunks_by_expert
from .expert_parallel import (apply_expert_parallel, check_expert_parallel_config, is_expert_parameter, moe_layers,
                              update_expert_bias)
from .router import apply_token_dropping, aux_loss, expert_bias_update, expert_capacity, topk_routing, z_loss

__all__ = ["topk_routing", "aux_loss", "z_loss", "expert_capacity", "apply_token_dropping", "expert_bias_update",
           "permute", "unpermute", "sort_chunks_by_expert", "unsort_chunks_by_expert", "apply_expert_parallel",
           "check_expert_parallel_config", "moe_layers", "update_expert_bias", "is_expert_parameter"]
