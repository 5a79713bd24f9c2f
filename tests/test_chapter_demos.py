"""Every chapter demo runs, ends with its verdict, and exits non-zero on a mismatch."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun is not installed next to this Python")
def test_chapter_00_demo_under_torchrun(tmp_path):
    """Two ranks check the initial weights together; then rank 0 trains alone (the others
    leave the process group first, so nothing waits on them) and gives the verdict."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([torchrun, "--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                           "--local-addr=127.0.0.1", "--nproc_per_node=2", "chapters/00_single_device/demo.py",
                           "--quick", "--no-progress", "--out-dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 rank(s) built the model" in proc.stdout and "bit-identical on every rank" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("MATCH")


def test_chapter_00_experiments_import_and_spawn():
    """The notebook's way in: booktools.demo.import_chapter("00") imports
    chapters/00_single_device/demo.py as chapters.00_single_device.demo, and launch.spawn can
    run a function defined there on fresh ranks (they import it by that name)."""
    from minimegatron.launch import spawn
    from booktools.demo import import_chapter

    ch00 = import_chapter("00")
    assert ch00.__name__ == "chapters.00_single_device.demo"
    assert Path(ch00.__file__).resolve() == ROOT / "chapters" / "00_single_device" / "demo.py"
    assert import_chapter("00") is ch00
    results = spawn(ch00.init_checksum_worker, 2, ch00.tiny_gpt2(num_layers=2), timeout=240.0)
    for r in results:
        assert bool((r["table"] == r["table"][0]).all())          # every rank: the same weights
        assert r["stage_matches"] and all(r["stage_matches"])
    assert "output_layer.weight" in results[1]["stage_names"]      # the last stage's tied copy


def test_import_chapter_names_a_missing_chapter():
    from booktools.demo import import_chapter

    with pytest.raises(FileNotFoundError, match="chapters/99_"):
        import_chapter("99")


def test_a_torchrun_demo_names_the_sizes_that_do_not_fit_the_ranks(capsys):
    from booktools.demo import data_parallel_size_under_torchrun
    assert data_parallel_size_under_torchrun(8, 0, {"tp": 2, "pp": 2}, None) == 2
    assert data_parallel_size_under_torchrun(16, 0, {"tp": 2, "cp": 2, "pp": 2}, 2) == 2
    assert data_parallel_size_under_torchrun(6, 0, {"tp": 4}, None) is None
    assert "--tp 4 = 4 must divide the number of ranks 6 (dp = ranks / (tp))" in capsys.readouterr().err
    assert data_parallel_size_under_torchrun(8, 0, {"tp": 2, "cp": 2}, 3) is None
    assert "--tp 2 x --cp 2 x --dp 3 = 12 must equal the number of ranks 8" in capsys.readouterr().err
    assert data_parallel_size_under_torchrun(8, 1, {"tp": 3}, None) is None     # only rank 0 speaks
    assert capsys.readouterr().err == ""
