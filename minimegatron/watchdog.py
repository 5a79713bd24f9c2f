"""What the ranks of a job do about a rank that hangs and a launcher that dies.

A rank that never arrives at a collective leaves the others to gloo's timeout, whose message
names no rank; a killed torchrun leaves its ranks training. Two mechanisms, started on every
rank by launch.init_from_torchrun and launch.spawn:

``die_with_parent()`` (lifeline.py)
    prctl(PR_SET_PDEATHSIG, SIGKILL) on Linux: the kernel kills the rank when its parent dies;
    elsewhere the heartbeat thread checks the parent's pid every second.
``Heartbeat``
    a daemon thread that writes every second, into the job's TCPStore, the time, what the rank
    is doing, where its main thread is, and how many collectives it has issued on each group
    (from comm's records; sends and receives left out). Every member of a group issues the same
    collectives in the same order, so one that has issued fewer has not arrived.
``missing_ranks_report(...)``
    what a rank whose collective timed out says instead: every rank's heartbeat, and the ranks
    the others wait for (`did_not_arrive`); train.train raises it as CollectiveTimeoutError.

Megatron: nvidia-resiliency-ext (--enable-ft-package, megatron/training/ft_integration.py).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import linecache
import os
import signal
import socket
import sys
import threading
import time
from collections import Counter
from datetime import timedelta

import torch.distributed as dist

from .comm import record_communication
from .lifeline import die_with_parent  # noqa: F401 (the parent-death signal; re-exported here, where it lived)

__all__ = ["CollectiveTimeoutError", "die_with_parent", "job_store", "Heartbeat", "start_heartbeat",
           "stop_heartbeat", "set_doing", "is_collective_timeout", "missing_ranks_report", "did_not_arrive"]

HEARTBEAT_INTERVAL = 1.0      # seconds between two heartbeats of a rank
STALE_AFTER = 5.0             # a heartbeat older than this: the rank is frozen or gone


class CollectiveTimeoutError(RuntimeError):
    """A collective timed out; the message names the ranks that did not arrive."""


# ---------------------------------------------------------------------------------------
# the job's store
# ---------------------------------------------------------------------------------------
def job_store(timeout: float = 5.0) -> dist.TCPStore | None:
    """A new client of the job's TCPStore (MASTER_ADDR:MASTER_PORT), or None where none can be
    reached before the process group exists (torchrun's agent hosts it; launch.spawn's parent)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host is None or port is None or not (dist.is_initialized() or
                                            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        return None
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))
    except Exception:                             # noqa: BLE001 - no store: the caller falls back
        return None


def _key(rank: int) -> str:
    return f"minimegatron/heartbeat/{rank}"


# ---------------------------------------------------------------------------------------
# the heartbeat
# ---------------------------------------------------------------------------------------
def main_thread_location() -> tuple[str, bool]:
    """(where the main thread is, "file:line in function" of its innermost frame outside
    torch; whether it is communicating: its innermost frame is in torch.distributed or
    minimegatron.comm, or on a line that waits for a handle, `work.wait()`)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "unknown", False
    innermost, path = frame, frame.f_code.co_filename.replace(os.sep, "/")
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    communicating = "/torch/distributed/" in path or "/minimegatron/comm/" in path or ".wait(" in line
    while frame is not None and "/torch/" in frame.f_code.co_filename.replace(os.sep, "/"):
        frame = frame.f_back
    frame = frame or innermost
    return f"{_shown_path(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}", communicating


def _shown_path(filename: str) -> str:
    """`filename` relative to the directory the job runs in, or to the one holding the
    minimegatron package, when it is under one of them."""
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for root in (os.getcwd(), package_parent):
        if filename.startswith(root.rstrip(os.sep) + os.sep):
            return os.path.relpath(filename, root)
    return filename


class Heartbeat:
    """This rank's heartbeat (the module docstring): a daemon thread publishing `beat()`
    every `interval` seconds under minimegatron/heartbeat/<rank> in `store`."""

    def __init__(self, store: dist.TCPStore, rank: int, interval: float = HEARTBEAT_INTERVAL):
        self.store, self.rank, self.interval = store, rank, interval
        self.doing = "starting"
        self.parent = os.getppid()
        self.counts: Counter[tuple[int, ...]] = Counter()
        self._lock = threading.Lock()
        self._recording = record_communication()          # a ledger that stays open, drained below
        self._ledger = self._recording.__enter__()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="minimegatron-heartbeat", daemon=True)
        self._thread.start()

    def beat(self) -> dict:
        """This rank's heartbeat now. Moves the comm records issued since the last beat into
        the counts per group (list slicing and deletion are atomic in CPython, so records the
        main thread appends meanwhile wait for the next beat)."""
        with self._lock:
            records = self._ledger.records
            new = records[:]                                # a copy, then drop what was copied
            del records[:len(new)]
            self.counts.update(record.group_ranks for record in new if record.op not in ("send", "recv"))
            where, communicating = main_thread_location()
            return {"rank": self.rank, "time": time.time(), "pid": os.getpid(), "host": socket.gethostname(),
                    "doing": self.doing, "where": where, "communicating": communicating,
                    "counts": [[list(g), n] for g, n in self.counts.items()]}

    def _run(self) -> None:
        while True:
            if os.getppid() != self.parent:            # the launcher died (where prctl is missing)
                os.kill(os.getpid(), signal.SIGKILL)
            with contextlib.suppress(Exception):       # the store is gone: the job is ending
                self.store.set(_key(self.rank), json.dumps(self.beat()))
            if self._stop.wait(self.interval):
                return

    def stop(self) -> None:
        """End the thread (before the interpreter shuts down: a thread that wakes up in a
        finalizing interpreter aborts the process, see launch.finish_torchrun) and close the
        ledger."""
        self._stop.set()
        self._thread.join(timeout=10.0)
        self._recording.__exit__(None, None, None)


_heartbeat: Heartbeat | None = None


def start_heartbeat(interval: float = HEARTBEAT_INTERVAL) -> Heartbeat | None:
    """Start this process's heartbeat once the default process group exists (a no-op when it
    runs already, in a world of one rank, or without a store to write to)."""
    global _heartbeat
    if _heartbeat is not None or not dist.is_initialized() or dist.get_world_size() == 1:
        return _heartbeat
    store = job_store()
    if store is not None:
        _heartbeat = Heartbeat(store, dist.get_rank(), interval)
        atexit.register(stop_heartbeat)       # a rank that ends without finish_torchrun stops it too
    return _heartbeat


def stop_heartbeat() -> None:
    """Stop this process's heartbeat, if any (launch.finish_torchrun and spawn's ranks do)."""
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop()
        _heartbeat = None


def set_doing(text: str) -> None:
    """What this rank is doing, for its heartbeat (train: "iteration 3", "saving iteration 4")."""
    if _heartbeat is not None:
        _heartbeat.doing = text


# ---------------------------------------------------------------------------------------
# who did not arrive
# ---------------------------------------------------------------------------------------
def is_collective_timeout(exc: BaseException) -> bool:
    """Is `exc` a collective that gave up waiting (gloo: "Timed out waiting 10000ms for recv
    operation to complete"; a barrier or a store: "timed out", "Timeout")?"""
    return isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in ("timed out", "timeout"))


def did_not_arrive(beats: dict[int, dict], now: float) -> tuple[list[int], dict[int, list[str]]]:
    """The ranks the others wait for, from every rank's heartbeat, and why, per rank. A rank is behind
    on a group when another member has issued more collectives on it; waiting when it has issued
    more than a member somewhere, or its main thread is in a collective or a wait. Named: ranks
    behind and not waiting, and ranks whose heartbeat is older than STALE_AFTER or missing."""
    counts = {r: {tuple(g): n for g, n in b["counts"]} for r, b in beats.items()}
    why: dict[int, list[str]] = {}
    ahead = set()
    for r, mine in counts.items():
        for group, n in mine.items():
            for other in group:
                theirs = counts.get(other, {}).get(group)
                if other != r and theirs is not None and theirs < n:
                    ahead.add(r)
                    why.setdefault(other, []).append(
                        f"issued {theirs} collectives on group {list(group)}, rank {r} issued {n} and waits there")
    named = sorted(r for r in why if r not in ahead and not beats[r]["communicating"])
    for r, b in beats.items():
        if now - b["time"] > STALE_AFTER:
            why.setdefault(r, []).insert(0, f"no heartbeat for {now - b['time']:.0f} s (frozen or gone)")
            named.append(r)
    return sorted(set(named)), why


def missing_ranks_report(exc: BaseException, store: dist.TCPStore | None = None) -> str:
    """The message for a collective timeout `exc` on this rank: which ranks did not arrive
    (did_not_arrive), then one line per rank: heartbeat age, what it was doing, where its main
    thread is. Falls back to `exc`'s own message where no heartbeat can be read."""
    world, me = dist.get_world_size(), dist.get_rank()
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if first_line.startswith("[") and "] " in first_line:      # gloo's "[.../unbound_buffer.cc:78] Timed out ..."
        first_line = first_line.split("] ", 1)[1]
    head = f"rank {me}: a collective timed out ({first_line[:200]})"
    store = store or job_store()
    if store is None:
        return head + "; no heartbeats to tell which rank did not arrive (no job store)"
    beats: dict[int, dict] = {}
    for r in range(world):
        if r == me and _heartbeat is not None:                 # it waited: that is why we are here
            beats[r] = _heartbeat.beat() | {"communicating": True}
            continue
        with contextlib.suppress(Exception):                   # no heartbeat read: leave that rank out
            if store.check([_key(r)]):
                beats[r] = json.loads(store.get(_key(r)))
    now = time.time()
    named, why = did_not_arrive(beats, now)
    named = sorted(set(named) | {r for r in range(world) if r not in beats})      # and the silent ones
    verdict = (", ".join(f"rank {r}" for r in named) + " did not arrive" if named else
               "every rank that reports a heartbeat has arrived (the hang is in a call the book does not count)")
    lines = [f"{head}: {verdict}"]
    for r in named:
        for reason in why.get(r, ["sends no heartbeat (never started one, or gone)"]):
            lines.append(f"  rank {r} {reason}")
    lines.append("every rank (heartbeat age, what it was doing, where its main thread is):")
    for r in range(world):
        b = beats.get(r)
        if b is None:
            lines.append(f"  rank {r}: no heartbeat")
            continue
        state = ("waiting in the collective that timed out (this rank)" if r == me else
                 f"{'communicating' if b['communicating'] else 'not communicating'} at {b['where']}")
        lines.append(f"  rank {r}: {now - b['time']:.1f} s ago, {b['doing']}, {state} (pid {b['pid']} on {b['host']})")
    return "\n".join(lines)
