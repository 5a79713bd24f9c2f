"""Pipeline schedules as pure functions: which forward and backward each stage runs, in order.

A pipeline of pp stages (ranks 0..pp-1 of a pipeline group) trains one global batch as m
micro-batches. Each stage runs, per micro-batch, a forward F (after the previous stage's F of
that micro-batch) and a backward B (after the next stage's B). A schedule is the ORDER in which
one stage runs its F's and B's; everything else (sending, waiting) follows from it:

    schedule(kind, pp_size, pp_rank, num_microbatches, num_chunks=1)
        -> [("F" or "B", microbatch, chunk), ...]        every (microbatch, chunk) F once, B once

  "gpipe"        all forwards, then all backwards (GPipe, Huang et al. 2019; Megatron's
                 "all-forward-all-backward"). Every micro-batch's activations are alive at once.
  "1f1b"         warm-up: pp - rank - 1 forwards; steady state: one forward, one backward;
                 cool-down: the remaining backwards (PipeDream-Flush, Narayanan et al. 2021;
                 Megatron's forward_backward_pipelining_without_interleaving). At most
                 pp - rank micro-batches alive on stage `rank`.
  "interleaved"  each rank holds num_chunks > 1 model chunks ("virtual stages"): chunk c of
                 rank r is virtual stage c * pp + r, so a micro-batch visits every rank
                 num_chunks times. 1F1B over the virtual stages, in Megatron's order
                 (forward_backward_pipelining_with_interleaving): see interleaved_order.

Megatron-LM: megatron/core/pipeline_parallel/schedules.py. What the book adds: the orders as
data, so they can be printed, tested and drawn (timeline.simulate) without running anything.
Constraints, as Megatron's with its default micro-batch group size (pp): interleaving needs
num_microbatches to be a multiple of pp. The book fixes the group size at pp; Megatron makes it
a setting (microbatch_group_size_per_vp_stage, --microbatch-group-size-per-virtual-pipeline-stage).
pp = 2 with 2 chunks is allowed, as in Megatron with its default p2p overlap (its
training/arguments.py asks for pp > 2 with interleaving only under --no-overlap-p2p-communication;
checked 2026-11-24).
"""

from __future__ import annotations

__all__ = ["KINDS", "schedule", "check_schedule_args", "interleaved_order", "num_warmup_microbatches"]

KINDS = ("gpipe", "1f1b", "interleaved")
Op = tuple[str, int, int]               # ("F" | "B", microbatch, chunk)


def check_schedule_args(kind: str, pp_size: int, pp_rank: int, num_microbatches: int,
                        num_chunks: int = 1) -> None:
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


def num_warmup_microbatches(kind: str, pp_size: int, pp_rank: int, num_microbatches: int,
                            num_chunks: int = 1) -> int:
    """Forwards a stage runs before its first backward (over all its chunks).

    1f1b:        min(pp - rank - 1, m): the micro-batches in flight ahead of this stage when
                 the first one's backward reaches it.
    interleaved: min(2 (pp - rank - 1) + (v - 1) G, v m), counted in micro-batch-chunks, with
                 G = pp the micro-batch group size (see interleaved_order): before a rank's
                 first backward, the whole first group runs through chunks 0..v-2 ((v - 1) G
                 forwards), and the first micro-batch's last chunk needs about two chunk-sized
                 slots per rank behind this one to go there and come back. When that reaches
                 v m, every forward is warm-up (all forwards, then all backwards). There is no
                 special case for m == pp: with pp=4, v=2, m=4, stages 0 and 1 warm up all 8
                 chunks, stages 2 and 3 only 6 and 4.
    gpipe:       all m.

    Megatron-LM: get_pp_rank_microbatches in megatron/core/pipeline_parallel/schedules.py
    (checked 2026-11-24; its m == pp all-warm-up case was removed in November 2024).
    """
    check_schedule_args(kind, pp_size, pp_rank, num_microbatches, num_chunks)
    if kind == "gpipe":
        return num_microbatches
    if kind == "1f1b":
        return min(pp_size - pp_rank - 1, num_microbatches)
    group_size = pp_size                   # Megatron's default microbatch_group_size_per_vp_stage
    warmup = 2 * (pp_size - pp_rank - 1) + (num_chunks - 1) * group_size
    return min(warmup, num_microbatches * num_chunks)


def interleaved_order(pp_size: int, num_microbatches: int, num_chunks: int) -> list[tuple[int, int]]:
    """The (microbatch, chunk) order of an interleaved stage's forwards (the same on every rank).

    Micro-batches enter in groups of pp: chunk 0 of micro-batches 0..pp-1, then chunk 1 of the
    same micro-batches, ..., chunk v-1; then the next group of pp micro-batches. Backwards take
    the same order with the chunks reversed (chunk v-1 first: the last virtual stage's backward
    comes first). Megatron: the schedule table of forward_backward_pipelining_with_interleaving,
    with its default group size (microbatch_group_size_per_vp_stage = pp).
    """
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
