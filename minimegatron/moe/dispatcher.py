"""Token dispatchers: how each token reaches the ranks that hold its experts, and comes back.

Shapes as in model/moe.py (T tokens on this rank, E experts, k per token, h hidden), plus ep,
etp, E_l = E / ep experts per rank (rank r holds r E_l .. (r+1) E_l - 1), N this rank's routed
(token, expert) pairs, R the pairs it receives.

AllToAllDispatcher (Megatron's MoEAlltoAllTokenDispatcher), forward:
  1. counts        all-to-all of the per-expert counts [E] -> [ep, E_l] (tag "moe-counts")
  2. permute       each token once per chosen expert, sorted by expert: [N, h]
  3. dispatch      all-to-all of the rows, uneven splits -> [R, h], [source][local expert]
                   (tag "moe-dispatch")
  4. (etp > 1)     all-gather of the rows over "etp": [etp R, h] (tag "moe-etp")
  5. sort chunks   to [local expert][source] (sort_chunks_by_expert)
  6. experts       model/moe.experts_on_sorted_tokens
  then in reverse: unsort, (etp > 1: reduce-scatter over "etp"), the reverse all-to-all (tag
  "moe-combine"), unpermute weighted by the probabilities. Backward: the same exchanges
  reversed (tags + "-bwd").

AllGatherDispatcher (MoEAllGatherTokenDispatcher): all-gather tokens, weights and routing map
over "etp-ep" ([ep etp T, h]), run the local experts, reduce-scatter the outputs back to T
rows (tag "moe-allgather"): (ep etp - 1) T h per rank each way.

Megatron-LM: megatron/core/transformer/moe/token_dispatcher.py, moe_utils.py. The book
exchanges counts by all-to-all over ep (+ all-gather over etp) and weights each expert's
output on its token's rank (chapter 05 says how Megatron differs)."""

from __future__ import annotations

import torch
from torch import nn

from ..comm import (all_gather, all_to_all_single, all_to_all_uneven_region, gather_uneven_region, group_size,
                    reduce_scatter_uneven_region)
from ..model.moe import experts_grouped, experts_loop, experts_on_sorted_tokens

__all__ = ["permute", "unpermute", "sort_chunks_by_expert", "unsort_chunks_by_expert", "AllToAllDispatcher",
           "AllGatherDispatcher"]


def permute(tokens: torch.Tensor, routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [T, h], routing_map [T, E] -> (rows [N, h]: token t once per chosen expert, sorted by
    expert then token; token index [N]; expert index [N]) (Megatron's permute)."""
    expert, token = routing_map.t().nonzero(as_tuple=True)                    # [N] each, expert-major
    return tokens[token], token, expert


def unpermute(rows: torch.Tensor, token: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The inverse of permute, with the routing weights: out[t] = sum of weights[i] rows[i] over
    the rows i of token t. rows [N, h], token and weights [N] -> [num_tokens, h]."""
    out = rows.new_zeros(num_tokens, rows.shape[-1])
    return out.index_add(0, token, rows * weights.unsqueeze(-1).to(rows.dtype))


def sort_chunks_by_expert(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Re-sort received rows from [source][local expert] to [local expert][source].

    rows [R, h] arrive as S x E_l chunks in source-major order: chunk (s, j) holds counts[s, j]
    rows, the rows source s sent to local expert j. Return the same rows with the chunks in
    expert-major order (0, 0), (1, 0), ..., (S-1, 0), (0, 1), ...: each local expert's rows
    contiguous, in source order inside. counts: an int tensor [S, E_l], R = counts.sum(); any
    count may be 0 (an empty chunk; even R = 0). The result stays in the autograd graph (the
    rows' gradient flows back through it). The inverse, unsort_chunks_by_expert, is given."""
    # BEGIN EXERCISE 5.3: the all-to-all chunk re-sort | hint: each chunk is a run of consecutive rows as long as its count; the answer holds the same chunks in another order: in which order does the spec list the (source, expert) pairs? (Megatron: sort_chunks_by_idxs)
    sources, local_experts = counts.shape
    chunks = rows.split(counts.flatten().tolist())
    return torch.cat([chunks[s * local_experts + j] for j in range(local_experts) for s in range(sources)])
    # END EXERCISE


def unsort_chunks_by_expert(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The inverse of sort_chunks_by_expert: rows in [local expert][source] order back to
    [source][local expert]. counts [S, E_l] as there (indexed by source, expert)."""
    sources, local_experts = counts.shape
    chunks = rows.split(counts.t().flatten().tolist())                       # chunk (j, s) at j * S + s
    return torch.cat([chunks[j * sources + s] for s in range(sources) for j in range(local_experts)])


class AllToAllDispatcher:
    """The all-to-all dispatcher for one MoE layer's experts over ep_group, each cut over etp_group.
    As MoELayer.token_dispatcher: (tokens [T, h], probs [T, E], routing_map [T, E], local experts
    {global index: MLP}, grouped) -> [T, h], each token's weighted sum of its experts' outputs."""

    def __init__(self, num_experts: int, ep_group, etp_group):
        self.num_experts, self.ep_group, self.etp_group = num_experts, ep_group, etp_group
        self.ep, self.etp = group_size(ep_group), group_size(etp_group)
        self.local = num_experts // self.ep                                    # E_l

    def exchange_counts(self, routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(this rank's pairs per expert [E]; pairs received per ep source and local expert [ep, E_l]; the
        same per source after the etp gather [S, E_l], S = etp ep, etp rank i's sources in rows
        i ep .. (i+1) ep - 1). One all-to-all of E numbers over ep, and with etp > 1 an all-gather of
        ep E_l numbers over etp (tag "moe-counts")."""
        per_expert = routing_map.sum(0)                                        # [E]
        received = torch.empty_like(per_expert)                                 # [ep E_l], source-major
        all_to_all_single(received, per_expert, self.ep_group, tag="moe-counts")
        received = received.view(self.ep, self.local)                           # [ep, E_l]
        every_source = all_gather(received, self.etp_group, dim=0, tag="moe-counts")   # [etp ep, E_l]
        return per_expert, received, every_source

    def __call__(self, tokens, probs, routing_map, experts: dict[int, nn.Module], grouped: bool = False):
        per_expert, received, every_source = self.exchange_counts(routing_map)
        rows, token, expert = permute(tokens, routing_map)                     # [N, h], N = sum(per_expert)
        send = per_expert.view(self.ep, self.local).sum(1).tolist()           # rows to each ep rank
        recv = received.sum(1).tolist()                                        # rows from each ep rank
        x = all_to_all_uneven_region(rows, self.ep_group, send, recv, tag="moe-dispatch")        # [R, h]
        if self.etp > 1:
            etp_sizes = every_source.view(self.etp, -1).sum(1).tolist()          # R of each etp rank
            x = gather_uneven_region(x, self.etp_group, etp_sizes, tag="moe-etp")                # [etp R, h]
        x = sort_chunks_by_expert(x, every_source)                             # [local expert][source]
        y = experts_on_sorted_tokens(x, every_source.sum(0).tolist(), list(experts.values()), grouped)
        y = unsort_chunks_by_expert(y, every_source)                           # [source][local expert]
        if self.etp > 1:
            y = reduce_scatter_uneven_region(y, self.etp_group, etp_sizes, tag="moe-etp")        # [R, h]
        y = all_to_all_uneven_region(y, self.ep_group, recv, send, tag="moe-combine")            # [N, h]
        return unpermute(y, token, probs[token, expert], tokens.shape[0])      # [T, h]


class AllGatherDispatcher:
    """The all-gather dispatcher over etp_ep_group (every slice of every expert). Called as AllToAllDispatcher."""

    def __init__(self, etp_ep_group):
        self.group = etp_ep_group

    def __call__(self, tokens, probs, routing_map, experts: dict[int, nn.Module], grouped: bool = False):
        n = group_size(self.group)
        sizes = [tokens.shape[0]] * n
        all_tokens = gather_uneven_region(tokens, self.group, sizes, tag="moe-allgather")       # [n T, h]
        all_probs = gather_uneven_region(probs, self.group, sizes, tag="moe-allgather")         # [n T, E]
        all_map = all_gather(routing_map.to(torch.uint8), self.group, dim=0, tag="moe-allgather").bool()
        y = (experts_grouped if grouped else experts_loop)(all_tokens, all_probs, all_map, experts)   # [n T, h]
        return reduce_scatter_uneven_region(y, self.group, sizes, tag="moe-allgather")          # [T, h]
