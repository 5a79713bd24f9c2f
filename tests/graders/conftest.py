"""The graders' pytest plugin: choose what is graded, check the graders, report per exercise.

Every test in tests/graders/ is a grader: marked `@pytest.mark.exercise("<id>")`, exactly
once, with an id that exists in the reference code. It reaches the graded code only through
`booktools.exercises.implementation(id)` / `plug(id)`.

Options (the Makefile's grade targets use them):

  --impl reference|learner|stub   what to grade (sets MINIMEGATRON_IMPL, which spawned ranks
                                  inherit); default: the environment, else reference
  --chapter 00                    only this chapter's graders
  --exercise 0.1                  only this exercise's graders (repeatable)
  --check-coverage                fail unless every selected exercise has a grader (CI)

With --impl stub the outcomes are inverted: a grader passes only if it failed because of
its own exercise's unfilled stub (NotImplementedError("exercise <id>"), also from inside a
spawned rank); a grader that passes on the stub, or fails for any other reason, fails, with
an explanation. At the end a table gives each exercise's verdict, a FAIL with the first
difference its graders found.

Quiet by default: short tracebacks (--tb=short unless you ask for another style: the long
style would print a shared world fixture's value, every exercise's data in it) and short
tensor reprs. A shared world grades only the exercises selected (the `graded_exercises`
fixture; booktools/exercises/world.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import minimegatron  # noqa: F401  first: on a CPU, TRITON_INTERPRET=1 before a stub imports triton

from booktools.exercises import (IMPL_ENV, IMPLEMENTATIONS, CatalogError, MarkerError, current_impl,
                                    default_catalog)
from booktools.exercises.grading import FAIL, PASS, SKIP, TODO, exercise_verdict, first_difference, outcome

GRADERS_DIR = Path(__file__).resolve().parent
# The graders' spawn targets live in tests/workers/ (`from workers import dp_zero`): put tests/
# on sys.path, as pytest does for the test files directly in tests/ (spawned ranks inherit it).
if str(GRADERS_DIR.parent) not in sys.path:
    sys.path.insert(0, str(GRADERS_DIR.parent))
_RESULTS = pytest.StashKey[dict]()      # nodeid -> (exercise id, outcome, first difference or None)
_PROVED_IN_SETUP = pytest.StashKey[bool]()

_WHAT = {"reference": "the book's reference code (minimegatron/)",
         "learner": "your code (chapters/*/exercises/)",
         "stub": "the unfilled stubs, inverted: each grader must fail because of its stub"}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("minimegatron exercises")
    group.addoption("--impl", choices=IMPLEMENTATIONS, default=None,
                    help=f"what to grade (default: ${IMPL_ENV}, else reference)")
    group.addoption("--chapter", default=None, help="grade only this chapter, e.g. 00")
    group.addoption("--exercise", action="append", default=[],
                    help="grade only this exercise, e.g. 0.1 (repeatable, or comma-separated)")
    group.addoption("--check-coverage", action="store_true",
                    help="fail unless every selected exercise has a grader")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "exercise(id): the exercise this grader grades, e.g. '0.1'")
    impl = config.getoption("impl", default=None)
    if impl:
        os.environ[IMPL_ENV] = impl       # before any rank is spawned: they inherit it
    current_impl()                         # a bad value fails now, with its name
    config.stash[_RESULTS] = {}
    if config.getoption("tbstyle", default="auto") == "auto":
        config.option.tbstyle = "short"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Short tensor reprs in assertion messages (the graders imported torch while collected)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_printoptions(threshold=16, edgeitems=2, precision=4)


def _is_grader(item: pytest.Item) -> bool:
    return Path(item.path).resolve().is_relative_to(GRADERS_DIR)


def _exercise_id(item: pytest.Item) -> str | None:
    marks = list(item.iter_markers("exercise"))
    if len(marks) == 1 and len(marks[0].args) == 1 and isinstance(marks[0].args[0], str):
        return marks[0].args[0]
    return None


def _selected_ids(config: pytest.Config, known: dict) -> set[str]:
    chapter = config.getoption("chapter", default=None)
    wanted = {e.strip() for opt in config.getoption("exercise", default=[]) for e in opt.split(",") if e.strip()}
    unknown = sorted(wanted - set(known))
    if unknown:
        raise pytest.UsageError(f"--exercise {', '.join(unknown)}: no such exercise "
                                f"(known: {', '.join(known) or 'none'})")
    ids = set(known)
    if chapter is not None:
        head = str(chapter).split("_", 1)[0]
        if not head.isdigit():
            raise pytest.UsageError(f"--chapter {chapter!r}: expected a chapter number such as 00")
        ids = {i for i in ids if known[i].chapter == int(head)}
        if not ids:
            raise pytest.UsageError(f"chapter {chapter} has no exercises (known: {', '.join(known)})")
    if wanted:
        ids &= wanted
    return ids


@pytest.hookimpl(tryfirst=True)        # before -k/-m deselect anything: coverage sees all
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    graders = [item for item in items if _is_grader(item)]
    if not graders:
        return
    try:
        known = default_catalog().exercises
    except (MarkerError, CatalogError) as exc:      # a broken marker in the reference code
        raise pytest.UsageError(f"exercise markers: {exc}") from None
    errors, graded = [], set()
    for item in graders:
        eid = _exercise_id(item)
        if eid is None:
            errors.append(f"{item.nodeid}: a grader needs exactly one @pytest.mark.exercise(\"<id>\")")
        elif eid not in known:
            errors.append(f"{item.nodeid}: names exercise {eid!r}, which is not marked in the "
                          f"reference code (known: {', '.join(known) or 'none'})")
        else:
            graded.add(eid)
    selected = _selected_ids(config, known)
    if config.getoption("check_coverage", default=False):
        for eid in sorted(selected - graded, key=lambda i: known[i].sort_key):
            ex = known[eid]
            errors.append(f"exercise {eid} ({ex.title}, {ex.location}) has no grader: add a test "
                          f"marked @pytest.mark.exercise(\"{eid}\") in tests/graders/")
    if errors:
        raise pytest.UsageError("graders:\n  " + "\n  ".join(errors))

    keep, drop = [], []
    for item in items:
        (keep if not _is_grader(item) or _exercise_id(item) in selected else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def graded_exercises(request: pytest.FixtureRequest) -> frozenset[str]:
    """The exercises this session grades (after --chapter, --exercise, -k): a fixture that runs
    several exercises in one spawned world runs only these (booktools.exercises.world)."""
    return frozenset(eid for item in request.session.items
                     if _is_grader(item) and (eid := _exercise_id(item)) is not None)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    """A grader whose fixture already hit the stub (inverted mode) has nothing left to run."""
    if pyfuncitem.stash.get(_PROVED_IN_SETUP, False):
        return True
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    eid = _exercise_id(item) if _is_grader(item) else None
    if eid is None:
        return report
    if call.when in ("setup", "teardown") and report.passed:
        return report                      # nothing to grade in a fixture that worked
    if call.when == "call" and item.stash.get(_PROVED_IN_SETUP, False):
        return report                      # already recorded: proved in setup
    exc = call.excinfo.value if call.excinfo is not None else None
    if call.when == "teardown":
        result = FAIL                      # a teardown failure is a failure in every mode
    else:
        result = outcome(report.passed, report.skipped, exc, eid)
    difference = first_difference(exc) if result == FAIL and exc is not None else None
    item.config.stash[_RESULTS][item.nodeid] = (eid, result, difference)

    if current_impl() != "stub" or result == SKIP:
        if result == TODO:             # not a bug to debug: say so in one line
            report.longrepr = (f"todo: exercise {eid} still raises NotImplementedError: fill in its body "
                               "between the BEGIN/END EXERCISE markers of your stub")
        return report
    # Inverted mode: TODO (failed because of its own stub) is the only good outcome.
    if result == TODO:
        report.outcome, report.longrepr = "passed", None
        if call.when == "setup":
            item.stash[_PROVED_IN_SETUP] = True   # skip the test body: its fixture hit the stub
    elif result == PASS:
        report.outcome = "failed"
        report.longrepr = (f"grader for exercise {eid} PASSED on the unfilled stub: it does not "
                           f"grade the learner's code. Reach the code through "
                           f"implementation({eid!r}) or plug({eid!r}), and check what it returns.")
    else:
        report.longrepr = (f"grader for exercise {eid} failed on the unfilled stub, but not because "
                           f"of it: expected NotImplementedError(\"exercise {eid}\") from the stub, got "
                           f"the failure below. A grader must reach the learner's code before "
                           f"anything else can fail.\n\n{report.longrepr}")
    return report


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    results = config.stash.get(_RESULTS, {})
    if not results:
        return
    known = default_catalog().exercises
    by_id: dict[str, list[str]] = {}
    difference: dict[str, str] = {}          # the first failing grader's, in the order they ran
    for eid, result, diff in results.values():
        by_id.setdefault(eid, []).append(result)
        if diff is not None:
            difference.setdefault(eid, diff)
    impl = current_impl()
    tr = terminalreporter
    tr.section(f"exercises graded against {_WHAT[impl]}")
    width = max(len(known[e].title) for e in by_id)
    for eid in sorted(by_id, key=lambda e: known[e].sort_key):
        verdict = exercise_verdict(by_id[eid], impl, difference.get(eid))
        good = verdict.startswith(("pass", "proved"))
        tr.write_line(f"  {eid:6} {known[eid].title:{width}}  {verdict}",
                      green=good, red=verdict.startswith(("FAIL", "NOT")), yellow=verdict.startswith("todo"))
    if impl == "learner" and any(r == TODO for rs in by_id.values() for r in rs):
        tr.write_line("  todo: fill in the body between the BEGIN/END EXERCISE markers of your "
                      "stub (chapters/NN_*/exercises/).")
