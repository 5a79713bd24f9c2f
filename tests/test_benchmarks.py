"""The benchmarks still run (smoke size). Their speed is reported, never asserted."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script, args", [
    ("benchmarks/bench_baseline.py", ["--smoke"]),
    ("benchmarks/bench_ddp.py", ["--smoke", "--ranks", "1", "2"]),
    ("benchmarks/bench_tp.py", ["--smoke", "--tp", "1", "2"]),
])
def test_benchmark_runs(script, args):
    proc = subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "tokens/s" in proc.stdout
