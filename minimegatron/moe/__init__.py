"""Chapter 05: mixture of experts (in progress: the router is here; the expert layer, the token
dispatchers and expert parallelism come next, issue 13).

  router.py     top-k routing with Megatron-Core's semantics, the load-balancing loss, the
                z-loss, expert capacity with token dropping, the expert-bias update
"""

from .router import (SCORE_FUNCTIONS, apply_token_dropping, aux_loss, expert_bias_update, expert_capacity,
                     topk_routing, z_loss)

__all__ = ["SCORE_FUNCTIONS", "topk_routing", "aux_loss", "z_loss", "expert_capacity", "apply_token_dropping",
           "expert_bias_update"]
