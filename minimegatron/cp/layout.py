"""Which tokens a context-parallel rank holds: the contiguous split and the zig-zag split.

Context parallelism cuts every sequence into 2 cp chunks of c = s / (2 cp) tokens; each rank
of the "cp" group holds two (s / cp tokens) and runs the whole model on them, only attention
looking further (cp/attention.py). Under a causal mask the contiguous cut leaves rank cp-1
about 2 cp - 1 times rank 0's work; the zig-zag cut pairs chunk r with chunk 2 cp - 1 - r so
every rank does the same (`causal_work_per_rank`):

    s = 16, cp = 2, chunks of c = 4:   [ 0  1  2  3 | 4  5  6  7 | 8  9 10 11 | 12 13 14 15 ]
    contiguous:  rank 0 -> chunks 0, 1     rank 1 -> chunks 2, 3
    zig-zag:     rank 0 -> chunks 0, 3     rank 1 -> chunks 1, 2

A rank's layout is its two chunk indices (`cp_chunk_ids`); the ring works from them alone."""

from __future__ import annotations

import torch

__all__ = ["cp_chunk_ids", "zigzag_positions", "contiguous_positions", "positions_on_rank",
           "get_batch_on_this_cp_rank", "causal_work_per_rank", "check_context_parallel_seq_length"]


def check_context_parallel_seq_length(seq_length: int, cp_size: int) -> None:
    """ValueError naming the numbers unless the sequence cuts into 2 cp equal chunks."""
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
    """This rank's part of a micro-batch {"tokens", "labels": [b, s]} -> [b, s/cp] each, plus
    "position_ids" [s/cp] (the positions kept); the identity at cp = 1 (position_ids added).
    Other [b, s] tensors (given position_ids, loss_mask) are cut alike; document_ids stay whole
    (attention masks every rank's keys by them). With a loss_mask, "loss_tokens": the whole
    micro-batch's kept tokens over cp, model.mean_loss's denominator.
    Megatron-LM: megatron/core/utils.py, get_batch_on_this_cp_rank."""
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
    """Unmasked (query, key) scores each rank computes for one head and sequence (query i sees i + 1
    keys); they sum to s (s + 1) / 2 for either layout; the maximum is what a step waits for."""
    return [sum(p + 1 for p in positions_on_rank(seq_len, cp_size, r, load_balance)) for r in range(cp_size)]
