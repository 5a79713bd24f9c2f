"""The chapter-06 experiment (chapters/06_fp8/demo.py): in one spawned world of 4 ranks, a bf16,
an fp16 and an FP8 run of each recipe, each against one device in its precision, with every
rank's bytes and messages against the formulas (check_run); the demo's own command line ends
with MATCH and exit 0; a layout it cannot run stops before any rank starts, naming the flags."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from booktools.demo import import_chapter
from minimegatron.launch import spawn

ROOT = Path(__file__).resolve().parents[1]
ch06 = import_chapter("06")


def _train_runs(runs):
    return [ch06.train_run(run) for run in runs]


@pytest.mark.slow
def test_every_precision_and_recipe_on_four_ranks():
    fp8 = lambda recipe, hidden=32, seq=32, **kw: ch06.make_run(ch06.tiny_model("fp8", hidden), "fp8",   # noqa: E731
                                                                fp8_recipe=recipe, steps=2, seq=seq, **kw)
    runs = [ch06.make_run(ch06.tiny_model("bf16"), "bf16", tp=2, sp=True, dp=2, steps=2),
            ch06.make_run(ch06.tiny_model("fp16", layers=4), "fp16", tp=2, pp=2, steps=2),
            fp8("tensorwise", tp=2, sp=True, dp=2),
            fp8("delayed", tp=2, sp=True, pp=2),
            fp8("mxfp8", hidden=64, seq=128, tp=2, sp=True, cp=2),
            ch06.make_run(ch06.tiny_model("fp8", 32, experts=4), "fp8", tp=2, sp=True, ep=2, dp=2,
                          fp8_recipe="mxfp8", steps=2)]
    per_rank = spawn(_train_runs, 4, runs, timeout=600)
    for i, run in enumerate(runs):
        report = ch06.check_run(run, [r[i] for r in per_rank])     # the EP run: within fp8_layout_tolerance
        assert report.ok, f"{run.name()}:\n" + "\n".join(report.lines + report.problems)


@pytest.mark.slow
def test_the_one_scale_fp8_recipes_at_5d_on_sixteen_ranks():
    """tp 2 + SP x cp 2 x pp 2 x ep 2 x dp 2 (experts: etp 2 x ep 2 x expert-dp 2), one world of 16
    ranks: the two one-scale FP8 recipes (whose amax reductions over tp x cp are the ones
    parallelism can get wrong; bf16 and fp16 run at 4 ranks above and in tests/test_precision.py),
    each against one device in its precision, with every rank's bytes and messages against the
    formulas. Here each expert's ep x etp ranks are one
    replica's tp x cp, so current scaling must equal one device to float64 summation order (an
    amax reduced with the wrong op fails it); delayed scaling under CP compares within
    fp8_layout_tolerance (README §5). The blocked recipes need no reduction and run at 4 ranks above."""
    five_d = dict(tp=2, sp=True, cp=2, pp=2, ep=2, dp=2, steps=2)
    runs = [ch06.make_run(ch06.tiny_model(precision, layers=4, experts=4), precision, fp8_recipe=recipe, **five_d)
            for precision, recipe in (("fp8", "tensorwise"), ("fp8", "delayed"))]
    per_rank = spawn(_train_runs, 16, runs, timeout=600)
    for i, run in enumerate(runs):
        report = ch06.check_run(run, [r[i] for r in per_rank])
        assert report.ok, f"{run.name()}:\n" + "\n".join(report.lines + report.problems)
        assert "= formula on every rank" in "\n".join(report.lines), report.lines
        exact = run.train.fp8_recipe == "tensorwise" and run.precision == "fp8"
        assert not exact or "the float64 row of testing.TOLERANCES" in report.lines[0], report.lines[0]


def _demo(*args):
    return subprocess.run([sys.executable, "chapters/06_fp8/demo.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_the_demo_ends_with_match_and_exits_0():
    proc = _demo("--quick", "--precision", "fp8", "--fp8-recipe", "tensorwise", "--tp", "2", "--sp", "--dp", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("MATCH"), proc.stdout[-2000:]
    assert "fp8" in proc.stdout and "= formula on every rank" in proc.stdout


def test_the_layouts_fp8_cannot_match_exactly_are_named_and_compared_within_the_fp8_tolerance():
    assert ch06.inexact_fp8("fp8", "delayed", tp=2, cp=1, dp=2, ep=1) == "delayed scaling over 2 data-parallel replicas"
    assert ch06.inexact_fp8("fp8", "tensorwise", tp=2, cp=2, dp=2, ep=1) is None          # the amax over tp x cp
    assert ch06.inexact_fp8("bf16", "delayed", tp=2, cp=2, dp=2, ep=2) is None
    assert "expert-parallel" in ch06.inexact_fp8("fp8", "mxfp8", tp=2, cp=1, dp=2, ep=2)
    # an expert's tokens are one micro-batch's exactly when its etp x ep ranks are one replica's tp x cp
    assert ch06.inexact_fp8("fp8", "tensorwise", tp=2, cp=2, dp=2, ep=2) is None
    assert "ep x etp = 4 ranks, not the tp x cp = 2" in ch06.inexact_fp8("fp8", "tensorwise", tp=2, cp=1, dp=2, ep=2)
    assert "ep x etp = 1 ranks, not the tp x cp = 2" in ch06.inexact_fp8("fp8", "tensorwise", tp=1, cp=2, dp=1, ep=1,
                                                                          experts=True)
    proc = _demo("--quick", "--precision", "fp8", "--fp8-recipe", "delayed", "--tp", "2", "--sp", "--dp", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fp8_layout_tolerance" in proc.stdout and "delayed scaling over 2 data-parallel replicas" in proc.stdout


def test_a_layout_the_demo_cannot_run_is_named_before_any_rank_starts():
    proc = _demo("--quick", "--ep", "2", "--tp", "2")
    assert proc.returncode == 2 and "--ep 2 with --tp 2 needs --sp" in proc.stderr, proc.stderr[-2000:]
