"""Which tokens a context-parallel rank holds: the contiguous split and the zig-zag split.

Shape legend as in model/gpt.py, plus cp (the context-parallel size) and c = s / (2 cp), the
length of one chunk (a rank holds two chunks, 2 c = s / cp tokens). Context parallelism cuts every sequence of a micro-batch into cp parts;
each rank of the "cp" group runs the whole model on its part (tokens, labels and positions),
and only attention looks at the other parts (cp/attention.py).

A causal mask makes the plain cut unfair. Cut s into cp contiguous parts: rank r's queries see
the keys of ranks 0..r, so rank cp-1 computes about 2 cp - 1 times as many unmasked scores as
rank 0, and in a ring every step waits for the busiest rank. The zig-zag cut (Megatron-LM's
`get_batch_on_this_cp_rank`, Transformer Engine's ring attention) pairs a cheap chunk with an
expensive one: the sequence is cut into 2 cp chunks of c tokens and rank r keeps chunk r and
chunk 2 cp - 1 - r, so every rank does the same work (`causal_work_per_rank` counts it).

    s = 16, cp = 2, chunks of c = 4:   [ 0  1  2  3 | 4  5  6  7 | 8  9 10 11 | 12 13 14 15 ]
    contiguous:  rank 0 -> chunks 0, 1     rank 1 -> chunks 2, 3
    zig-zag:     rank 0 -> chunks 0, 3     rank 1 -> chunks 1, 2

Both layouts are described by the two chunk indices a rank holds (`cp_chunk_ids`); the ring
(cp/ring.py) decides from chunk indices alone which block pairs it computes, so it runs
either layout unchanged.
"""

from __future__ import annotations

import torch

__all__ = ["cp_chunk_ids", "zigzag_positions", "contiguous_positions", "positions_on_rank",
           "get_batch_on_this_cp_rank", "causal_work_per_rank", "check_context_parallel_seq_length"]


def check_context_parallel_seq_length(seq_length: int, cp_size: int) -> None:
    """ValueError naming the numbers unless the sequence cuts into 2 cp equal chunks (both
    layouts use chunks of s / (2 cp) tokens, so every block of the ring has the same shape)."""
    if cp_size < 1:
        raise ValueError(f"cp_size={cp_size} must be at least 1")
    if seq_length % (2 * cp_size):
        raise ValueError(f"seq_length={seq_length} is not divisible by 2 x context_parallel_size = 2 x {cp_size}"
                         f" = {2 * cp_size}: context parallelism cuts every sequence into 2 cp equal chunks")


def cp_chunk_ids(cp_size: int, cp_rank: int, load_balance: bool = True) -> list[int]:
    """The two chunks (of 2 cp) rank `cp_rank` holds, in the order it stores them: zig-zag
    [r, 2 cp - 1 - r] when `load_balance`, else contiguous [2 r, 2 r + 1]."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is not in [0, cp_size={cp_size})")
    return [cp_rank, 2 * cp_size - 1 - cp_rank] if load_balance else [2 * cp_rank, 2 * cp_rank + 1]


def positions_on_rank(seq_len: int, cp_size: int, cp_rank: int, load_balance: bool = True) -> list[int]:
    """The token positions rank `cp_rank` holds, in its storage order: zigzag_positions, or
    the contiguous cut without load_balance."""
    if load_balance:
        return zigzag_positions(seq_len, cp_size, cp_rank)
    check_context_parallel_seq_length(seq_len, cp_size)
    c = seq_len // (2 * cp_size)
    return [i * c + j for i in cp_chunk_ids(cp_size, cp_rank, load_balance) for j in range(c)]


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int) -> list[int]:
    """The positions a context-parallel rank keeps under load balancing: the sequence cut into
    2 cp chunks, rank r keeping chunk r and then chunk 2 cp - 1 - r (s / cp positions).
    ValueError, naming seq_len and 2 cp, when seq_len is not divisible by 2 cp (the check
    check_context_parallel_seq_length makes).

    Example: zigzag_positions(8, 2, 0) == [0, 1, 6, 7]; zigzag_positions(8, 2, 1) == [2, 3, 4, 5].
    """
    # BEGIN EXERCISE 4.2: the zig-zag positions | hint: 2 cp equal chunks; rank r pairs an early chunk (little causal work) with its mirror from the end (much): which chunk mirrors r? Refuse a length that does not cut evenly (Megatron: get_batch_on_this_cp_rank)
    check_context_parallel_seq_length(seq_len, cp_size)
    c = seq_len // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return list(range(first * c, (first + 1) * c)) + list(range(second * c, (second + 1) * c))
    # END EXERCISE


def contiguous_positions(seq_len: int, cp_size: int, cp_rank: int) -> list[int]:
    """Positions [r s / cp, (r + 1) s / cp): the plain cut, for the comparison."""
    return positions_on_rank(seq_len, cp_size, cp_rank, load_balance=False)


def get_batch_on_this_cp_rank(batch: dict[str, torch.Tensor], cp_size: int, cp_rank: int,
                              load_balance: bool = True) -> dict[str, torch.Tensor]:
    """This rank's part of a micro-batch {"tokens": [b, s], "labels": [b, s]}: both cut along
    the sequence to [b, s/cp], plus "position_ids" [s/cp] (the positions kept, so that the
    position embedding or RoPE sees each token's true position). The identity at cp = 1
    (position_ids added). A micro-batch's other [b, s] tensors (chapter 07's packed documents:
    given position_ids [b, s], the loss mask) are cut the same way, but for document_ids, which
    stay whole: a rank's attention masks the keys of every rank by their documents
    (ContextParallelAttention); with a loss_mask, "loss_tokens" is added: the tokens the mask
    keeps in the whole micro-batch over cp_size, model.mean_loss's denominator (each rank keeps
    a different number, and the average over the cp ranks must be the micro-batch's mean). Megatron-LM: megatron/core/utils.py get_batch_on_this_cp_rank
    (its THD format cuts packed sequences with cu_seqlens instead, through Transformer Engine).
    """
    s = batch["tokens"].shape[1]
    kept = range(s) if cp_size == 1 else positions_on_rank(s, cp_size, cp_rank, load_balance)   # cp 1: any s
    positions = torch.tensor(kept, dtype=torch.long, device=batch["tokens"].device)          # [s/cp]
    out = {key: value.index_select(1, positions) if value.dim() == 2 and key != "document_ids" else value
           for key, value in batch.items()}
    if "loss_mask" in batch and cp_size > 1:       # the whole micro-batch's kept tokens, over cp (mean_loss)
        out["loss_tokens"] = batch["loss_mask"].sum() / cp_size
    out.setdefault("position_ids", positions)
    return out


def causal_work_per_rank(seq_len: int, cp_size: int, load_balance: bool) -> list[int]:
    """Unmasked (query, key) score entries each rank computes for one head and one sequence
    under a causal mask: query at position i sees keys 0..i, so i + 1 entries. The sum over
    ranks is s (s + 1) / 2 for either layout; the maximum is what a step waits for."""
    return [sum(p + 1 for p in positions_on_rank(seq_len, cp_size, r, load_balance)) for r in range(cp_size)]
