"""The chapter-02 demo (chapters/02_tp/demo.py: the experiment and its command line):
TP x DP ends with MATCH under torchrun, the spawned path works (GPT-2 style, tied, float32),
a layout that does not split stops before any rank starts, and the verdict turns to MISMATCH
when a run's numbers are tampered with."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minimegatron.launch import spawn
from booktools.demo import import_chapter

demo = import_chapter("02")

ROOT = Path(__file__).resolve().parents[1]
DEMO = "chapters/02_tp/demo.py"


def _run(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _tp_ledger(stdout: str) -> list[tuple[str, int, int, int]]:
    """(tag, calls, measured, formula) of the TP group's rows."""
    pattern = re.compile(r"TP\s+all_reduce x(\d+)\s+\((\S+)\)\s+measured\s+([\d,]+) bytes / formula\s+([\d,]+): OK")
    return [(m[1], int(m[0]), int(m[2].replace(",", "")), int(m[3].replace(",", ""))) for m in pattern.findall(stdout)]


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun is not installed next to this Python")
def test_tp_x_dp_under_torchrun_matches_and_the_ledger_is_the_formula():
    torchrun = str(Path(sys.executable).parent / "torchrun")
    proc = _run(torchrun, "--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                "--local-addr=127.0.0.1", "--nproc_per_node=4", DEMO, "--quick", "--tp", "2", "--dp", "2",
                "--zero", "1")
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert out.strip().splitlines()[-1].startswith("MATCH")
    assert "DIFFERENT" not in out and "problem:" not in out
    # independently of the demo: h=32, L=2, b=2, s=16, float64, 2 micro-batches
    b, s, h, L, e = 2, 16, 32, 2, 8
    rows = _tp_ledger(out)
    fwd = [r for r in rows if r[0] == "fwd"]
    bwd = [r for r in rows if r[0] == "bwd"]
    assert len(fwd) == len(bwd) == 2                                   # one row per micro-batch
    assert all(r[1:] == (1 + 2 * L + 3, (1 + 2 * L) * b * s * h * e + 3 * b * s * e,
                         (1 + 2 * L) * b * s * h * e + 3 * b * s * e) for r in fwd), fwd
    assert all(r[1:] == (2 * L + 1, (2 * L + 1) * b * s * h * e, (2 * L + 1) * b * s * h * e) for r in bwd), bwd
    assert len(re.findall(r"rank \d: [\d,]+ elements = [\d,]+ bytes: OK", out)) == 4


def test_spawned_gpt2_tied_float32_matches():
    proc = _run(sys.executable, DEMO, "--quick", "--tp", "2", "--dp", "1", "--style", "gpt2", "--dtype", "float32")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tied embeddings" in proc.stdout and "float32" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("MATCH")


def test_a_layout_that_does_not_split_fails_before_any_rank_starts():
    proc = _run(sys.executable, DEMO, "--tp", "3", timeout=60)
    assert proc.returncode == 2
    assert "num_attention_heads=4 is not divisible by the tensor-parallel size tp=3" in proc.stderr


def test_the_verdict_catches_wrong_numbers():
    run = demo.make_run(demo.tiny_model("gpt2"), tp=2, dp=1)
    per_rank = spawn(demo.train_run, 2, run, timeout=180)
    assert demo.check_run(run, per_rank).ok
    # a loss that is off, a rank holding an extra parameter, a ledger with a missing call
    wrong_loss = [{**r, "losses": [x + 1e-6 for x in r["losses"]]} for r in per_rank]
    assert demo.summary_line([demo.check_run(run, wrong_loss)]).startswith("MISMATCH")
    extra = [dict(r) for r in per_rank]
    extra[1]["param_elements"] += 1
    report = demo.check_run(run, extra)
    assert not report.ok and any("parameters, rank 1" in p for p in report.problems)
    short = [dict(r) for r in per_rank]
    short[0]["ledger"] = [[phase[1:] if i == 0 else phase for i, phase in enumerate(step)]
                          for step in short[0]["ledger"]]
    report = demo.check_run(run, short)
    assert not report.ok and any("ledger, rank 0" in p for p in report.problems)
