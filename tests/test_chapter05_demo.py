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


def test_a_dispatch_that_differs_from_the_formula_is_a_mismatch():
    run = ch05.make_run(MOE, ep=2, dp=2, micro_batches=1, steps=1)
    per_rank = spawn(ch05.train_run, 2, run, timeout=180)
    assert ch05.check_run(run, per_rank).ok
    counts = per_rank[0]["ledger"].index(("all_to_all", "moe-counts", 8 * 4))    # E int64 counts
    del per_rank[0]["ledger"][counts]                                         # rank 0: one exchange lost
    report = ch05.check_run(run, per_rank)
    assert not report.ok and any(p.startswith("stage 0, rank 0: messages differ") for p in report.problems)
    assert "DIFFERENT from the formula" in str(report)
    assert ch05.summary_line([report]).startswith("MISMATCH")


def test_figure_5_1_shows_the_shares_of_the_layer_its_imbalance_curve_ends_on():
    """load_balance's "final" shares (Figure 5.1's middle panel) are those of "final_layer", the
    layer whose max / mean is the largest after the last step: the value the imbalance curve
    (the left panel, the worst layer at each step) ends on. With one step the two tiny MoE
    layers differ, so shares taken from a fixed layer would not reproduce it."""
    for name, r in ch05.load_balance(steps=1).items():
        shares, experts = r["final"], len(r["final"])
        assert abs(sum(shares) - 1) < 1e-6, name
        assert r["final_layer"] in (0, 1), name
        # max / mean tokens per expert = the largest share over the mean share 1 / E
        assert abs(max(shares) * experts - r["imbalance"][-1]) < 1e-4, (name, shares, r["imbalance"])


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
    """Refused in this demo's flags before any rank starts (one subprocess: the exit status
    and stderr of the real command line; the other refusals are checked in process)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, DEMO, "--quick", "--tp", "2", "--ep", "2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: --tp 2 without --sp:") and "add --sp" in proc.stderr, proc.stderr
    assert "--sequence-parallel" not in proc.stderr and "Traceback" not in proc.stderr


def test_the_flags_decide_the_experts_before_any_rank_starts(monkeypatch):
    from minimegatron.config import ConfigError

    monkeypatch.delenv("RANK", raising=False)

    def refusal(argv):
        args = ch05.parse_args(argv)
        with pytest.raises(ConfigError) as info:
            ch05.build_run(args, ch05.spawn_data_parallel_size(args))
        return str(info.value)

    assert "--ep 3 must divide --num-experts 4" in refusal(["--ep", "3", "--num-experts", "4"])
    assert "--etp 2 x --ep 2 x --pp 1 = 4 must divide the 3 ranks" in refusal(["--etp", "2", "--dp", "3"])
    assert "--etp 2 (its default: --tp)" in refusal(["--tp", "2", "--sp", "--dp", "1"])
    assert "--seq 60 works" in refusal(["--cp", "3"])
    # without --dp the demo picks the smallest dp whose ranks tp cp dp the experts' grid etp ep divides
    for argv, dp in ((["--cp", "3"], 2), (["--tp", "2", "--sp", "--etp", "1"], 1), (["--etp", "2"], 4), ([], 2)):
        args = ch05.parse_args(argv)
        grid, ranks = args.ep * (args.etp or args.tp), args.tp * args.cp
        assert ch05.spawn_data_parallel_size(args) == dp
        assert (ranks * dp) % grid == 0 and all((ranks * d) % grid for d in range(1, dp))
    # without --num-experts: the smallest multiple of --ep that is at least 4
    assert ch05.build_run(ch05.parse_args(["--ep", "3"]), 3).model.num_experts == 6


@pytest.mark.slow
def test_one_rank_with_ep_1_matches_and_holds_every_expert(monkeypatch):
    """--quick --ep 1 on one rank: nothing is exchanged and apply_expert_parallel leaves the
    experts unmarked; the rank still holds all of them, 2 layers x 4 experts x (fc1 [2 x 32, 32]
    + fc2 [32, 32]) elements. [2/4]'s table shows the ep sizes the 4 experts allow (2 and 4)."""
    monkeypatch.delenv("RANK", raising=False)
    run = ch05.build_run(ch05.parse_args(["--quick", "--ep", "1"]), 1)
    report = ch05.check_run(run, spawn(ch05.train_run, 1, run, timeout=240))
    assert report.ok, str(report)
    assert report.memory[0][1] == 2 * 4 * (2 * 32 * 32 + 32 * 32)
    text = str(report)
    assert "ep= 2:" in text and "ep= 4:" in text and "ep= 8" not in text and "ep=16" not in text
    assert ch05.expert_parallel_sizes(4) == [2, 4] and ch05.expert_parallel_sizes(6) == [2, 3, 6]
