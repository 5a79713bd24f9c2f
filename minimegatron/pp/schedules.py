"""Pipeline schedules as pure functions: which forward and backward each stage runs, in order.

A pipeline of pp stages trains one global batch as m micro-batches; per micro-batch a stage
runs a forward F (after the previous stage's) and a backward B (after the next stage's). A
schedule is the ORDER of one stage's F's and B's; sending and waiting follow from it:

    schedule(kind, pp_size, pp_rank, num_microbatches, num_chunks=1)
        -> [("F" or "B", microbatch, chunk), ...]        every (microbatch, chunk) F once, B once

  "gpipe"        all forwards, then all backwards (Megatron's "all-forward-all-backward").
  "1f1b"         pp - rank - 1 warm-up forwards, then one forward one backward, then the rest
                 (forward_backward_pipelining_without_interleaving).
  "interleaved"  num_chunks > 1 chunks per rank, chunk c of rank r is virtual stage c pp + r;
                 1F1B over the virtual stages (forward_backward_pipelining_with_interleaving).

Interleaving needs num_microbatches a multiple of pp (the micro-batch group size is fixed at
pp, Megatron's default microbatch_group_size_per_vp_stage).
Megatron-LM: megatron/core/pipeline_parallel/schedules.py."""

from __future__ import annotations

__all__ = ["KINDS", "schedule", "check_schedule_args", "interleaved_order", "num_warmup_microbatches"]

KINDS = ("gpipe", "1f1b", "interleaved")
Op = tuple[str, int, int]               # ("F" | "B", microbatch, chunk)


def check_schedule_args(kind: str, pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int = 1) -> None:
    """ValueError naming the numbers for an impossible combination (see schedule)."""
    if kind not in KINDS:
        raise ValueError(f"schedule kind {kind!r} is not one of {', '.join(KINDS)}")
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} is not in [0, pp_size={pp_size})")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches} must be at least 1")
    if kind != "interleaved" and num_chunks != 1:
        raise ValueError(f"num_chunks={num_chunks} needs kind 'interleaved' ({kind!r} runs one chunk per rank)")
    if kind == "interleaved":
        if num_chunks < 2:
            raise ValueError(f"the interleaved schedule needs num_chunks >= 2 model chunks per rank, "
                             f"got {num_chunks} (num_chunks=1 is '1f1b')")
        if pp_size < 2:
            raise ValueError(f"the interleaved schedule needs pp_size >= 2, got {pp_size}")
        if num_microbatches % pp_size:
            raise ValueError(f"the interleaved schedule needs num_microbatches={num_microbatches} to be "
                             f"a multiple of pp_size={pp_size} (micro-batches enter in groups of pp)")


def num_warmup_microbatches(kind: str, pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int = 1) -> int:
    """Forwards a stage runs before its first backward (over all its chunks): gpipe m; 1f1b
    min(pp - rank - 1, m); interleaved min(2 (pp - rank - 1) + (v - 1) pp, v m) micro-batch-chunks
    (no special case for m == pp: pp=4, v=2, m=4 warms up 8, 8, 6, 4).
    Megatron: get_pp_rank_microbatches."""
    check_schedule_args(kind, pp_size, pp_rank, num_microbatches, num_chunks)
    if kind == "gpipe":
        return num_microbatches
    if kind == "1f1b":
        return min(pp_size - pp_rank - 1, num_microbatches)
    group_size = pp_size                   # Megatron's default microbatch_group_size_per_vp_stage
    warmup = 2 * (pp_size - pp_rank - 1) + (num_chunks - 1) * group_size
    return min(warmup, num_microbatches * num_chunks)


def interleaved_order(pp_size: int, num_microbatches: int, num_chunks: int) -> list[tuple[int, int]]:
    """The (microbatch, chunk) order of an interleaved stage's forwards, the same on every rank:
    groups of pp micro-batches, chunk 0 of each, then chunk 1, ..., chunk v-1, then the next
    group. Backwards take it with chunk c replaced by v - 1 - c."""
    order = []
    for first in range(0, num_microbatches, pp_size):
        group = range(first, min(first + pp_size, num_microbatches))
        order += [(mb, chunk) for chunk in range(num_chunks) for mb in group]
    return order


def schedule(kind: str, pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int = 1) -> list[Op]:
    """The ordered ops of stage `pp_rank` of `pp_size`: ("F" | "B", microbatch, chunk).

    Every (microbatch, chunk) appears once as "F" and once, later, as "B" (chunk is 0 for
    "gpipe" and "1f1b"). Every kind has one shape: w warm-up forwards, then pairs (the next
    forward, the oldest backward not yet run), then the remaining backwards, where

      w         = num_warmup_microbatches(kind, pp_size, pp_rank, num_microbatches, num_chunks)
      forwards  = [(0, 0), (1, 0), ..., (m - 1, 0)]                            gpipe, 1f1b
                  interleaved_order(pp_size, num_microbatches, num_chunks)     interleaved
      backwards = the forwards' order with chunk c replaced by num_chunks - 1 - c

    The two helpers are this module's (a stub may import and call them):
      num_warmup_microbatches(kind, pp_size, pp_rank, num_microbatches, num_chunks) -> int:
        gpipe m; 1f1b min(pp - rank - 1, m); interleaved min(2 (pp - rank - 1) + (v - 1) pp, v m).
        It checks the arguments first and raises the ValueErrors below.
      interleaved_order(pp_size, num_microbatches, num_chunks) -> [(microbatch, chunk), ...]:
        groups of pp micro-batches, in each group chunk 0 of each micro-batch, then chunk 1, ...;
        pp=2, m=4, v=2: (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1).

    Raises ValueError naming the field and the numbers (schedule("interleaved", 4, 0, 6, 2):
    a message containing "num_microbatches=6" and "pp_size=4") for an unknown kind, a rank
    outside the pipeline, num_microbatches < 1, num_chunks != 1 for gpipe / 1f1b, and for
    "interleaved": num_chunks < 2, pp_size < 2, or num_microbatches not a multiple of pp_size.
    """
    # BEGIN EXERCISE 3.1: the pipeline schedules from the warm-up count | hint: the docstring gives w and both orders; the rest is three phases: forwards before the first backward, then pairs, then the backwards still owed. How long is each phase? (Megatron: forward_backward_pipelining_without_interleaving)
    warmup = num_warmup_microbatches(kind, pp_size, pp_rank, num_microbatches, num_chunks)
    if kind == "interleaved":
        forwards = interleaved_order(pp_size, num_microbatches, num_chunks)
        backwards = [(mb, num_chunks - 1 - chunk) for mb, chunk in forwards]
    else:
        forwards = backwards = [(mb, 0) for mb in range(num_microbatches)]
    ops = [("F", *forwards[k]) for k in range(warmup)]
    steady = len(forwards) - warmup
    for k in range(steady):
        ops += [("F", *forwards[warmup + k]), ("B", *backwards[k])]
    ops += [("B", *backwards[k]) for k in range(steady, len(backwards))]
    return ops
    # END EXERCISE
