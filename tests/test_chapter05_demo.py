"""The chapter-05 experiment (chapters/05_ep_moe/demo.py) on spawned ranks: every expert layout
of the issue equals the single-device run (losses with the auxiliary losses in the backward,
first-step gradients with the router's, final parameters), its dispatcher's messages equal the
formulas, and each rank holds the experts and the Adam state the formula says: EP 2 and 4 with
each dispatcher, an EP that is not a power of two (3, with 6 experts), EP x ETP, EP x expert-DP,
capacity with dropped tokens, the expert bias, a shared expert, ZeRO-1, TP+SP, CP and PP with EP; and
5D (TP x CP x EP x DP x PP on 16 ranks) under torchrun. A layout that cannot run stops before
any rank starts."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minimegatron.launch import spawn
from booktools.demo import import_chapter

ROOT = Path(__file__).resolve().parents[1]
DEMO = "chapters/05_ep_moe/demo.py"
ch05 = import_chapter("05")
MOE = ch05.tiny_moe()                     # 4 experts, top-2, aux and z losses on, float64


def _check(runs, per_rank_runs):
    for i, run in enumerate(runs):
        report = ch05.check_run(run, [rank[i] for rank in per_rank_runs])
        assert report.ok, f"{run.name()}:\n{report}"


@pytest.mark.slow
def test_four_ranks_every_expert_layout():
    runs = [ch05.make_run(MOE, ep=4, dp=4),                                         # expert-dp 1
            ch05.make_run(MOE, ep=4, dp=4, dispatcher="allgather"),
            # ep 2 x expert-dp 2, an expert keeps ceil(T k / E) of its pairs: some are dropped
            ch05.make_run(ch05.tiny_moe(moe_expert_capacity_factor=1.0), ep=2, dp=4),
            # TP+SP: the experts unsplit (etp 1, expert-dp 2), the shared expert cut over tp; the
            # per-sequence loss, each sequence's tokens split over the tp pair
            ch05.make_run(ch05.tiny_moe(moe_shared_expert_intermediate_size=32,
                                        moe_router_load_balancing_type="seq_aux_loss"),
                          tp=2, sp=True, ep=2, etp=1, dp=2),
            ch05.make_run(MOE, tp=2, sp=True, ep=2, etp=2, dp=2),                   # EP x ETP
            # ZeRO-1: dense state sharded over dp 4, the experts' over their expert-dp pair
            ch05.make_run(MOE, ep=2, dp=4, zero_stage=1),
            ch05.make_run(MOE, tp=2, sp=True, ep=2, etp=2, dp=2, dispatcher="allgather"),
            # CP: each rank routes half of every sequence; sigmoid scores with the expert bias
            ch05.make_run(ch05.tiny_moe(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                        moe_router_bias_update_rate=1e-2), cp=2, ep=2, dp=2),
            ch05.make_run(ch05.tiny_moe(num_layers=4, moe_layer_freq=2, moe_router_load_balancing_type="seq_aux_loss"),
                          pp=2, ep=2, dp=2, micro_batches=4)]
    per_rank = spawn(ch05.train_runs, 4, runs, timeout=500)
    _check(runs, per_rank)
    # the capacity run did drop pairs (its micro-batches routed by the same initial router), and
    # the expert bias did move (and matched the single device's: check_run compares it)
    first = runs[2].global_batches()[0]["tokens"][:2]
    assert ch05.dropped_fraction(ch05.GPTModel(MOE), first, 1.0) > 0
    bias = per_rank[0][7]["params"]["decoder.layers.0.mlp.router.expert_bias"]
    assert bias.abs().max() > 0


@pytest.mark.slow
def test_an_expert_parallel_size_that_is_not_a_power_of_two():
    runs = [ch05.make_run(ch05.tiny_moe(num_experts=6), ep=3, dp=3)]
    _check(runs, spawn(ch05.train_runs, 3, runs, timeout=300))


def test_the_dispatch_formulas_and_the_two_dispatchers_volumes():
    """From the formulas (no ranks): the all-to-all moves T k h e per rank and MoE layer, the
    all-gather every token of the group; past small ep the all-gather receives more."""
    run = ch05.make_run(MOE, ep=2, dp=2)
    T, h, e = 2 * 32, 32, 8                              # 2 sequences of 32 tokens, float64
    want = ch05.expected_dispatch(run)
    assert want[("all_to_all", "moe-dispatch", T * 2 * h * e)] == 2 * 2       # 2 layers x 2 micro-batches
    v2, v8 = (ch05.dispatcher_volumes(T, h, 4, 2, ep, e) for ep in (2, 8))
    assert v2["alltoall"] == 2 * T * 2 * h * e / 2                            # half of the rows stay home
    assert v8["allgather"] > 4 * v8["alltoall"]
    assert ch05.expert_elements_per_rank(run) == 2 * 2 * (2 * 32 * 32 + 32 * 32)   # 2 layers x 2 experts


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun is not installed next to this Python")
def test_5d_under_torchrun_on_16_ranks_matches_and_exits_0():
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([torchrun, "--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                           "--local-addr=127.0.0.1", "--nproc_per_node=16", DEMO, "--quick", "--tp", "2", "--sp",
                           "--cp", "2", "--ep", "2", "--pp", "2", "--dp", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("MATCH: tp=2+sp x cp=2 x ep=2 (alltoall) x etp=2 x pp=2 x dp=2 x expert-dp=2"), last
    assert "DIFFERENT" not in proc.stdout


def test_an_impossible_layout_fails_before_any_rank_starts():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for argv, words in ((["--ep", "3"], "num_experts=4 is not divisible by expert_model_parallel_size=3"),
                        (["--tp", "2", "--ep", "2"], "needs sequence_parallel")):
        proc = subprocess.run([sys.executable, DEMO, "--quick", "--num-experts", "4", *argv], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr
