"""When did each bucket's collective run, relative to backward? One `BucketTimeline` per step
(DistributedDataParallel, and ZeRO-1 with overlap_grad_reduce), for the last micro-batch's
backward; chapters/01_dp/make_figures.py draws it (plot_bucket_timeline).

Times are time.perf_counter() seconds after that backward started, in the rank's own process:

  backward start   0: the tensor hook on the model's output (the first thing backward computes)
  backward end     the last parameter gradient accumulated into its bucket
  launched         the bucket's async collective handed to gloo
  completed        a callback on the work's future, run in gloo's thread (an upper bound: it
                   waits for the GIL); without a future (gloo's reduce-scatter), when the wait
                   returned
  waited           how long finish_grad_sync() blocked in work.wait(): the unhidden communication
  sync start/end   when finish_grad_sync() was entered and returned

On a 2-core laptop the ranks share the cores: the timeline shows the schedule, not a speed-up.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class BucketEvent:
    """One bucket's all-reduce in one step (times in seconds after backward start)."""
    bucket: int                       # index in DistributedDataParallel.buckets
    numel: int                        # elements all-reduced
    nbytes: int                       # bytes handed to the all-reduce (the ledger's count)
    launched: float
    completed: float | None = None    # from the work's future callback (see module docstring)
    wait_start: float | None = None   # when finish_grad_sync began waiting for it
    waited: float = 0.0               # seconds blocked in wait() inside finish_grad_sync


@dataclass
class BucketTimeline:
    """The communication schedule of one step's syncing backward (see the module docstring)."""
    overlap: bool
    backward_end: float
    sync_start: float
    sync_end: float
    buckets: list[BucketEvent] = field(default_factory=list)   # in launch order

    def launched_during_backward(self) -> list[int]:
        """Indices of the buckets whose all-reduce started before backward ended."""
        return [e.bucket for e in self.buckets if e.launched < self.backward_end]

    def table(self) -> str:
        """A text table: one row per bucket, times in milliseconds."""
        ms = lambda t: "   -   " if t is None else f"{1e3 * t:7.2f}"   # noqa: E731
        lines = [f"backward 0.00 .. {ms(self.backward_end).strip()} ms; finish_grad_sync "
                 f"{ms(self.sync_start).strip()} .. {ms(self.sync_end).strip()} ms "
                 f"({'overlapped' if self.overlap else 'not overlapped'})",
                 f"{'bucket':>6}{'elements':>10}{'bytes':>10}{'launched':>10}{'completed':>11}{'waited':>9}"]
        for e in self.buckets:
            lines.append(f"{e.bucket:>6}{e.numel:>10,}{e.nbytes:>10,}{ms(e.launched):>10}"
                         f"{ms(e.completed):>11}{ms(e.waited):>9}")
        return "\n".join(lines)

    __str__ = table


class TimelineRecorder:
    """The clock of a BucketTimeline: DistributedDataParallel calls it at the moments the module
    docstring names and it keeps the times (time.perf_counter() seconds, shifted so that backward
    starts at 0), so ddp.py holds none."""

    def __init__(self, overlap: bool):
        self.overlap = overlap
        self._backward_start: float | None = None
        self._last_grad = self._sync_start = 0.0
        self._events: dict[int, BucketEvent] = {}
        self._stamps: dict[int, object] = {}          # bucket -> its completion callback's future

    def backward_started(self) -> None:
        self._backward_start = time.perf_counter()

    def grad_arrived(self) -> None:
        self._last_grad = time.perf_counter()

    def launched(self, bucket: int, work, data: torch.Tensor) -> None:
        """A bucket's asynchronous collective `work` of `data` was just handed to the backend."""
        event = self._events[bucket] = BucketEvent(bucket, data.numel(), data.nbytes, time.perf_counter())
        if hasattr(work, "get_future"):
            def completed(future):                     # runs in gloo's thread when it is done
                event.completed = time.perf_counter()
                return future.value()
            try:
                self._stamps[bucket] = work.get_future().then(completed)
            except RuntimeError:                       # gloo's reduce-scatter has no future:
                event.completed = float("nan")         # stamped when waited (below)
        else:                                          # a one-rank group: nothing was sent
            event.completed = event.launched

    def sync_started(self) -> None:
        self._sync_start = time.perf_counter()

    @contextmanager
    def waiting(self, bucket: int):
        """Around finish_grad_sync's wait for `bucket`: the time the step was blocked."""
        event = self._events[bucket]
        event.wait_start = time.perf_counter()
        yield
        event.waited = time.perf_counter() - event.wait_start
        stamp = self._stamps.pop(bucket, None)
        if stamp is not None:
            stamp.wait()                               # the completion time has been written
        elif event.completed != event.completed:       # (nan) no future: when the wait returned
            event.completed = time.perf_counter()

    def finish(self) -> BucketTimeline:
        """This step's timeline, in seconds after the syncing backward started."""
        end = time.perf_counter()
        events = sorted(self._events.values(), key=lambda e: e.launched)
        t0 = self._backward_start if self._backward_start is not None else events[0].launched
        shifted = [BucketEvent(e.bucket, e.numel, e.nbytes, e.launched - t0,
                               None if e.completed is None else e.completed - t0,
                               e.wait_start - t0, e.waited) for e in events]
        self._events.clear()
        return BucketTimeline(self.overlap, self._last_grad - t0, self._sync_start - t0, end - t0, shifted)
