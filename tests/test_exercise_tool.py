"""The exercise machinery (booktools/exercises/, tests/graders/conftest.py), on a fixture
package: the marker rules and their error messages, stub generation, the drift check, the
adapter (also inside a spawned rank), and the graders' plugin in normal and inverted mode.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from booktools.exercises import (IMPL_ENV, Catalog, MarkerError, default_catalog, find_exercises,
                                    implementation, plug, plugged)
from booktools.exercises.__main__ import main as cli
from booktools.exercises.catalog import CHAPTERS_ENV, PACKAGE_ENV
from booktools.exercises.grading import first_difference, raised_by_stub
from booktools.exercises.world import SharedWorld
from booktools.exercises.stubs import check, generate, render_all

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parent.parent


def _find(source: str):
    return find_exercises(textwrap.dedent(source), "pkg/mod.py", "pkg.mod")


# --------------------------------------------------------------------------------------
# Marker rules
# --------------------------------------------------------------------------------------

GOOD = '''
    import math

    def area(r: float) -> float:
        """Area of a circle of radius r."""
        r2 = r * r
        # BEGIN EXERCISE 3.1: circle area | hint: pi r^2
        result = math.pi * r2
        # END EXERCISE
        return result
'''


def test_a_good_region_is_found_with_its_lines():
    (ex,) = _find(GOOD)
    assert (ex.id, ex.title, ex.hint, ex.function, ex.module, ex.chapter) == \
        ("3.1", "circle area", "pi r^2", "area", "pkg.mod", 3)
    assert (ex.first_line, ex.begin_line, ex.end_line, ex.last_line, ex.indent) == (4, 7, 9, 10, "    ")


BAD = {
    "unclosed": ('''
        def f():
            """doc"""
            # BEGIN EXERCISE 1.1: t | hint: h
            return 1
        ''', 4, "never closed"),
    "nested": ('''
        def f():
            """doc"""
            # BEGIN EXERCISE 1.1: t | hint: h
            # BEGIN EXERCISE 1.2: u | hint: h
            return 1
            # END EXERCISE
            # END EXERCISE
        ''', 5, "cannot nest"),
    "END without BEGIN": ('''
        def f():
            """doc"""
            return 1
            # END EXERCISE
        ''', 5, "without a BEGIN"),
    "duplicate id": ('''
        def f():
            """doc"""
            # BEGIN EXERCISE 1.1: t | hint: h
            return 1
            # END EXERCISE

        def g():
            """doc"""
            # BEGIN EXERCISE 1.1: t | hint: h
            return 2
            # END EXERCISE
        ''', 10, "duplicate exercise id 1.1 (also at line 4)"),
    "outside a function": ('''
        # BEGIN EXERCISE 1.1: t | hint: h
        X = 1
        # END EXERCISE
        ''', 2, "outside a function"),
    "in a method": ('''
        class A:
            def f(self):
                """doc"""
                # BEGIN EXERCISE 1.1: t | hint: h
                return 1
                # END EXERCISE
        ''', 5, "a method of class 'A'"),
    "in a nested function": ('''
        def outer():
            """doc"""
            def inner():
                """doc"""
                # BEGIN EXERCISE 1.1: t | hint: h
                return 1
                # END EXERCISE
            return inner
        ''', 6, "nested in 'outer'"),
    "no hint": ('''
        def f():
            """doc"""
            # BEGIN EXERCISE 1.1: t
            return 1
            # END EXERCISE
        ''', 4, "malformed BEGIN marker"),
    "bad id": ('''
        def f():
            """doc"""
            # BEGIN EXERCISE one: t | hint: h
            return 1
            # END EXERCISE
        ''', 4, "malformed BEGIN marker"),
    "END names another id": ('''
        def f():
            """doc"""
            # BEGIN EXERCISE 1.1: t | hint: h
            return 1
            # END EXERCISE 1.2
        ''', 6, "closes exercise 1.1"),
    "marker after code": ('''
        def f():
            """doc"""
            x = 1  # BEGIN EXERCISE 1.1: t | hint: h
            return x
            # END EXERCISE
        ''', 4, "on a line of its own"),
    "no docstring": ('''
        def f():
            # BEGIN EXERCISE 1.1: t | hint: h
            return 1
            # END EXERCISE
        ''', 2, "no docstring"),
    "inside a block": ('''
        def f(x):
            """doc"""
            if x:
                # BEGIN EXERCISE 1.1: t | hint: h
                return 1
                # END EXERCISE
            return 0
        ''', 5, "body's indentation"),
    "cuts a statement": ('''
        def f(x):
            """doc"""
            # BEGIN EXERCISE 1.1: t | hint: h
            if x:
                y = 1
            # END EXERCISE
            else:
                y = 2
            return y
        ''', 7, "cuts the statement at lines 5-9"),
    "empty": ('''
        def f():
            """doc"""
            # BEGIN EXERCISE 1.1: t | hint: h
            # END EXERCISE
            return 1
        ''', 4, "holds no code"),
    "two in one function": ('''
        def f():
            """doc"""
            # BEGIN EXERCISE 1.1: t | hint: h
            x = 1
            # END EXERCISE
            # BEGIN EXERCISE 1.2: t | hint: h
            return x
            # END EXERCISE
        ''', 7, "one exercise per function"),
    "END in the next function": ('''
        def f():
            """doc"""
            # BEGIN EXERCISE 1.1: t | hint: h
            return 1

        def g():
            """doc"""
            return 2
            # END EXERCISE
        ''', 10, "END of exercise 1.1 is not in function 'f'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_markers_are_rejected_with_file_and_line(case):
    source, line, words = BAD[case]
    with pytest.raises(MarkerError) as info:
        _find(source)
    assert info.value.line == line, str(info.value)
    assert str(info.value).startswith(f"pkg/mod.py:{line}: ")
    assert words in str(info.value)


def test_markers_inside_strings_are_not_markers():
    source = '''
        def f():
            """Mark a region like this:
            # BEGIN EXERCISE 1.1: t | hint: h
            """
            return "# END EXERCISE"
        '''
    assert _find(source) == []


# --------------------------------------------------------------------------------------
# A fixture package, its chapters, and stub generation
# --------------------------------------------------------------------------------------

OPS = '''\
"""Fixture operations."""

from __future__ import annotations

import math
import os
from typing import Callable

from .helpers import scale

EPS = 1e-6


def _square(x: float) -> float:
    return x * x


def logged(fn: Callable) -> Callable:
    return fn


@logged
def norm(x: list[float], *, eps: float = EPS) -> float:
    """The Euclidean norm of x, plus eps.

    The spec a learner reads.
    """
    total = 0.0
    # BEGIN EXERCISE 9.1: Euclidean norm | hint: sum the squares, then take the root
    for v in x:
        total += _square(v)
    result = math.sqrt(total)
    # END EXERCISE
    return scale(result) + eps


def uses_norm(x: list[float]) -> float:
    return 2 * norm(x)
'''

HELPERS = '''\
def scale(v):
    return v
'''

USER = '''\
"""Another module holding its own copy of norm, as `from .ops import norm` makes."""
from .ops import norm


def twice(x):
    return 2 * norm(x)


def rank_worker(x):
    return twice(x)
'''


@pytest.fixture
def book(tmp_path, monkeypatch):
    """A tiny book: package `fixbook` with exercise 9.1, and chapters/09_fixture/."""
    pkg = tmp_path / "fixbook"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "ops.py").write_text(OPS)
    (pkg / "helpers.py").write_text(HELPERS)
    (pkg / "user.py").write_text(USER)
    (tmp_path / "chapters" / "09_fixture").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(PACKAGE_ENV, "fixbook")
    monkeypatch.setenv(CHAPTERS_ENV, str(tmp_path / "chapters"))
    monkeypatch.setenv(IMPL_ENV, "reference")
    yield Catalog("fixbook", pkg.resolve(), (tmp_path / "chapters").resolve())
    for name in [m for m in sys.modules if m == "fixbook" or m.startswith(("fixbook.", "_minimegatron_"))]:
        del sys.modules[name]


def _stub(book) -> Path:
    return book.chapters_dir / "09_fixture" / "exercises" / "ops.py"


def test_stub_keeps_signature_docstring_and_surrounding_code(book):
    text = render_all(book)[_stub(book)]
    assert "Generated by `python -m booktools.exercises generate`" in text
    assert "make grade EX=9.1" in text
    assert textwrap.dedent('''\
        @logged
        def norm(x: list[float], *, eps: float = EPS) -> float:
            """The Euclidean norm of x, plus eps.

            The spec a learner reads.
            """
            total = 0.0
            # BEGIN EXERCISE 9.1: Euclidean norm
            # hint: sum the squares, then take the root
            raise NotImplementedError("exercise 9.1")
            # END EXERCISE
            return scale(result) + eps
        ''') in text
    assert "math.sqrt" not in text and "uses_norm" not in text      # no solution, no other code
    # Imports: only what the function used; relative made absolute; the module's own helpers.
    assert "from __future__ import annotations\n" in text
    assert "import math\n" in text and "import os" not in text and "Callable" not in text
    assert "from fixbook.helpers import scale\n" in text
    assert "from fixbook.ops import EPS, _square, logged\n" in text
    assert render_all(book) == render_all(book)                     # deterministic


def test_stub_imports_on_its_own_and_raises_its_id(book):
    generate(book)
    assert (book.chapters_dir / "09_fixture" / "exercises" / "README.md").exists()
    learner = implementation("9.1", "learner")
    with pytest.raises(NotImplementedError, match=r"^exercise 9\.1$"):
        learner([3.0, 4.0])
    assert implementation("9.1", "reference")([3.0, 4.0]) == pytest.approx(5.0 + 1e-6)


def test_check_finds_missing_outdated_filled_and_stale_stubs(book, capsys):
    assert [c.action for c in check(book)] == ["missing", "missing"]
    assert cli(["check"], catalog=book) == 1
    assert "missing" in capsys.readouterr().err
    generate(book)
    assert check(book) == [] and cli(["check"], catalog=book) == 0

    # The reference's docstring changes: the stub is out of date.
    ops = book.package_dir / "ops.py"
    ops.write_text(OPS.replace("The spec a learner reads.", "A better spec."))
    book.__dict__.pop("exercises", None)                  # the catalog caches its scan
    (problem,) = check(book)
    assert problem.action == "drift" and "out of date" in problem.detail

    # A learner's filled-in stub is reported as such.
    generate(book)
    stub = _stub(book)
    stub.write_text(stub.read_text().replace('raise NotImplementedError("exercise 9.1")',
                                             "result = sum(v * v for v in x) ** 0.5"))
    (problem,) = check(book)
    assert problem.action == "drift" and "9.1 are filled in" in problem.detail

    # The exercise disappears from the reference: its generated files are stale.
    ops.write_text(OPS.replace("# BEGIN EXERCISE 9.1: Euclidean norm | hint: sum the squares, then take the root\n", "")
                   .replace("    # END EXERCISE\n", ""))
    book.__dict__.pop("exercises", None)
    assert sorted(c.action for c in check(book)) == ["stale", "stale"]


def test_generate_never_overwrites_work_without_force(book):
    generate(book)
    stub = _stub(book)
    solved = stub.read_text().replace('raise NotImplementedError("exercise 9.1")',
                                      "result = sum(v * v for v in x) ** 0.5")
    stub.write_text(solved)
    (book.package_dir / "ops.py").write_text(OPS.replace("The spec a learner reads.", "A better spec."))
    book.__dict__.pop("exercises", None)
    changes = {c.path.name: c for c in generate(book)}
    assert changes["ops.py"].action == "kept" and "9.1" in changes["ops.py"].detail
    assert stub.read_text() == solved
    changes = {c.path.name: c for c in generate(book, force=True)}
    assert changes["ops.py"].action == "write" and "A better spec." in stub.read_text()

    # An unfilled stub (only the hint changed) is rewritten without --force.
    stub.write_text(stub.read_text().replace("# hint: sum the squares", "# hint: an older hint"))
    assert {c.path.name: c.action for c in generate(book)}["ops.py"] == "write"


def test_generate_needs_the_chapter_folder(book, capsys):
    (book.chapters_dir / "09_fixture").rmdir()
    assert cli(["generate"], catalog=book) == 2
    assert "chapter 9 has no folder matching" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# The adapter
# --------------------------------------------------------------------------------------

def _solve(book, body: str) -> None:
    generate(book)
    stub = _stub(book)
    stub.write_text(stub.read_text().replace('raise NotImplementedError("exercise 9.1")', body))


def test_implementation_follows_the_environment(book, monkeypatch):
    _solve(book, "result = 42.0")
    reference = implementation("9.1")
    assert reference.__module__ == "fixbook.ops"
    monkeypatch.setenv(IMPL_ENV, "learner")
    assert implementation("9.1")([1.0]) == 42.0 + 1e-6
    monkeypatch.setenv(IMPL_ENV, "stub")
    with pytest.raises(NotImplementedError, match="exercise 9.1"):
        implementation("9.1")([1.0])
    monkeypatch.setenv(IMPL_ENV, "nonsense")
    with pytest.raises(ValueError, match="MINIMEGATRON_IMPL='nonsense' is not one of"):
        implementation("9.1")
    with pytest.raises(ValueError, match=r"no exercise '9\.9'.*known exercises: 9\.1"):
        implementation("9.9", "reference")


def test_learner_file_missing_is_a_clear_error(book):
    with pytest.raises(FileNotFoundError, match="make exercises"):
        implementation("9.1", "learner")


def test_plug_swaps_every_binding_and_restores_them(book):
    _solve(book, "result = 42.0")
    import fixbook.ops as ops
    import fixbook.user as user

    reference = ops.norm
    assert user.twice([3.0, 4.0]) == pytest.approx(2 * (5.0 + 1e-6))
    with plug("9.1", impl="learner"):
        assert ops.norm is not reference and user.norm is ops.norm
        assert ops.uses_norm([1.0]) == pytest.approx(2 * (42.0 + 1e-6))
        assert user.twice([3.0, 4.0]) == pytest.approx(2 * (42.0 + 1e-6))
    assert ops.norm is reference and user.norm is reference
    with plug("9.1", impl="reference"):                       # a no-op
        assert ops.norm is reference


def test_plugged_worker_plugs_inside_a_spawned_rank(book, monkeypatch):
    """A rank inherits MINIMEGATRON_IMPL; the stub's error comes back through spawn and is
    recognised as the stub's (the launcher re-raises it with the rank's traceback)."""
    from minimegatron.launch import spawn

    _solve(book, "result = 42.0")
    import fixbook.user as user

    monkeypatch.setenv(IMPL_ENV, "learner")
    assert spawn(plugged(user.rank_worker, "9.1"), 1, [3.0]) == [pytest.approx(2 * (42.0 + 1e-6))]
    monkeypatch.setenv(IMPL_ENV, "stub")
    with pytest.raises(NotImplementedError) as info:
        spawn(plugged(user.rank_worker, "9.1"), 1, [3.0])
    assert raised_by_stub(info.value, "9.1") and "rank 0 of 1 failed" in str(info.value)


def test_raised_by_stub_names_the_exact_exercise():
    assert raised_by_stub(NotImplementedError("exercise 0.1"), "0.1")
    assert not raised_by_stub(NotImplementedError("exercise 0.10"), "0.1")
    assert not raised_by_stub(NotImplementedError("exercise 0.1"), "0.10")
    assert not raised_by_stub(NotImplementedError("not supported"), "0.1")
    assert not raised_by_stub(ValueError("exercise 0.1"), "0.1")
    try:
        try:
            raise NotImplementedError("exercise 2.3")
        except NotImplementedError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert raised_by_stub(outer, "2.3")
    rank = RuntimeError("rank 1 of 2 failed: ...\nTraceback ...\nNotImplementedError: exercise 4.1\n")
    assert raised_by_stub(rank, "4.1") and not raised_by_stub(rank, "4.12")


# --------------------------------------------------------------------------------------
# The graders' plugin (tests/graders/conftest.py), run by pytester on the fixture book
# --------------------------------------------------------------------------------------

GRADERS = '''
import pytest
from booktools.exercises import implementation


@pytest.fixture
def learner_norm():
    return implementation("9.1")([3.0, 4.0])


@pytest.mark.exercise("9.1")
def test_good():
    assert implementation("9.1")([3.0, 4.0]) == pytest.approx(5.0 + 1e-6)


@pytest.mark.exercise("9.1")
def test_good_in_a_fixture(learner_norm):
    assert learner_norm == pytest.approx(5.0 + 1e-6)
'''

USELESS = '''
import pytest


@pytest.mark.exercise("9.1")
def test_never_calls_the_learner():
    assert True


@pytest.mark.exercise("9.1")
def test_breaks_first():
    raise KeyError("unrelated")
'''


@pytest.fixture
def graders(book, pytester):
    pytester.makeconftest((REPO / "tests" / "graders" / "conftest.py").read_text())
    pytester.makepyfile(test_fixture_graders=GRADERS)
    return pytester


def test_plugin_reference_learner_and_inverted(graders, book):
    _solve(book, "result = sum(v * v for v in x) ** 0.5")
    result = graders.runpytest("--impl=reference", "--check-coverage")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*9.1 * Euclidean norm*pass*"])

    result = graders.runpytest("--impl=learner")
    result.assert_outcomes(passed=2)

    result = graders.runpytest("--impl=stub", "--check-coverage")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*9.1 * Euclidean norm*proved: all 2 grader(s) fail on the stub*"])


def test_plugin_learner_todo_and_fail(graders, book):
    generate(book)                                   # unfilled stub
    result = graders.runpytest("--impl=learner")
    result.assert_outcomes(failed=1, errors=1)       # the fixture's call is an error in setup
    result.stdout.fnmatch_lines(["*todo: exercise 9.1 still raises NotImplementedError*",
                                 "*9.1 * Euclidean norm*todo (not started*"])
    _solve(book, "result = 1.0")
    result = graders.runpytest("--impl=learner")
    result.assert_outcomes(failed=2)
    # the summary line carries the first difference; short tracebacks: the long style would
    # print a fixture's value (a shared world's, every exercise's data in it)
    result.stdout.fnmatch_lines(["*9.1 * Euclidean norm*FAIL (2 of 2 graders failed): "
                                 "assert 1.000001 == 5.000001*"])
    result.stdout.no_fnmatch_line("learner_norm = *")


def test_inverted_mode_fails_graders_that_do_not_prove_anything(graders, book):
    graders.makepyfile(test_useless=USELESS)
    result = graders.runpytest("--impl=stub")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*PASSED on the unfilled stub*", "*not because of it*", "*KeyError*",
                                 "*9.1 * Euclidean norm*NOT PROVED: 2 of 4 grader(s)*"])


def test_unknown_ids_missing_markers_and_missing_graders_are_errors(graders, book):
    graders.makepyfile(test_bad='''
        import pytest

        @pytest.mark.exercise("9.7")
        def test_unknown():
            pass

        def test_unmarked():
            pass
        ''')
    result = graders.runpytest("--impl=reference")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_unknown: names exercise '9.7', which is not marked*",
                                 "*test_unmarked: a grader needs exactly one @pytest.mark.exercise*"])

    (graders.path / "test_bad.py").unlink()
    (graders.path / "test_fixture_graders.py").unlink()
    graders.makepyfile(test_other="def test_nothing():\n    pass\n")
    result = graders.runpytest("--impl=reference", "--check-coverage")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*exercise 9.1 (Euclidean norm, fixbook/ops.py:*) has no grader*"])


def test_selection_by_chapter_and_exercise(graders, book):
    graders.runpytest("--impl=reference", "--chapter", "09").assert_outcomes(passed=2)
    graders.runpytest("--impl=reference", "--exercise", "9.1").assert_outcomes(passed=2)
    result = graders.runpytest("--impl=reference", "--exercise", "9.5")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--exercise 9.5: no such exercise (known: 9.1)*"])


# --------------------------------------------------------------------------------------
# A shared world (booktools/exercises/world.py): each failure charged to its own exercise
# --------------------------------------------------------------------------------------

def test_first_difference_is_one_short_line():
    assert first_difference(AssertionError("dW: max difference 9.0e+00\nassert False")) == "dW: max difference 9.0e+00"
    assert first_difference(ValueError("\n bad shape (2, 3)\nmore")) == "ValueError: bad shape (2, 3)"
    assert first_difference(AssertionError("")) == "assertion failed"
    long = first_difference(AssertionError("x" * 500))
    assert len(long) == 140 and long.endswith("...")


def test_shared_world_runs_only_the_graded_exercises_and_shows_none_of_their_data():
    plans = []

    def start(plan):                     # two ranks; the rank functions are tested in a spawned world below
        plans.append(plan)
        return [{eid: {"ran": True, "error": None, "summary": None, "data": (rank, eid), "stopped_by": None}
                 for eid in plan.exercises} for rank in range(2)]

    world = SharedWorld(start, ["4.3", "4.2", "4.4"], graded={"4.4", "4.3", "0.1"})
    assert [p.exercises for p in plans] == [("4.3", "4.4")] and world.worlds == 1
    assert world.data("4.4") == [(0, "4.4"), (1, "4.4")]
    assert repr(world) == "<SharedWorld: exercises 4.3, 4.4 in 1 spawned world(s)>"
    with pytest.raises(KeyError, match="exercise 4.2 was not graded in this world"):
        world.data("4.2")


FIXBOOK_MORE = '''\
"""Two more fixture exercises, for the shared world."""


def double(x: float) -> float:
    """2 x."""
    # BEGIN EXERCISE 9.2: double | hint: add it to itself
    return x + x
    # END EXERCISE


def triple(x: float) -> float:
    """3 x."""
    # BEGIN EXERCISE 9.3: triple | hint: three times
    return 3 * x
    # END EXERCISE
'''

FIXBOOK_WORLD = '''\
"""A shared world's rank function: 9.1 kills its rank 1, 9.2 fails on rank 0 only (the others
then wait in a collective rank 0 never joins), 9.3 passes."""
import os

import torch
import torch.distributed as dist

from booktools.exercises.world import run_checks
from fixbook.more import double, triple
from fixbook.ops import norm


def grade(plan):
    rank = dist.get_rank()

    def dies():
        if rank == 1:
            os._exit(3)                       # a crash: no Python exception comes back
        dist.barrier()
        return norm([3.0, 4.0])

    def uneven():
        if rank == 0:
            raise ValueError("rank 0 gave up before the all-reduce")
        t = torch.ones(1)
        dist.all_reduce(t)                    # waits for rank 0 until the collective timeout
        return double(t.item())

    def passes():
        t = torch.full((1,), float(rank))
        dist.all_reduce(t)                    # the collectives are in step again: 0 + 1
        return triple(t.item())

    return run_checks({"9.1": dies, "9.2": uneven, "9.3": passes}, plan)
'''


def test_shared_world_charges_each_failure_to_its_own_exercise(book):
    """A world killed inside 9.1's checks is charged to 9.1 alone; 9.2, failing on one rank
    while the other waits in a collective, stops the world after it; 9.3 then runs in a fresh
    world (three worlds of 2 ranks) and passes; no message names another exercise."""
    from minimegatron.launch import spawn

    (book.package_dir / "more.py").write_text(FIXBOOK_MORE)
    (book.package_dir / "world_checks.py").write_text(FIXBOOK_WORLD)
    import fixbook.world_checks as checks

    world = SharedWorld(lambda plan: spawn(checks.grade, 2, plan, timeout=120, collective_timeout=3),
                        ["9.1", "9.2", "9.3"])
    assert world.worlds == 3
    assert world.data("9.3") == [3.0, 3.0]
    with pytest.raises(AssertionError) as died:
        world.data("9.1")
    first = str(died.value).splitlines()[0]
    assert first.startswith("exercise 9.1: the spawned world stopped while running its checks: ")
    assert "exit code 3" in first
    with pytest.raises(AssertionError) as uneven:
        world.data("9.2")
    message = str(uneven.value)
    assert message.splitlines()[0] == "exercise 9.2: ValueError: rank 0 gave up before the all-reduce (rank 0 of 2)"
    assert "rank 1: " in message and "9.1" not in message and "9.3" not in message
    assert "9.2" not in str(died.value).replace("rank", "")


# --------------------------------------------------------------------------------------
# Hints: the idea, not the code; a fuller one folded in the chapter text
# --------------------------------------------------------------------------------------

def test_stub_and_readme_point_at_a_fuller_hint_when_the_chapter_has_one(book):
    stub, readme = _stub(book), book.chapters_dir / "09_fixture" / "exercises" / "README.md"
    assert "Stuck?" not in render_all(book)[stub] and "Stuck?" not in render_all(book)[readme]
    (book.chapters_dir / "09_fixture" / "README.md").write_text(
        "<details><summary>Stuck on exercise 9.1?</summary>\n\nSquares first.\n\n</details>\n")
    for path in (stub, readme):
        assert 'under "Stuck on\nexercise N.M?" for 9.1.' in render_all(book)[path]


# An assignment, a call, a return, a tensor method: what a hint that gives the code away looks like
_CODE = re.compile(r"\b\w+(\[[^\]]*\])?\s*=\s*[\w(]|\b[A-Za-z_]\w*\(|\breturn\b|\w\.\w+\(|@")


def test_the_books_hints_point_at_ideas_not_code(monkeypatch):
    """Every hint of the book is free of code (a stub shows it right above the `raise`), and every
    exercise but the spot-the-bug ones has a fuller hint folded in its chapter's README."""
    for var in (PACKAGE_ENV, CHAPTERS_ENV):
        monkeypatch.delenv(var, raising=False)
    # the check itself catches the hints the book had before (5.2's was its return line)
    assert _CODE.search("c = routing_map.sum(0) (or tokens_per_expert); return (scores.sum(0) * c).sum()")
    assert _CODE.search("lse = torch.logaddexp(lse_a, lse_b); weight each out by exp(its lse - lse)")
    assert _CODE.search("broadcast cos/sin over heads, then x * cos + rotate_half(x) * sin")
    catalog = default_catalog()
    for ex in catalog.exercises.values():
        assert not _CODE.search(ex.hint), f"exercise {ex.id}'s hint reads like code: {ex.hint!r}"
        if not ex.title.startswith("spot the bug"):
            readme = (catalog.chapter_dir(ex.chapter) / "README.md").read_text(encoding="utf-8")
            assert f"<summary>Stuck on exercise {ex.id}?</summary>" in readme, \
                f"exercise {ex.id} has no fuller hint in {catalog.chapter_dir(ex.chapter).name}/README.md"
