"""What a grader's outcome means, for the graders' pytest plugin (tests/graders/conftest.py).

A grader is a pytest test marked `@pytest.mark.exercise("0.1")`. Its outcome is one of

  pass   it passed;
  todo   it failed because the stub of its own exercise raised NotImplementedError("exercise
         0.1"): the learner has not written that body yet;
  fail   it failed for any other reason (a wrong answer, a crash);
  skip   it was skipped.

In the inverted mode (MINIMEGATRON_IMPL=stub, CI) the only acceptable outcome is `todo`: it
proves that the grader does run the learner's code, and that it fails on the unfilled stub
because of the stub and not by accident.

"Because of the stub" means: the exception, or one it was raised from (its __cause__ /
__context__ chain, or the members of an exception group), is a NotImplementedError whose
message names the exercise ("exercise 0.1", not "exercise 0.10"), or any exception whose
message carries a rank's traceback line "NotImplementedError: exercise 0.1" (how
`minimegatron.launch.spawn` reports a failed rank).

A failing exercise's line in the summary carries the difference its first failing grader
found: the first line of that failure's message (`first_difference`), which is why a grader
puts what differs, and by how much, on the first line of its assertion message.
"""

from __future__ import annotations

import re
from typing import Iterable

PASS, TODO, FAIL, SKIP = "pass", "todo", "fail", "skip"
DIFFERENCE_CHARS = 140          # a summary line stays readable on a terminal


def one_line(exc: BaseException) -> str:
    """`Type: the first line of its message`; an AssertionError is the grader's own words and
    reads without its type (pytest's rewritten asserts append their explanation below it)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if isinstance(exc, AssertionError):
        return first or "assertion failed"
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def first_difference(exc: BaseException, limit: int = DIFFERENCE_CHARS) -> str:
    """What a failing exercise's summary line says: one_line(exc), cut to `limit` characters."""
    text = one_line(exc)
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def _names(exercise_id: str) -> re.Pattern[str]:
    return re.compile(rf"\bexercise {re.escape(exercise_id)}(?![.\d])")


def _chain(exc: BaseException) -> Iterable[BaseException]:
    seen, stack = set(), [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack.extend([e.__cause__, e.__context__])
        stack.extend(getattr(e, "exceptions", ()))   # BaseExceptionGroup


def raised_by_stub(exc: BaseException, exercise_id: str) -> bool:
    """True if `exc` comes from the unfilled stub of exercise `exercise_id` (see module doc)."""
    names = _names(exercise_id)
    rank_line = re.compile(rf"NotImplementedError: exercise {re.escape(exercise_id)}(?![.\d])")
    for e in _chain(exc):
        text = str(e)
        if isinstance(e, NotImplementedError) and names.search(text):
            return True
        if rank_line.search(text):
            return True
    return False


def outcome(passed: bool, skipped: bool, exc: BaseException | None, exercise_id: str) -> str:
    """The grader outcome (PASS, TODO, FAIL, SKIP) of one test phase."""
    if skipped:
        return SKIP
    if passed:
        return PASS
    return TODO if exc is not None and raised_by_stub(exc, exercise_id) else FAIL


def exercise_verdict(outcomes: list[str], impl: str, difference: str | None = None) -> str:
    """One exercise's line in the summary, from the outcomes of its graders; `difference`, the
    first_difference of its first failing grader, follows a FAIL."""
    n = len(outcomes)
    count = {k: outcomes.count(k) for k in (PASS, TODO, FAIL, SKIP)}
    if impl == "stub":
        if count[TODO] == n:
            return f"proved: all {n} grader(s) fail on the stub, because of the stub"
        if count[SKIP] == n:
            return "skipped"
        bad = n - count[TODO] - count[SKIP]
        return f"NOT PROVED: {bad} of {n} grader(s) did not fail because of the stub"
    if count[FAIL]:
        return f"FAIL ({count[FAIL]} of {n} graders failed)" + (f": {difference}" if difference else "")
    if count[TODO]:
        return ("todo (not started: the stub still raises NotImplementedError)" if count[TODO] == n
                else f"todo ({count[TODO]} of {n} graders reach the unfilled stub)")
    if count[SKIP] == n:
        return "skipped"
    return "pass" + (f" ({count[SKIP]} skipped)" if count[SKIP] else "")
