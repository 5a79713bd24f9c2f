"""Every chapter demo runs, ends with its verdict, and exits non-zero on a mismatch."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_chapter_00_demo_matches(tmp_path):
    proc = _run("chapters/00_single_device/demo.py", "--quick", "--no-progress", "--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("MATCH")


def test_chapter_00_demo_reports_a_broken_accumulation(tmp_path):
    proc = _run("chapters/00_single_device/demo.py", "--quick", "--no-progress", "--forget-loss-scaling",
                "--out-dir", str(tmp_path))
    assert proc.returncode == 1
    assert "MISMATCH" in proc.stdout
