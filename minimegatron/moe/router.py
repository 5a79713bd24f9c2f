"""The router's functions, where the book's contract names them: minimegatron.moe.router
(docs/ARCHITECTURE.md, "Contracts").

They live in minimegatron/model/router.py: the single-device GPT-MoE (model/moe.py) routes
with them, and the model may not import a later chapter's package (tests/test_imports.py).
"""

from ..model.router import (SCORE_FUNCTIONS, apply_token_dropping, aux_loss, expert_bias_update, expert_capacity,
                            sequence_aux_loss, topk_routing, z_loss)

__all__ = ["SCORE_FUNCTIONS", "topk_routing", "aux_loss", "sequence_aux_loss", "z_loss", "expert_capacity",
           "apply_token_dropping", "expert_bias_update"]
