"""The graders catch the wrong answers they are written against (tests/graders/).

`make grade-stubs` proves that every grader fails on an unfilled stub; this file proves that a
grader fails on a plausible wrong answer too, one a learner could write, run the way a learner
runs it: the wrong body in a learner's stub file (MINIMEGATRON_CHAPTERS_DIR points the graders
at a temporary chapters/ folder), graded by `pytest tests/graders --impl=learner` in a fresh
process, whose failure must name what differs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from booktools.exercises import default_catalog
from booktools.exercises.stubs import render_stub_module

REPO = Path(__file__).resolve().parent.parent


def _learner_chapters(tmp_path: Path, bodies: dict[str, str]) -> Path:
    """A chapters/ folder holding the stub files of the exercises in `bodies`, each exercise's
    `raise NotImplementedError` replaced by its body (written at the function body's indent)."""
    catalog = default_catalog()
    for path, exercises in catalog.stub_files().items():
        if not any(ex.id in bodies for ex in exercises):
            continue
        text = render_stub_module(catalog, exercises)
        for ex in exercises:
            if ex.id in bodies:
                stub = f'{ex.indent}raise NotImplementedError("exercise {ex.id}")'
                assert text.count(stub) == 1, f"exercise {ex.id}: the stub's raise line is not {stub!r}"
                text = text.replace(stub, "\n".join(ex.indent + line for line in bodies[ex.id].strip().splitlines()))
        target = tmp_path / "chapters" / path.parent.parent.name / "exercises" / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return tmp_path / "chapters"


def _grade(chapters: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MINIMEGATRON_CHAPTERS_DIR=str(chapters), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--impl=learner", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_whole_model_grader_of_7_1_catches_a_cpu_generator_left_unrestored(tmp_path):
    """7.1's whole-model grader, given a set_rng_states that restores the tracker's streams (and
    CUDA's) but not torch's default CPU generator, fails on the run without sequence parallelism
    (its dropout after the row-parallel layers draws from that generator) and names that run.
    The run with SP alone would pass it: under SP every dropout draws from the tracker.
    About 30 s on 2 cores (a pytest start and one spawned world of 2 ranks, 4 tiny trainings)."""
    chapters = _learner_chapters(tmp_path, {"7.1": """
cpu, cuda, tracker = states          # the CPU generator's state is left as it is
if cuda is not None:
    torch.cuda.set_rng_state(cuda)
get_rng_tracker().set_states(tracker)
"""})
    result = _grade(chapters, "tests/graders/test_ch07_recompute.py",
                    "-k", "test_tensor_parallel_recompute_with_your_states_equals_the_run_without")
    out = result.stdout + result.stderr
    assert result.returncode == 1, f"the grader did not fail (exit {result.returncode}):\n{out[-3000:]}"
    assert "1 failed" in out and "7.1 " in out and "FAIL" in out, out[-3000:]
    # the first difference names the run without SP ("tp=2 x dp=1", not "tp=2 + SP") and what differs
    assert "full recompute (uniform, 1): tp=2 x dp=1, your set_rng_states in the recompute: rank 0: losses" in out, \
        out[-3000:]
    assert "tp=2 + SP x dp=1, your set_rng_states" not in out, \
        "the run with SP failed too: under SP every dropout draws from the tracker, which this body restores"
