"""The chapter-03 demo (chapters/03_pp/demo.py): a pipeline ends with MATCH (spawned and under
torchrun), prints the bubble next to the formula, draws the timelines, and a schedule that
cannot run stops before any rank starts."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minimegatron.launch import spawn
from booktools.demo import import_chapter

ch03 = import_chapter("03")
ROOT = Path(__file__).resolve().parents[1]
DEMO = "chapters/03_pp/demo.py"


def _run(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_spawned_1f1b_matches_and_reports_the_bubble(tmp_path):
    figure = tmp_path / "timeline.png"
    proc = _run(sys.executable, DEMO, "--quick", "--pp", "2", "--micro-batches", "4", "--figure", str(figure))
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert out.strip().splitlines()[-1].startswith("MATCH")
    # the formula line, independently: (p - 1) / (m + p - 1) = 1/5 with p = 2, m = 4
    assert "= 0.200 of the step idle" in out
    assert re.search(r"simulated, t_b=2t_f:\s+0\.200\s+0\.200", out), out
    assert "stage 0: 2 (schedule: 2)" in out and "stage 1: 1 (schedule: 1)" in out   # in flight: pp - rank
    assert figure.stat().st_size > 10_000


def test_a_p2p_ledger_that_differs_from_the_formula_is_a_mismatch():
    run = ch03.make_run(ch03.tiny_model(), pp=2, micro_batches=2)
    per_rank = spawn(ch03.train_run, 2, run, timeout=180)
    assert ch03.check_run(run, per_rank).ok
    sends = [i for i, (op, _, tag) in enumerate(per_rank[0]["ledger"][0]) if (op, tag) == ("send", "pp-fwd")]
    del per_rank[0]["ledger"][0][sends[0]]                     # stage 0, step 0: an activation never sent
    report = ch03.check_run(run, per_rank)
    assert not report.ok and any(p.startswith("p2p ledger, rank 0, step 0") for p in report.problems)
    assert ch03.summary_line([report]).startswith("MISMATCH")


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun is not installed next to this Python")
def test_interleaved_pp_x_dp_under_torchrun_matches():
    torchrun = str(Path(sys.executable).parent / "torchrun")
    proc = _run(torchrun, "--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                "--local-addr=127.0.0.1", "--nproc_per_node=4", DEMO, "--quick", "--pp", "2", "--dp", "2",
                "--schedule", "interleaved", "--micro-batches", "4", "--figure", "")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("MATCH")
    assert "DIFFERENT" not in proc.stdout


def test_an_impossible_schedule_fails_before_any_rank_starts():
    proc = _run(sys.executable, DEMO, "--pp", "4", "--schedule", "interleaved", "--micro-batches", "6", timeout=60)
    assert proc.returncode == 2
    assert "num_microbatches=6 to be a multiple of pp_size=4" in proc.stderr
