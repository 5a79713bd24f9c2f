"""The chapter-01 demo (chapters/01_dp/demo.py): every data-parallel variant ends with MATCH,
a broken gradient average ends with MISMATCH and exit status 1, and torchrun works too.

Each run spawns its own ranks (two), so the tests group all variants into one run (--zero all).
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minimegatron.analysis import count_parameters
from minimegatron.launch import spawn
from booktools.demo import import_chapter

ch01 = import_chapter("01")       # chapters/01_dp/demo.py: the experiment and its CLI

ROOT = Path(__file__).resolve().parents[1]
DEMO = "chapters/01_dp/demo.py"


def _run(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _ledger_lines(stdout: str, variant: str) -> list[tuple[str, str, int, int, int]]:
    """(phase, op, calls, measured, formula) of one variant's ledger table."""
    block = stdout.split(f"=== {variant}:")[1].split("\n===")[0]
    pattern = re.compile(r"(micro-batch \d+[^a-z]*?(?:\(no_sync\)|\+ sync)|optimizer step)\s+(\w+) x(\d+) \(\S+\)\s+"
                         r"measured\s+([\d,]+) bytes / formula\s+([\d,]+) bytes: OK")
    return [(m[0].strip(), m[1], int(m[2]), int(m[3].replace(",", "")), int(m[4].replace(",", "")))
            for m in pattern.findall(block)]


def test_every_variant_matches_the_single_device_run():
    proc = _run(sys.executable, DEMO, "--quick", "--zero", "all")
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert out.strip().splitlines()[-1].startswith("MATCH")
    for kind in ch01.KINDS:
        assert f"=== {kind}:" in out, f"variant {kind} was not reported"
    assert "DIFFERENT" not in out and "MISMATCH" not in out
    # the ledger numbers the demo prints, against N e counted here from the config alone
    e = 8
    n = count_parameters(ch01.tiny_model())["total"]
    naive = _ledger_lines(out, "naive")
    assert [(op, calls) for _, op, calls, _, _ in naive] == [("all_reduce", 15)]   # 15 parameter tensors
    assert naive[0][3] == naive[0][4] == n * e
    ddp = _ledger_lines(out, "ddp")
    assert len(ddp) == 1 and 1 < ddp[0][2] < 15 and ddp[0][3] == n * e            # fewer, larger calls
    zero3 = _ledger_lines(out, "zero3")
    assert any(phase.endswith("(no_sync)") and op == "all_gather" for phase, op, *_ in zero3), \
        "ZeRO-3 must gather parameters even inside no_sync"


def test_a_broken_average_is_reported_by_every_variant():
    proc = _run(sys.executable, DEMO, "--quick", "--zero", "all", "--break-averaging")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("MISMATCH")
    for kind in ch01.KINDS:
        assert f"{kind} differs from the single-device run" in last, last


def test_a_ledger_that_differs_from_the_formula_is_a_mismatch():
    jobs = [(2, ch01.make_variant("zero1", ch01.tiny_model(), micro_batches=2))]
    results = spawn(ch01.run_variants, 2, jobs, timeout=180)
    assert ch01.check_variants(jobs, results)[0].ok
    record = results[0]["zero1"]
    record["ledger"][0][1] = record["ledger"][0][1][1:]         # step 0, the last micro-batch: a call lost
    report = ch01.check_variants(jobs, results)[0]
    assert not report.ok and any("ledger, rank 0, step 0, micro-batch 1" in p for p in report.problems)
    assert "DIFFERENT" in str(report) and ch01.summary_line([report]).startswith("MISMATCH")


def test_bad_arguments_fail_before_any_rank_starts():
    proc = _run(sys.executable, DEMO, "--micro-batches", "0")
    assert proc.returncode == 2 and "--micro-batches=0 must be at least 1" in proc.stderr


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun is not installed next to this Python")
def test_under_torchrun_every_rank_agrees():
    torchrun = str(Path(sys.executable).parent / "torchrun")
    proc = _run(torchrun, "--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                "--local-addr=127.0.0.1", "--nproc_per_node=2", DEMO, "--quick", "--zero", "2",
                "--micro-batches", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("MATCH")
    assert proc.stdout.count("Chapter 01:") == 1, "only rank 0 prints"
