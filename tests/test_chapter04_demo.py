"""The chapter-04 experiment (chapters/04_sp_cp/demo.py) on spawned ranks: every layout of the
issue equals the single-device run (losses, first-step gradients, final parameters), and its
ledger equals the formulas message by message: TP 2 and 4 with SP, CP 2 and 4 with each
cp_comm_type, an odd CP (3), CP x DP and TP+SP x DP (with ZeRO-1), TP+SP x CP, CP x PP, the
contiguous cut; and
TP+SP x CP (2 x 2 on 4 ranks) under torchrun (chapter 05's test runs 5D on 16). A layout that cannot run
stops before any rank starts."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minimegatron.launch import spawn
from booktools.demo import import_chapter

ROOT = Path(__file__).resolve().parents[1]
DEMO = "chapters/04_sp_cp/demo.py"
ch04 = import_chapter("04")
LLAMA, GPT2 = ch04.tiny_model("llama"), ch04.tiny_model("gpt2")      # llama: RoPE, 2 KV groups; gpt2: biases


def _check(runs, per_rank_runs):
    for i, run in enumerate(runs):
        report = ch04.check_run(run, [rank[i] for rank in per_rank_runs])
        assert report.ok, f"{run.name()}:\n{report}"
        assert report.equivalence.max_loss_diff <= report.equivalence.tolerance.loss


@pytest.mark.slow
def test_two_ranks_sp_and_every_cp_comm_type():
    runs = [ch04.make_run(LLAMA, tp=2, sp=True),
            ch04.make_run(ch04.tiny_model("gpt2", "float32"), tp=2, sp=True),     # float32: realistic tolerance
            *[ch04.make_run(LLAMA, cp=2, cp_comm_type=kind) for kind in ("p2p", "all_gather", "a2a")],
            ch04.make_run(LLAMA, cp=2, load_balance=False)]                         # the contiguous cut
    _check(runs, spawn(ch04.train_runs, 2, runs, timeout=300))


@pytest.mark.slow
def test_four_ranks_tp4_sp_cp4_and_compositions():
    runs = [ch04.make_run(GPT2, tp=4, sp=True),
            *[ch04.make_run(LLAMA, cp=4, cp_comm_type=kind) for kind in ("p2p", "all_gather", "a2a+p2p")],
            ch04.make_run(GPT2, cp=4, cp_comm_type="a2a"),                        # 4 heads, 4 groups: a2a at cp 4
            ch04.make_run(LLAMA, cp=4, cp_comm_type="a2a+p2p", load_balance=False),
            ch04.make_run(LLAMA, cp=2, dp=2, zero_stage=1),
            ch04.make_run(LLAMA, tp=2, sp=True, dp=2, zero_stage=1),              # SP's norm sums with ZeRO-1
            ch04.make_run(LLAMA, tp=2, sp=True, cp=2),
            ch04.make_run(ch04.tiny_model("llama", num_layers=4), cp=2, pp=2)]
    _check(runs, spawn(ch04.train_runs, 4, runs, timeout=400))


@pytest.mark.slow
def test_an_odd_context_parallel_size():
    runs = [ch04.make_run(LLAMA, cp=3, seq=48, cp_comm_type=kind) for kind in ("p2p", "all_gather")]
    _check(runs, spawn(ch04.train_runs, 3, runs, timeout=300))


def test_sequence_parallelism_moves_the_bytes_of_tensor_parallelism():
    """From the formulas (no ranks): per step, the reduce-scatters and all-gathers of SP put on
    the wire what TP's all-reduces put there; the backward's re-gathers come on top."""
    for model in (LLAMA, GPT2):
        wire = ch04.sp_against_tp(ch04.make_run(model, tp=2, sp=True))
        assert wire["same"] and wire["regather"] > 0
    # an all-reduce of n bytes on a ring of 2 sends 2 (2-1)/2 n = n bytes: 2 all-reduces per layer
    # forward and 2 backward, 2 layers, embedding 1, output layer 1, 2 micro-batches of 2 x 32 x 32 x 8
    # bytes, plus 3 x 2 small loss all-reduces of 2 x 32 x 8 bytes per micro-batch
    x = 2 * 32 * 32 * 8
    assert ch04.sp_against_tp(ch04.make_run(LLAMA, tp=2, sp=True))["tp"] == 2 * (10 * x + 3 * 2 * 32 * 8)


def test_load_balance_of_the_two_layouts():
    # contiguous: the last rank's work over the mean is (2 cp - 1) / cp for large s; zig-zag: 1
    for cp, contiguous, zigzag in ch04.load_balance((2, 4, 8), seq=4096):
        assert abs(contiguous - (2 * cp - 1) / cp) < 1e-3 and abs(zigzag - 1) < 1e-3


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun is not installed next to this Python")
def test_tp_cp_under_torchrun_on_4_ranks_matches_and_exits_0():
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([torchrun, "--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                           "--local-addr=127.0.0.1", "--nproc_per_node=4", DEMO, "--quick", "--tp", "2", "--sp",
                           "--cp", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("MATCH: tp=2+sp x cp=2 (p2p) x dp=1"), last
    assert "DIFFERENT" not in proc.stdout


def test_an_impossible_layout_fails_before_any_rank_starts():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, DEMO, "--cp", "2", "--cp-comm-type", "a2a", "--tp", "2", "--sp"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "num_query_groups per tensor-parallel rank = 1 is not divisible by the all-to-all size 2" in proc.stderr
