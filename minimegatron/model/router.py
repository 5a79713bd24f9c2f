"""The router of a mixture of experts: which experts each token goes to, with which weight.

T tokens (b s of one micro-batch, flattened), E experts, k = topk. The router is a linear
layer h -> E; everything here is a pure function of its logits [T, E]:

    topk_routing(logits, k)          -> probs [T, E] (zero off the k chosen experts),
                                        routing_map [T, E] (bool, k True per token)
    aux_loss(logits, routing_map, k, coeff)   the load-balancing loss (Switch / GShard form)
    sequence_aux_loss(..., batch_size)         the same per sequence, averaged (DeepSeek)
    z_loss(logits, coeff)                      the router z-loss (ST-MoE)
    apply_token_dropping(probs, routing_map, k, capacity_factor, ...)   expert capacity
    expert_bias_update(tokens_per_expert, bias, rate)   DeepSeek-V3's aux-loss-free balancing

Scores and weights in float32 for 16-bit logits, else the logits' dtype.
Megatron-Core: megatron/core/transformer/moe/moe_utils.py (same semantics, main d98e8a6)."""

from __future__ import annotations

import math

import torch

from .linear import compute_dtype

__all__ = ["SCORE_FUNCTIONS", "topk_routing", "aux_loss", "sequence_aux_loss", "z_loss", "expert_capacity", "apply_token_dropping",
           "expert_bias_update"]

SCORE_FUNCTIONS = ("softmax", "sigmoid")


def _compute(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(compute_dtype(logits))


def _topk(scores: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None):
    """(values, indices) [T, k] of the k best scores, limited to the group_topk best groups."""
    if not group_topk:
        return scores.topk(topk, dim=-1)
    tokens, experts = scores.shape
    if experts % num_groups or topk % group_topk:
        raise ValueError(f"group-limited routing needs num_experts={experts} divisible by num_groups={num_groups} "
                         f"and topk={topk} divisible by group_topk={group_topk}")
    per_group = scores.view(tokens, num_groups, experts // num_groups)           # [T, groups, E/groups]
    group_scores = per_group.topk(topk // group_topk, dim=-1).values.sum(-1)     # [T, groups]
    chosen = group_scores.topk(group_topk, dim=-1).indices                       # [T, group_topk]
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
    allowed = allowed.unsqueeze(-1).expand_as(per_group).reshape(tokens, experts)  # [T, E]
    return scores.masked_fill(~allowed, float("-inf")).topk(topk, dim=-1)


def topk_routing(logits: torch.Tensor, topk: int, *, score_function: str = "softmax", pre_softmax: bool = False,
                 expert_bias: torch.Tensor | None = None, scaling_factor: float | None = None,
                 num_groups: int | None = None, group_topk: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (probs [T, E], routing_map [T, E] bool): each token's `topk` experts and
    their weights (Megatron-Core's topk_routing_with_score_function).

    score_function="softmax" (default): the k largest logits of a token are chosen, and its
        weights are the softmax over those k logits only (they sum to 1). pre_softmax=True: the
        softmax runs over all E logits first, the k largest probabilities are chosen and kept as
        they are (they sum to less than 1).
    score_function="sigmoid": scores = sigmoid(logits); with expert_bias [E] the choice is made
        on scores + bias, the weights are the scores without it; with k > 1 the chosen weights
        are divided by their sum.
    num_groups, group_topk: group-limited routing, applied to the scores the choice is made on
        (the logits, or the probabilities with pre_softmax): the experts form num_groups equal
        groups, a group's score is the sum of its k / group_topk best scores, and only experts of
        the group_topk best groups may be chosen (`_topk` does this).
    scaling_factor multiplies the weights. For 16-bit logits everything is computed in float32
    (`x`), else in the logits' dtype.

    probs is zero outside the chosen experts (differentiable with respect to the logits);
    routing_map holds exactly `topk` True per token. ValueError for a score function other than
    softmax and sigmoid, an expert_bias with softmax, or topk outside [1, E]."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    experts = logits.shape[1]
    if not 1 <= topk <= experts:
        raise ValueError(f"topk={topk} must be in [1, num_experts={experts}]")
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function={score_function!r} is not one of {', '.join(SCORE_FUNCTIONS)}")
    if expert_bias is not None and score_function != "sigmoid":
        raise ValueError("expert_bias is used with score_function='sigmoid' (as in Megatron-Core)")
    x = _compute(logits)
    if score_function == "sigmoid":
        scores = torch.sigmoid(x)                                                          # [T, E]
        if expert_bias is not None:      # the bias decides the choice, not the weights
            chosen = _topk(scores + expert_bias.to(scores.dtype), topk, num_groups, group_topk).indices
            weights = scores.gather(1, chosen)
        else:
            weights, chosen = _topk(scores, topk, num_groups, group_topk)
        if topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    # BEGIN EXERCISE 5.1: top-k routing, the softmax before or after the choice | hint: the two placements differ in what the choice is made on (logits or probabilities) and in how many values the softmax normalises; group limits act on what the choice is made on (Megatron: topk_routing_with_score_function)
    if score_function == "softmax":
        if pre_softmax:
            weights, chosen = _topk(torch.softmax(x, dim=-1), topk, num_groups, group_topk)   # [T, k]
        else:
            top_logits, chosen = _topk(x, topk, num_groups, group_topk)
            weights = torch.softmax(top_logits, dim=-1)                                    # [T, k]
    # END EXERCISE
    if scaling_factor is not None:
        weights = weights * scaling_factor
    probs = torch.zeros_like(x).scatter(1, chosen, weights)                               # [T, E]
    routing_map = torch.zeros_like(x, dtype=torch.bool).scatter(1, chosen, True)
    return probs, routing_map


def _scores_for_aux_loss(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """P of the load-balancing losses: the scores over all experts [T, E] (softmax; for sigmoid,
    the sigmoid scores normalised per token)."""
    x = _compute(logits)
    if score_function == "softmax":
        return torch.softmax(x, dim=-1)
    if score_function == "sigmoid":
        scores = torch.sigmoid(x)
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    raise ValueError(f"score_function={score_function!r} is not one of {', '.join(SCORE_FUNCTIONS)}")


def aux_loss(logits: torch.Tensor, routing_map: torch.Tensor, topk: int, coeff: float, *,
             score_function: str = "softmax", tokens_per_expert: torch.Tensor | None = None,
             num_tokens: int | None = None) -> torch.Tensor:
    """The load-balancing loss of Switch Transformer / GShard as Megatron-Core computes it:

        loss = coeff * E / (k T^2) * sum_i (sum_t P[t, i]) * c_i

    with P the router's scores over ALL experts (softmax of the logits; for sigmoid, the sigmoid
    scores normalised per token), c_i the number of tokens routed to expert i
    (routing_map.sum(0)) and T the number of tokens. With f_i = c_i / (k T) the fraction of the
    routed copies that go to expert i and p_i = mean_t P[t, i], loss = coeff * E * sum_i f_i p_i:
    coeff when either is uniform, and, where the routing follows the scores (f = p), coeff * E *
    sum_i p_i^2 >= coeff, smallest at uniform load. A scalar, differentiable through P only (the
    counts are integers).

    Over several ranks (sequence, context or data parallel) pass the counts and token number of
    the whole set the loss is defined over (`tokens_per_expert`, `num_tokens`: summed over
    those ranks); P is always this rank's tokens. Summing the per-rank losses then gives the loss
    of the whole set (Megatron reduces the counts over the tensor x context parallel group)."""
    scores = _scores_for_aux_loss(logits, score_function)                                # [T, E]
    # BEGIN EXERCISE 5.2: the load-balancing loss | hint: which factor carries the gradient and which is an integer count, and whose counts and token number enter when the whole set's are given? (Megatron: switch_load_balancing_loss_func)
    counts = routing_map.sum(dim=0).to(scores.dtype) if tokens_per_expert is None else tokens_per_expert.to(scores.dtype)
    tokens = logits.shape[0] if num_tokens is None else num_tokens
    experts = logits.shape[1]
    return (scores.sum(dim=0) * counts).sum() * (coeff * experts / (topk * tokens * tokens))
    # END EXERCISE


def sequence_aux_loss(logits: torch.Tensor, routing_map: torch.Tensor, topk: int, coeff: float, batch_size: int, *,
                      score_function: str = "softmax", tokens_per_expert: torch.Tensor | None = None,
                      seq_length: int | None = None) -> torch.Tensor:
    """The per-sequence load-balancing loss (Megatron's "seq_aux_loss", DeepSeek-V2/V3): `aux_loss`
    over each sequence's tokens, averaged over the b sequences:

        loss = 1/b sum_j coeff * E / (k S^2) * sum_i (sum_{t in j} P[t, i]) * c_{j,i}

    logits [b s, E], b-major (as MoELayer flattens). Under sp/cp pass `tokens_per_expert` [b, E] and
    `seq_length` summed over the ranks, as for aux_loss."""
    scores = _scores_for_aux_loss(logits, score_function)                                # [b s, E]
    experts = logits.shape[1]
    per_sequence = scores.view(batch_size, -1, experts).sum(dim=1)                     # [b, E]
    counts = (routing_map.view(batch_size, -1, experts).sum(dim=1) if tokens_per_expert is None
              else tokens_per_expert).to(scores.dtype)                                 # [b, E]
    length = logits.shape[0] // batch_size if seq_length is None else seq_length
    return (per_sequence * counts).sum() * (coeff * experts / (topk * length * length * batch_size))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: coeff * mean over tokens of logsumexp(logits)^2. A differentiable scalar."""
    return torch.logsumexp(_compute(logits), dim=-1).square().mean() * coeff


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(T k / E * capacity_factor) (Megatron's get_capacity). ValueError for a
    capacity_factor that is not a positive finite number."""
    if not 0 < capacity_factor < math.inf:
        raise ValueError(f"capacity_factor={capacity_factor} must be a positive, finite number")
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def apply_token_dropping(probs: torch.Tensor, routing_map: torch.Tensor, topk: int, capacity_factor: float,
                         drop_policy: str = "probs", pad_to_capacity: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert capacity: each expert keeps at most `expert_capacity` of its routed tokens (the others
    get weight 0 there). drop_policy "probs": the largest weights; "position": the first in token
    order. pad_to_capacity: every expert gets exactly `capacity` slots (weight-0 fillers; the map
    is the slots). Returns (probs, routing_map), [T, E] each."""
    tokens, experts = probs.shape
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"drop_policy={drop_policy!r} is not 'probs' or 'position'")
    capacity = expert_capacity(tokens, experts, topk, capacity_factor)
    if capacity >= tokens:
        slots = torch.ones_like(routing_map)
    else:
        routed = routing_map.to(probs.dtype)
        if drop_policy == "probs":                 # routed tokens first, the largest weights first
            priority = probs.detach() + routed
        else:                                      # routed tokens first, the earliest first
            priority = routed * (tokens - torch.arange(tokens, device=probs.device, dtype=probs.dtype)).unsqueeze(1)
        slots = torch.zeros_like(routing_map).scatter(0, priority.topk(capacity, dim=0).indices, True)   # [T, E]
    kept = routing_map & slots
    return probs * kept, (slots if pad_to_capacity else kept)


@torch.no_grad()
def expert_bias_update(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free balancing: bias + rate * sign(mean - count). tokens_per_expert:
    the step's counts summed over every rank sharing the router (Megatron: tp x dp x cp)."""
    counts = tokens_per_expert.to(expert_bias.dtype)
    return expert_bias + rate * torch.sign(counts.mean() - counts)
