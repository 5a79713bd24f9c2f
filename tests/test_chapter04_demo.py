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

from minimegatron.config import ConfigError
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
        # [3/4] sets a first-stage rank beside the same stage on one device: with everything cut
        # (SP, or no TP) it holds about 1 / (tp cp) of it, pipeline stages or not (a rank of stage
        # 0 against the whole model would be about 1 / (tp cp pp))
        m = report.memory
        if run.sp or run.tp == 1:
            assert 0.8 < m["single"] / m["parallel"] / (run.tp * run.cp) < 1.25, (run.name(), m)


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


def test_a_ledger_that_differs_from_the_formula_is_a_mismatch():
    run = ch04.make_run(LLAMA, cp=2, micro_batches=1, steps=1)
    per_rank = spawn(ch04.train_run, 2, run, timeout=180)
    assert ch04.check_run(run, per_rank).ok
    ring = per_rank[1]["ledger"].index(("send", "fwd", 2 * 2 * 16 * 2 * 8 * 8))   # 2 kv: b s/cp g d e
    del per_rank[1]["ledger"][ring]                                            # cp rank 1: a ring step lost
    report = ch04.check_run(run, per_rank)
    assert not report.ok and any(p.startswith("stage 0 cp rank 1: ledger differs") for p in report.problems)
    assert ch04.summary_line([report]).startswith("MISMATCH")


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
    assert ("--cp-comm-type a2a with --cp 2: each rank runs whole heads after the all-to-all, so --cp must divide "
            "the 2 query heads and 1 key/value groups of a tensor-parallel rank; use --cp-comm-type p2p or "
            "all_gather") in proc.stderr
    assert "Traceback" not in proc.stderr


def _refusal(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        ch04.build_run(ch04.parse_args(argv), 1)
    return str(info.value)


def test_a_context_parallel_setting_that_cannot_run_names_one_that_can(monkeypatch):
    """In this demo's flags, with a setting that works: the suggestion is built and validated
    (parallelize.validate_layout) to prove it."""
    monkeypatch.delenv("RANK", raising=False)
    # --cp 4 a2a: 4 does not divide LLaMA's 2 key/value groups; a2a in pairs and a ring of 2 does
    message = _refusal(["--cp", "4", "--cp-comm-type", "a2a"])
    assert "--cp must divide the 4 query heads and 2 key/value groups" in message
    assert "--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2" in message
    ch04.build_run(ch04.parse_args(["--cp", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
                                    "2", "2"]), 1)
    # all-to-all groups of 4 at cp 8: the pairs work, with a ring of 4
    message = _refusal(["--cp", "8", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "4", "2"])
    assert "the all-to-all size 4 must divide" in message and "--hierarchical-context-parallel-sizes 2 4" in message
    ch04.build_run(ch04.parse_args(["--cp", "8", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
                                    "2", "4"]), 1)
    # a hierarchy with a level of one rank is the plain kind under another name
    message = _refusal(["--cp", "2", "--cp-comm-type", "a2a+p2p"])
    assert "--hierarchical-context-parallel-sizes 2 1 (this demo's default for --cp 2" in message
    assert "plain a2a" in message and "use --cp-comm-type a2a" in message
    message = _refusal(["--cp", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "1", "4"])
    assert "plain p2p" in message and "--hierarchical-context-parallel-sizes 2 2 for both levels" in message
    # --cp 3: 64 tokens do not cut into 6 chunks; 60 do
    message = _refusal(["--cp", "3"])
    assert "the default sequence length 64" in message and "--seq 60 works" in message
    assert ch04.build_run(ch04.parse_args(["--cp", "3", "--seq", "60"]), 1).train.seq_length == 60


def test_the_memory_line_sets_each_saving_beside_its_own_numbers():
    """[3/4]: the measured saving of SP from the two measured numbers, Korthikanti's from his
    two; ratios against one device of the same kind (numbers chosen here, arithmetic by hand)."""
    m = {"parallel": 300, "without_sp": 400, "single": 600, "stage": "the whole model",
         "korthikanti_one": 1000, "korthikanti_tp": 800, "korthikanti_sp": 520}
    lines = "\n".join(ch04.memory_lines(ch04.make_run(LLAMA, tp=2, sp=True), m))
    assert "this rank 300 bytes; the same on one device 600 bytes: ratio 2.00 (tp x cp = 2, with SP)" in lines
    assert "without sequence parallelism 400 bytes (ratio 1.50): SP saves 25% of them" in lines   # 1 - 300/400
    assert "TP 800 (ratio 1.25), TP + SP 520 (ratio 1.92): SP saves 35% of them" in lines        # 1 - 520/800


def test_the_first_stage_is_set_beside_the_same_stage_on_one_device():
    """With pp = 2 the one-device reference is stage 0 (2 of 4 layers and the embedding, no output
    layer or loss): what a 2-layer whole model saves minus what analysis.activation_memory counts
    for the parts after the last layer (the final norm, the output layer's input, the loss's
    log-probabilities and labels)."""
    from minimegatron.analysis.activations import activation_memory

    for style in ("llama", "gpt2"):
        two = ch04.single_stage_memory(ch04.make_run(ch04.tiny_model(style), cp=2))
        stage = ch04.single_stage_memory(ch04.make_run(ch04.tiny_model(style, num_layers=4), cp=2, pp=2))
        after = activation_memory(ch04.tiny_model(style), 2, 32)["outside_layers"]
        assert two["single"] - stage["single"] == sum(after[k] for k in ("final_norm", "output_input", "log_softmax",
                                                                         "labels"))
        assert stage["stage"] == "the first of 2 stages: layers 0-1 of 4 and the embedding"


def test_the_load_balance_line_is_this_runs():
    """[4/4] counts the run's own s and cp, and marks the cut it used: s = 32, cp = 2, chunks of
    8; contiguous rank 0 holds positions 0..15 (1 + ... + 16 = 136 unmasked scores), rank 1
    16..31 (17 + ... + 32 = 392); zig-zag pairs chunks 0 and 3, 1 and 2: 264 each."""
    zigzag, contiguous = (ch04.balance_lines(ch04.make_run(LLAMA, cp=2, load_balance=b)) for b in (True, False))
    assert zigzag[0].endswith("s = 32, cp = 2:")
    assert "zig-zag (this run)" in zigzag[1] and "264, 264: max/mean 1.000" in zigzag[1]
    assert "contiguous" in zigzag[2] and "136, 392: max/mean 1.485" in zigzag[2] and "this run" not in zigzag[2]
    assert "contiguous (this run)" in contiguous[2]
    assert "nothing to balance" in ch04.balance_lines(ch04.make_run(LLAMA, tp=2, sp=True))[0]
