"""Every chapter demo runs, ends with its verdict, and exits non-zero on a mismatch."""

import os
import re
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


def test_a_torchrun_demo_names_the_sizes_that_do_not_fit_the_ranks():
    from booktools.demo import data_parallel_size_under_torchrun
    from minimegatron.config import ConfigError
    assert data_parallel_size_under_torchrun(8, {"tp": 2, "pp": 2}, None) == 2
    assert data_parallel_size_under_torchrun(16, {"tp": 2, "cp": 2, "pp": 2}, 2) == 2
    with pytest.raises(ConfigError, match=re.escape("--tp 4 = 4 must divide the number of ranks 6 (dp = ranks / (tp))")):
        data_parallel_size_under_torchrun(6, {"tp": 4}, None)
    with pytest.raises(ConfigError, match=re.escape("--tp 2 x --cp 2 x --dp 3 = 12 must equal the number of ranks 8")):
        data_parallel_size_under_torchrun(8, {"tp": 2, "cp": 2}, 3)


def test_a_sequence_length_that_does_not_cut_names_one_that_does():
    """check_sequence_length's suggestion is checked against the rules themselves: s a multiple
    of 2 cp, s / cp a multiple of tp under SP, at most the model's positions."""
    from booktools.demo import check_sequence_length
    from minimegatron.config import ConfigError

    def suggestion(seq, **sizes):
        with pytest.raises(ConfigError) as info:
            check_sequence_length(seq, max_positions=64, **sizes)
        return str(info.value), int(re.search(r"--seq (\d+) works", str(info.value)).group(1))

    message, works = suggestion(64, cp=3)                           # 64 is not a multiple of 6
    assert "--cp 3 cuts every sequence into 2 x 3 = 6 equal chunks" in message
    assert works == 60 and works % 6 == 0
    check_sequence_length(works, cp=3, max_positions=64)            # the suggestion runs
    message, works = suggestion(64, cp=2, tp=3, sp=True)            # chunks of 4, and s / 2 cut into 3
    assert "--tp 3" in message and works % 4 == 0 and (works // 2) % 3 == 0 and works == 60
    message, works = suggestion(70, tp=2, sp=True)                  # too long for 64 positions
    assert "longer than the model's 64 positions" in message and works == 64
    message, works = suggestion(4, cp=3)                            # nothing shorter: the shortest above
    assert works == 6
    with pytest.raises(ConfigError, match="the default sequence length 32"):
        check_sequence_length(32, cp=3, max_positions=64, given=False)
    with pytest.raises(ConfigError, match="no multiple of 128 fits the model's 64 positions; use a smaller --cp"):
        check_sequence_length(64, cp=64, max_positions=64)
    check_sequence_length(64, cp=4, tp=2, sp=True, max_positions=64)


# every demo: a value its flag's default would replace (`args.steps or 3`) is refused, not swapped
ZERO_OR_NEGATIVE = [("00", ["--train-iters", "0"]), ("01", ["--steps", "0"]), ("02", ["--steps", "0"]),
                    ("03", ["--steps", "0"]), ("04", ["--steps", "0"]), ("04", ["--seq", "0"]),
                    ("05", ["--steps", "0"]), ("05", ["--seq", "0"]), ("05", ["--num-experts", "0"]),
                    ("05", ["--dp", "0"]), ("05", ["--etp", "0"]), ("05", ["--balance-steps", "-1"])]


@pytest.mark.parametrize("chapter,argv", ZERO_OR_NEGATIVE, ids=[f"{c}{' '.join(a)}" for c, a in ZERO_OR_NEGATIVE])
def test_a_value_the_default_would_replace_is_refused(chapter, argv, capsys):
    from booktools.demo import import_chapter

    with pytest.raises(SystemExit) as info:
        import_chapter(chapter).parse_args(argv)
    assert info.value.code == 2
    assert f"{argv[0]}={argv[1]} must be at least" in capsys.readouterr().err


# bad layouts that reach each demo's build, without torchrun (none of them starts a rank)
BAD_LAYOUTS = [("02", ["--tp", "3"]),
               ("03", ["--pp", "2", "--schedule", "interleaved", "--micro-batches", "3"]),
               ("04", ["--cp", "3"]), ("04", ["--cp", "4", "--cp-comm-type", "a2a"]),
               ("04", ["--cp", "2", "--cp-comm-type", "a2a+p2p"]), ("04", ["--cp", "2", "--seq", "66"]),
               ("04", ["--tp", "2", "--sp", "--cp", "2", "--cp-comm-type", "a2a"]), ("04", ["--sp"]),
               ("05", ["--tp", "2"]), ("05", ["--tp", "2", "--ep", "4"]), ("05", ["--ep", "3", "--num-experts", "4"]),
               ("05", ["--ep", "2", "--etp", "2", "--dp", "3"]), ("05", ["--cp", "3"]), ("05", ["--shared-expert", "0"])]


@pytest.mark.parametrize("chapter,argv", BAD_LAYOUTS, ids=[f"{c}{' '.join(a)}" for c, a in BAD_LAYOUTS])
def test_an_error_names_only_flags_of_the_demo_that_raised_it(chapter, argv, capsys, monkeypatch):
    """Every --flag an error message names is one of the demo's own (its --help lists them) or
    torchrun's: no hint to add a flag of another program (the training entry's
    --sequence-parallel where the demo's flag is --sp)."""
    from booktools.demo import import_chapter

    monkeypatch.delenv("RANK", raising=False)
    demo = import_chapter(chapter)
    with pytest.raises(SystemExit):
        demo.parse_args(["--help"])
    flags = set(re.findall(r"--[a-z][a-z0-9-]*", capsys.readouterr().out)) | {"--nproc_per_node"}
    assert demo.main(argv + ["--quick"]).exit_code == 2
    error = capsys.readouterr().err
    assert error.startswith("error: "), error
    named = set(re.findall(r"--[a-z][a-z0-9_-]*", error))
    assert named <= flags, f"{named - flags} are not flags of chapter {chapter}'s demo: {error}"


TORCHRUN = str(Path(sys.executable).parent / "torchrun")


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun is not installed next to this Python")
def test_under_torchrun_a_configuration_error_is_printed_once():
    """Two ranks find the same error; rank 0 alone prints it, every rank exits 2, and torchrun's
    summary names it as the root cause: an error found building the run, and one of the flags."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for argv, error in ((["chapters/05_ep_moe/demo.py", "--quick", "--tp", "2"], "error: --tp 2 without --sp"),
                        (["chapters/04_sp_cp/demo.py", "--steps", "0"], "error: --steps=0 must be at least 1")):
        proc = subprocess.run([TORCHRUN, "--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                               "--local-addr=127.0.0.1", "--nproc_per_node=2", *argv],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and "MATCH" not in proc.stdout
        printed = [line for line in proc.stderr.splitlines() if error in line and "traceback :" not in line]
        assert len(printed) == 1, proc.stderr                      # once, not once per rank
        codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr))
        assert "2" in codes and codes <= {"2", "-15"}, proc.stderr  # -15: torchrun stopped a rank that was exiting
        root_cause = proc.stderr.split("Root Cause")[-1]
        assert f"traceback : {error}" in root_cause or f"traceback : {argv[0]}: {error}" in root_cause, proc.stderr
