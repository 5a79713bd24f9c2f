"""The ledger: what every collective call records, and how to read it (see comm/__init__.py)."""

from __future__ import annotations

import threading
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

# ======================================================================================
# The ledger
# ======================================================================================


# Groups are named by their global ranks in every record.

class _Alone:
    """The group of this process alone (comm.ALONE): size 1 whatever torch.distributed holds, so
    every collective over it is a no-op. A single-device reference built inside a distributed
    run (parallel_state.Layout.alone()) passes it where None would mean the whole world."""

    def __repr__(self) -> str:
        return "comm.ALONE"


ALONE = _Alone()


def group_ranks(group) -> tuple[int, ...]:
    """Global ranks of ``group`` (None = world), in group order; (0,) without a process group."""
    if not dist.is_initialized() or group is ALONE:
        return (dist.get_rank() if dist.is_initialized() else 0,)
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() and group is not ALONE else 1


def group_rank(group) -> int:
    """This rank's index inside ``group`` (what decides which shard it keeps)."""
    return dist.get_rank(group) if dist.is_initialized() and group is not ALONE else 0


@dataclass(frozen=True)
class CommRecord:
    """One collective call as seen by this rank (see the module docstring for ``nbytes``)."""
    op: str                       # "all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                  # "all_to_all", "send", "recv", "barrier"
    group_ranks: tuple[int, ...]  # global ranks of the group, in group order
    nbytes: int
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    tag: str | None = None        # a label for reading the ledger ("fwd", "bwd", "grads", ...)

    @property
    def group_size(self) -> int:
        return len(self.group_ranks)


def ring_traffic(record: CommRecord) -> float:
    """Bytes one rank sends when ``record``'s op runs as a textbook ring over n ranks.

    all_reduce 2(n-1)/n * nbytes (reduce-scatter then all-gather); all_gather (n-1) * nbytes
    (nbytes is the shard); reduce_scatter and all_to_all (n-1)/n * nbytes (nbytes is the
    full input); broadcast (n-1)/n * nbytes (a pipelined chain: n-1 of the n ranks forward
    the tensor, averaged over ranks); send nbytes; recv and barrier 0.
    """
    n, b = record.group_size, record.nbytes
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1,
              "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n,
              "broadcast": (n - 1) / n, "send": 1, "recv": 0, "barrier": 0}
    return factor[record.op] * b


class Ledger:
    """The records of one ``record_communication()`` block, in call order, with summaries.

    Filters: ``op`` (a name), ``group`` (a ProcessGroup or a sequence of global ranks;
    ``None`` = any group) and ``tag``.
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self):
        return iter(list(self.records))

    def select(self, op=None, group=None, tag=None) -> list[CommRecord]:
        ranks = None if group is None else tuple(group) if isinstance(group, Sequence) else group_ranks(group)
        return [r for r in self.records
                if (op is None or r.op == op) and (ranks is None or r.group_ranks == ranks)
                and (tag is None or r.tag == tag)]

    def total_bytes(self, op=None, group=None, tag=None) -> int:
        return sum(r.nbytes for r in self.select(op, group, tag))

    def count(self, op=None, group=None, tag=None) -> int:
        return len(self.select(op, group, tag))

    def ring_bytes(self, op=None, group=None, tag=None) -> float:
        return sum(ring_traffic(r) for r in self.select(op, group, tag))

    def table(self) -> str:
        """One row per (op, group, tag): calls, bytes handed in, ring bytes sent per rank."""
        rows: dict[tuple, list] = defaultdict(lambda: [0, 0, 0.0])
        for r in self.records:
            row = rows[(r.op, r.group_ranks, r.tag or "")]
            row[0] += 1
            row[1] += r.nbytes
            row[2] += ring_traffic(r)
        head = f"{'op':<15}{'group':<18}{'tag':<8}{'calls':>6}{'bytes':>14}{'ring bytes':>14}"
        lines = [head, "-" * len(head)]
        for (op, ranks, tag), (c, b, rb) in rows.items():
            group = str(list(ranks)) if len(ranks) <= 6 else f"[{ranks[0]}..{ranks[-1]}]({len(ranks)})"
            lines.append(f"{op:<15}{group:<18}{tag:<8}{c:>6}{b:>14,}{rb:>14,.0f}")
        lines.append("-" * len(head))
        lines.append(f"{'total':<41}{len(self):>6}{self.total_bytes():>14,}{self.ring_bytes():>14,.0f}")
        return "\n".join(lines)

    __str__ = table


_active: list[Ledger] = []
_lock = threading.Lock()  # async work and hooks may record from other threads


@contextmanager
def record_communication():
    """``with record_communication() as ledger:`` records every call issued in the block.

    Blocks nest: a call is recorded in every ledger that is open at that moment.
    """
    ledger = Ledger()
    with _lock:
        _active.append(ledger)
    try:
        yield ledger
    finally:
        with _lock:
            _active.remove(ledger)


_retag = threading.local()      # this thread's tag override (retagged), or none


@contextmanager
def retagged(prefix: str):
    """``with retagged("recompute"):`` every call this thread issues in the block is recorded
    with its call site's tag after ``prefix`` ("recompute fwd", "recompute moe-dispatch"; the
    prefix alone for an untagged call). Chapter 07: the collectives a recomputed forward runs
    again are read apart from the first forward's. Other threads keep their tags."""
    outer = getattr(_retag, "tag", None)
    _retag.tag = prefix
    try:
        yield
    finally:
        _retag.tag = outer


def append_record(rec: CommRecord) -> None:
    """Write one record into every open ledger (called by the collectives)."""
    if not _active:
        return
    if getattr(_retag, "tag", None) is not None:
        rec = CommRecord(rec.op, rec.group_ranks, rec.nbytes, rec.dtype, rec.shape,
                         f"{_retag.tag} {rec.tag}" if rec.tag else _retag.tag)
    with _lock:
        for ledger in _active:
            ledger.records.append(rec)
