"""Chapter 05: mixture of experts (in progress, issue 13).

The single-device GPT-MoE is part of the one model: minimegatron/model/moe.py (MoELayer:
router, experts in a loop and grouped, shared expert, auxiliary losses) and
minimegatron/model/router.py (the routing functions). This package will hold what spreads the
experts over ranks (expert parallelism, the token dispatchers, the expert-data-parallel
gradients: not written yet).

  router.py     the routing functions where DESIGN.md's contract names them
"""

from .router import (SCORE_FUNCTIONS, apply_token_dropping, aux_loss, expert_bias_update, expert_capacity,
                     topk_routing, z_loss)

__all__ = ["SCORE_FUNCTIONS", "topk_routing", "aux_loss", "z_loss", "expert_capacity", "apply_token_dropping",
           "expert_bias_update"]
