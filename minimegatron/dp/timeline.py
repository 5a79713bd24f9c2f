"""When did each bucket's all-reduce run, relative to backward? The record (plot_bucket_timeline
in chapters/01_dp/make_figures.py draws it).

`DistributedDataParallel` (ddp.py), and ZeRO-1 with overlap_grad_reduce (zero.py), fill one
`BucketTimeline` per optimizer step, for the
backward of the last micro-batch (the one that communicates). All times are seconds after
that backward started, measured with `time.perf_counter()` in the rank's own process:

  backward start   0 by definition: when autograd produced the gradient of the model's
                   output (a tensor hook on the output, the first thing backward computes);
  backward end     when the last parameter gradient was accumulated into its bucket (the
                   moment the last bucket becomes ready);
  launched         when the bucket's asynchronous all-reduce was handed to gloo;
  completed        when gloo finished it: a callback chained on the work's future
                   (`work.get_future().then(...)`) runs in gloo's own thread as soon as the
                   collective completes. It is a wall-clock time, an upper bound: the callback
                   is Python, so it waits for the interpreter lock if the training thread
                   holds it. Where the work has no future (gloo's reduce-scatter, ZeRO's): when
                   the wait for it returned, a coarser upper bound (the step learns only then);
  waited           how long `finish_grad_sync()` blocked in `work.wait()` for this bucket: the
                   communication that was *not* hidden behind computation;
  sync start/end   when `finish_grad_sync()` was entered and returned.

With overlap, every bucket but the last is launched before backward ends: its communication
runs while autograd computes the gradients of earlier layers. Without overlap, all launches
come after backward ends, inside `finish_grad_sync()`. On a 2-core laptop the ranks share the
cores, so "overlap" here shows the *schedule* (what is launched when), not a speed-up; the
benchmark under benchmarks/ reports the measured speed honestly.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field


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

    def exposed_seconds(self) -> float:
        """Time finish_grad_sync spent waiting: the communication not hidden by backward."""
        return sum(e.waited for e in self.buckets)

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
    """The clock of a BucketTimeline. DistributedDataParallel calls it at the moments the
    module docstring names (backward started, a gradient arrived, a bucket launched, waiting
    for a bucket, the sync started and ended); it keeps the times, so the algorithm in
    ddp.py holds none. time.perf_counter(), seconds; the finished timeline is shifted so that
    backward starts at 0."""

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

    def launched(self, bucket: int, work, numel: int, nbytes: int) -> None:
        """A bucket's asynchronous all-reduce `work` was just handed to the backend."""
        event = self._events[bucket] = BucketEvent(bucket, numel, nbytes, time.perf_counter())
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
