"""Several exercises graded in one spawned world, each failure charged to its own exercise.

Starting ranks costs seconds, so a chapter's distributed graders share one world: every rank
runs each exercise's checks in turn, with that exercise's function plugged in, and returns
plain data that the graders compare with their oracles in the parent.

    # in the rank (tests/workers/sp_cp.py)
    def grade_world(..., plan):
        checks = {"4.3": lambda: ..., "4.1": lambda: ...}
        return run_checks(checks, plan)

    # in the grader (tests/graders/test_ch04_sp_cp.py)
    @pytest.fixture(scope="module")
    def world(graded_exercises):
        return SharedWorld(lambda plan: spawn(W.grade_world, 4, ..., plan), ["4.3", "4.1"],
                           graded_exercises)

    def test_...(world):
        per_rank = world.data("4.3")      # the ranks' data, or AssertionError naming 4.3's failure

Sharing a world must never let one exercise's failure show up as another's. Three rules:

1. Only the exercises being graded run (`graded`: `make grade EX=4.4` runs 4.4's checks only).
2. After each exercise, the ranks compare how it ended. If some failed and others did not, or
   they failed differently, the ranks may have stopped at different collectives, and the next
   exercise's collectives could pair with the leftovers. So the world stops there; the
   exercises it did not run start again in a fresh world. (Ranks that all failed the same
   way, such as every rank hitting an unfilled stub, stopped at the same point: the world
   goes on.)
3. If the whole world dies (a rank crashes, exits or hangs past the timeout), each rank's note
   of the exercise it was running names the one that killed it: that exercise gets the error,
   and the others are graded again in a fresh world without it.

An exercise's failure reads, on its first line, what went wrong and where:

    exercise 4.3: RuntimeError: The size of tensor a (8) must match ... (ranks 0, 1, 2, 3)

followed by the last frames of the first failing rank's traceback.
"""

from __future__ import annotations

import tempfile
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable

from .grading import one_line

TRACEBACK_FRAMES = 8          # the frames kept of a rank's traceback: the learner's code is near the end
AGREEMENT_TIMEOUT = timedelta(minutes=30)   # longer than any collective a stuck rank waits out


@dataclass(frozen=True)
class Plan:
    """What one spawned world runs: the exercises (a subset of the world's checks), and the folder
    where each rank notes the exercise it is running (rank<r>.txt; empty between exercises)."""

    exercises: tuple[str, ...]
    notes: str | None = None


def _note(plan: Plan, rank: int, exercise_id: str) -> None:
    if plan.notes is not None:
        Path(plan.notes, f"rank{rank}.txt").write_text(exercise_id)


def run_checks(checks: dict[str, Callable[[], Any]], plan: Plan) -> dict[str, dict]:
    """Inside every rank of the world: each planned exercise's check, in the order of `checks`,
    with that exercise's function plugged in (booktools.exercises.plug), then the ranks' agreement
    on how it ended (rule 2 of the module doc). Returns {id: {"ran": bool, "error": the rank's
    traceback or None, "summary": one_line of the error or None, "data": what the check
    returned, "stopped_by": the exercise after which the world stopped, or None}}."""
    import torch
    import torch.distributed as dist

    from .adapter import plug

    unknown = sorted(set(plan.exercises) - set(checks))
    if unknown:
        raise ValueError(f"plan names exercise(s) {unknown} that this world has no checks for "
                         f"(it has {sorted(checks)})")
    # Short tensor reprs in the messages a check raises (a learner reads them in the summary).
    torch.set_printoptions(threshold=16, edgeitems=2, precision=4)
    rank = dist.get_rank()
    # The agreement gets a group of its own: a rank left waiting in an exercise's collective must
    # not pair its next call with the agreement's.
    agreement = dist.new_group(timeout=AGREEMENT_TIMEOUT)
    out: dict[str, dict] = {}
    stopped_by = None
    for eid, check in checks.items():
        if eid not in plan.exercises:
            continue
        if stopped_by is not None:
            out[eid] = {"ran": False, "error": None, "summary": None, "data": None, "stopped_by": stopped_by}
            continue
        _note(plan, rank, eid)
        try:
            with plug(eid):
                out[eid] = {"ran": True, "error": None, "summary": None, "data": check(), "stopped_by": None}
        except Exception as exc:
            tb = "".join(traceback.format_exception(exc, limit=-TRACEBACK_FRAMES))
            out[eid] = {"ran": True, "error": tb, "summary": one_line(exc), "data": None, "stopped_by": None}
        _note(plan, rank, "")
        endings = [None] * dist.get_world_size()
        dist.all_gather_object(endings, out[eid]["summary"], group=agreement)
        if any(endings) and len(set(endings)) > 1:
            stopped_by = eid
    return out


def _rank_failures(eid: str, entries: list[dict]) -> str:
    """One exercise's failure on some ranks: the first line says what and where."""
    failed = [(r, e) for r, e in enumerate(entries) if e["error"] is not None]
    first_rank, first = failed[0]
    same = [r for r, e in failed if e["summary"] == first["summary"]]
    lines = [f"exercise {eid}: {first['summary']} (rank{'s' if len(same) > 1 else ''} "
             f"{', '.join(map(str, same))} of {len(entries)})"]
    lines += [f"  rank {r}: {e['summary']}" for r, e in failed if r not in same]
    lines += ["", f"--- traceback of rank {first_rank} (its last {TRACEBACK_FRAMES} frames) ---",
              first["error"].rstrip()]
    return "\n".join(lines)


class SharedWorld:
    """The results of the exercises graded in one spawned world (more when one exercise's failure
    stopped it: see the module doc). `start(plan)` spawns the world and returns its ranks'
    run_checks results; `exercises` are the world's exercises in the order of its checks;
    `graded` the exercises this session grades (None: all of them)."""

    def __init__(self, start: Callable[[Plan], list[dict]], exercises: Iterable[str],
                 graded: Iterable[str] | None = None):
        wanted = None if graded is None else set(graded)
        self.exercises = tuple(e for e in exercises if wanted is None or e in wanted)
        self.worlds = 0                                  # how many worlds it took
        self._data: dict[str, list[dict]] = {}           # id -> every rank's entry
        self._failed: dict[str, str] = {}                # id -> why the world died in its checks
        pending = list(self.exercises)
        while pending:
            self.worlds += 1
            with tempfile.TemporaryDirectory(prefix="grading-world-") as notes:
                try:
                    per_rank = start(Plan(tuple(pending), notes))
                except Exception as exc:
                    pending = self._world_died(exc, pending, Path(notes))
                    continue
            for eid in pending:
                entries = [ranks[eid] for ranks in per_rank]
                if all(e["ran"] for e in entries):
                    self._data[eid] = entries
            pending = [e for e in pending if e not in self._data]

    def _world_died(self, exc: Exception, pending: list[str], notes: Path) -> list[str]:
        """Charge a dead world to the exercise(s) its ranks were running; the rest go again."""
        running = {p.read_text() for p in notes.glob("rank*.txt")} - {""}
        culprits = [e for e in pending if e in running]
        where = "while running its checks"
        if not culprits:           # it died at start-up or sending the results: no exercise to blame
            culprits, where = pending, "outside the exercises' checks (start-up or sending the results)"
        for eid in culprits:
            self._failed[eid] = f"exercise {eid}: the spawned world stopped {where}: {one_line(exc)}\n\n{exc}"
        return [e for e in pending if e not in culprits]

    def data(self, exercise_id: str) -> list:
        """Every rank's data for the exercise, or AssertionError saying how its checks failed."""
        if exercise_id in self._failed:
            raise AssertionError(self._failed[exercise_id])
        if exercise_id not in self._data:
            raise KeyError(f"exercise {exercise_id} was not graded in this world (it grades "
                           f"{', '.join(self.exercises) or 'nothing'})")
        entries = self._data[exercise_id]
        if any(e["error"] is not None for e in entries):
            raise AssertionError(_rank_failures(exercise_id, entries))
        return [e["data"] for e in entries]

    def __repr__(self) -> str:     # pytest may print a fixture's value: never another exercise's data
        return f"<SharedWorld: exercises {', '.join(self.exercises)} in {self.worlds} spawned world(s)>"
