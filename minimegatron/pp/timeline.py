"""The pipeline bubble: simulated from a schedule with unit costs, and by formula.

p stages, m micro-batches, a forward t_f and a backward t_b per stage (t_f / v and t_b / v per
chunk with v chunks). `simulate` plays every rank's schedule, each op starting when its rank is
free AND its input exists, communication free:

    idle fraction = 1 - busy / makespan,          busy = m (t_f + t_b)
    GPipe, 1F1B:  makespan = (m + p - 1)(t_f + t_b),        idle = (p - 1) / (m + p - 1)
    interleaved:  makespan = (m + (p - 1) / v)(t_f + t_b),  idle = (p - 1) / (v m + p - 1)

Narayanan et al. 2021 state it as bubble over ideal time, (p - 1) / (v m). StepRecord is the
measured side (executor.run_pipeline_step fills it); chapters/03_pp/make_figures.py draws both."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..dp.fsdp import observe_saved_tensors
from .schedules import schedule

__all__ = ["Interval", "simulate", "bubble_fraction", "idle_fraction", "peak_in_flight", "StepRecord"]


@dataclass(frozen=True)
class Interval:
    """One op of one rank: what ("F", "B", or for a real run "send"/"recv wait"), which
    micro-batch and chunk, and when (start, end), in the unit of the costs or in seconds."""
    rank: int
    op: str
    microbatch: int
    chunk: int
    start: float
    end: float


def simulate(kind: str, pp_size: int, num_microbatches: int, num_chunks: int = 1,
             forward_time: float = 1.0, backward_time: float = 2.0) -> list[Interval]:
    """Every rank's F and B intervals when `kind` runs with these unit costs (see the module
    docstring). Raises ValueError if the schedules deadlock (an op waits for one that its
    rank can never reach): a wrong schedule."""
    p, v = pp_size, num_chunks
    ops = [schedule(kind, p, r, num_microbatches, v) for r in range(p)]
    cost = {"F": forward_time / v, "B": backward_time / v}
    done: dict[tuple[str, int, int], float] = {}      # (op, microbatch, virtual stage) -> end
    free, nxt, out = [0.0] * p, [0] * p, []
    last = p * v - 1
    while any(nxt[r] < len(ops[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while nxt[r] < len(ops[r]):
                op, mb, chunk = ops[r][nxt[r]]
                stage = chunk * p + r                  # the virtual stage this op belongs to
                if op == "F":
                    need = ("F", mb, stage - 1) if stage > 0 else None
                else:
                    need = ("B", mb, stage + 1) if stage < last else ("F", mb, stage)
                if need is not None and need not in done:
                    break                              # its input does not exist yet
                start = max(free[r], done[need] if need is not None else 0.0)
                free[r] = done[(op, mb, stage)] = start + cost[op]
                out.append(Interval(r, op, mb, chunk, start, free[r]))
                nxt[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: ops[r][nxt[r]] for r in range(p) if nxt[r] < len(ops[r])}
            raise ValueError(f"the {kind} schedules deadlock: the next ops {stuck} wait for each other")
    return sorted(out, key=lambda i: (i.rank, i.start))


def idle_fraction(intervals: list[Interval], rank: int) -> float:
    """1 - (time rank `rank` computes) / (the pipeline's makespan, first start to last end)."""
    start = min(i.start for i in intervals)
    makespan = max(i.end for i in intervals) - start
    busy = sum(i.end - i.start for i in intervals if i.rank == rank and i.op in ("F", "B"))
    return 1.0 - busy / makespan


def bubble_fraction(kind: str, pp_size: int, num_microbatches: int, num_chunks: int = 1) -> dict[str, float]:
    """The textbook bubble of a schedule, uniform stages, free communication:

      "idle":            idle time / makespan on every rank = (p - 1) / (v m + p - 1)
      "bubble_over_ideal": idle time / compute time       = (p - 1) / (v m)
    with v = num_chunks (1 for "gpipe" and "1f1b"). Same for GPipe and 1F1B.
    """
    # BEGIN EXERCISE 3.3: the bubble formula | hint: write both ratios with one quantity: a rank's idle time in units of one micro-batch's forward + backward; how does cutting each stage into v chunks change it? (Narayanan et al. 2021, section 2.2)
    p, m, v = pp_size, num_microbatches, num_chunks
    if kind != "interleaved" and v != 1:
        raise ValueError(f"num_chunks={v} needs kind 'interleaved'")
    bubble = (p - 1) / v                       # in units of one micro-batch's F + B on one rank
    return {"idle": bubble / (m + bubble), "bubble_over_ideal": bubble / m}
    # END EXERCISE


def peak_in_flight(ops: list[tuple[str, int, int]]) -> int:
    """The most micro-batch-chunks whose forward has run and whose backward has not, over a
    stage's schedule: how many sets of activations the stage holds at its peak (GPipe: m;
    1F1B: at most pp - rank; interleaved: the warm-up count + 1, at most v m)."""
    alive = peak = 0
    for op, _, _ in ops:
        alive += 1 if op == "F" else -1
        peak = max(peak, alive)
    return peak


class StepRecord:
    """What one pipeline step measured on this rank (run_pipeline_step fills it): losses (per
    micro-batch, last stage), intervals (list[Interval] in seconds from t0: "F", "B", "recv wait",
    "send"), t0 (time.perf_counter(), one clock for the machine's processes), the activation
    bytes each (microbatch, chunk) forward saved (parameters' storages `params` excluded), and the
    peak count and bytes of micro-batches alive at once."""

    def __init__(self, rank: int = 0, params: set[int] = frozenset()):
        self.rank, self.params = rank, params
        self.t0 = time.perf_counter()
        self.losses: dict[int, float] = {}
        self.intervals: list[Interval] = []
        self.saved_bytes: dict[tuple[int, int], int] = {}
        self.peak_in_flight = 0
        self.peak_bytes = 0

    @contextmanager
    def span(self, kind: str, microbatch: int, chunk: int):
        start = time.perf_counter() - self.t0
        yield
        self.intervals.append(Interval(self.rank, kind, microbatch, chunk, start, time.perf_counter() - self.t0))

    @contextmanager
    def saving(self, microbatch: int, chunk: int):
        """Count the bytes of the storages the forward inside saves for its backward."""
        storages: dict[int, int] = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.params:
                storages[ptr] = t.untyped_storage().nbytes()
            return t
        # (ZeRO-3's wrapper runs saved-tensor hooks of its own, which shadow this one: it hands
        # the tensors it keeps to observe_saved_tensors' observers instead)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), observe_saved_tensors(pack):
            yield
        self.saved_bytes[(microbatch, chunk)] = sum(storages.values())

    def in_flight(self, held) -> None:
        """`held`: the (microbatch, chunk) keys whose backward has not run yet."""
        self.peak_in_flight = max(self.peak_in_flight, len(held))
        self.peak_bytes = max(self.peak_bytes, sum(self.saved_bytes[k] for k in held))
