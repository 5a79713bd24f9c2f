"""The training entry's report (minimegatron/run_report.py, `make demo`): the layout table and
the rank grid against parallel_state's groups, the classification of the ledger by dimension,
and one small 5D run whose formula comparisons and check against one device must all hold."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch

from minimegatron.arguments import parse_command_line
from minimegatron.comm.ledger import CommRecord
from minimegatron.config import TrainConfig
from minimegatron.parallel_state import rank_groups
from minimegatron.analysis import rank_parameters, step_communication
from minimegatron.run_report import dimension_of, layout_lines, rank_grid_lines

FIVE_D = ["--preset", "tiny", "--tensor-model-parallel-size", "2", "--sequence-parallel",
          "--context-parallel-size", "2", "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
          "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
          "--micro-batch-size", "1", "--grad-accum-steps", "2"]


def test_the_rank_grid_draws_the_tensor_parallel_groups_and_the_stages_of_parallel_state():
    model, cfg, _ = parse_command_line(FIVE_D, 16)
    lines = rank_grid_lines(cfg, 16)
    groups = rank_groups(16, tp=2, pp=2, cp=2, ep=2, etp=2)
    drawn = [[int(r) for r in cell.split()] for line in lines for cell in re.findall(r"\[([\d ]+)\]", line)
             if line.startswith("  stage")]
    assert sorted(drawn) == sorted(groups["tp"])                 # every tp group once, nothing else
    for stage in range(2):                                        # a row holds its stage's ranks
        row = next(line for line in lines if line.startswith(f"  stage {stage}"))
        assert sorted(int(r) for r in re.findall(r"\d+", row)[1:]) == sorted(g[stage] for g in groups["pp"])
    ep_line = next(line for line in lines if "expert-parallel groups" in line)
    first_stage = {g[0] for g in groups["pp"]}
    assert [[int(r) for r in c.split()] for c in re.findall(r"\[([\d ]+)\]", ep_line)] == \
        [g for g in groups["ep"] if g[0] in first_stage]
    table = "\n".join(layout_lines(model, cfg, 16))
    assert "16 ranks = tp 2 x cp 2 x dp 2 x pp 2; experts: etp 2 x ep 2 x expert-dp 2 x pp 2" in table
    assert "the 2 layers: 1 per stage; 1f1b over 2 micro-batches" in table
    assert "32 tokens in 4 chunks of 8" in table and "8 tokens per rank" in table   # cp's chunks; SP's tokens
    assert "the 4 experts of each MoE layer: 2 per rank" in table


def test_each_record_is_charged_to_its_dimension():
    groups = {"tp": [0, 1], "cp": [0, 2], "dp": [0, 4], "dp-cp": [0, 2, 4, 6], "pp": [0, 8], "ep": [0, 2],
              "etp": [0, 1], "expert-dp": [0, 4]}

    def rec(op, ranks, tag):
        return CommRecord(op, tuple(ranks), 8, torch.float32, (2,), tag)
    assert dimension_of(rec("all_gather", [0, 1], "fwd"), groups) == "tp"
    assert dimension_of(rec("send", [0, 8], "pp-fwd"), groups) == "pp"
    assert dimension_of(rec("all_reduce", [0, 2, 4, 6], "grads"), groups) == "dp"
    assert dimension_of(rec("all_reduce", [0, 4], "expert-grads"), groups) == "expert-dp"
    assert dimension_of(rec("all_to_all", [0, 2], "moe-dispatch"), groups) == "ep"
    assert dimension_of(rec("all_gather", [0, 1], "moe-etp"), groups) == "etp"
    assert dimension_of(rec("all_gather", [0, 2], "fwd"), groups) == "cp"            # cp's group, not ep's tag
    assert dimension_of(rec("all_reduce", [0, 1], "moe-aux"), groups) == "ep"           # the mixture's, on tp's group
    assert dimension_of(rec("all_reduce", [0, 2, 4, 6], "loss"), groups) == "loss and norm"


def test_the_pipeline_formula_counts_each_neighbour():
    model, cfg, _ = parse_command_line(FIVE_D, 16)
    message = 1 * (32 // 2 // 2) * 32 * 4                  # b x s/cp/tp (SP) x h x float32
    want = {0: {("send", "pp-fwd", message): 2, ("recv", "pp-bwd", message): 2},     # M = 2 micro-batches
            1: {("recv", "pp-fwd", message): 2, ("send", "pp-bwd", message): 2}}
    for stage in range(2):
        assert step_communication(model, cfg, 16, stage)["pp"] == want[stage]


@pytest.mark.slow
def test_a_small_5d_run_reports_formulas_that_hold_and_matches_one_device(tmp_path):
    """16 ranks, every dimension 2 (tiny model, 2 steps): the report's formula lines all hold,
    the check against one device says MATCH, the picture is written, the job exits 0."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--rdzv-backend=c10d",
               "--rdzv-endpoint=127.0.0.1:0", "--local-addr=127.0.0.1", "--nproc_per_node=16",
               "-m", "minimegatron.run_report", "--check-steps", "1", *FIVE_D, "--train-iters", "2",
               "--eval-interval", "0", "--no-progress", "--out-dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "DIFFERS" not in out and "MISMATCH" not in out, out[-4000:]
    for dim in ("tp", "cp", "ep", "etp", "dp", "expert-dp", "pp"):      # every dimension, each on its formula
        assert re.search(rf"^  {re.escape(dim)} +\d+ calls +[\d,]+ bytes  = formula on all 16 ranks", out, re.M), \
            (dim, out[-4000:])
    assert "parameters each rank holds: = formula on all 16 ranks" in out
    assert "memory held from step to step (parameters, gradients, AdamW's two moments): = formula on all 16" in out
    assert re.search(r"one micro-batch summed over the 16 ranks: [\d,]+ bytes = [\d.]+ x dp \(2\) x one "
                     r"process's [\d,]+ for the same micro-batch \(measured; within 10%", out), out[-4000:]
    assert "micro-batches held at the peak, stage by stage: 2, 1 = the schedule's warm-up + 1 on all 16 ranks" in out
    assert "MATCH with the single-device run (float64)" in out
    assert (tmp_path / "summary.png").stat().st_size > 10_000


def test_a_formula_that_does_not_hold_is_reported_and_fails_the_run():
    """communication_checks against a rank whose ledger lost one tensor-parallel all-gather and
    whose expert-dp reduction moved one float too many: both named, by rank."""
    model, cfg, _ = parse_command_line(FIVE_D, 16)
    from minimegatron.run_report import communication_checks, report_lines
    gathered = []
    for rank in range(16):
        stage = rank // 8
        records = {dim: want.copy() for dim, want in step_communication(model, cfg, 16, stage).items()}
        params = rank_parameters(model, cfg, stage)
        records["dp"] = {("all_reduce", "grads", params["dense"] * 4): 1}
        records["expert-dp"] = {("all_reduce", "expert-grads", params["experts"] * 4 + 4 * (rank == 5)): 1}
        gathered.append({"pp_rank": stage, "ep_group": [], "pp_group": [], "params": params, "compute": [],
                         "held": {"all": 16 * sum(params.values())}, "records": {k: Counter(v) for k, v in records.items()}})
    gathered[3]["records"]["tp"][next(iter(gathered[3]["records"]["tp"]))] -= 1
    found = communication_checks(model, cfg, gathered)
    assert len(found["tp"]) == 1 and found["tp"][0].startswith("rank 3: unexpected {}, missing")
    assert found["expert-dp"] == [f"rank 5: {rank_parameters(model, cfg, 0)['experts'] * 4 + 4:,} bytes, its "
                                  f"gradients {rank_parameters(model, cfg, 0)['experts'] * 4:,}"]
    assert not any(found[d] for d in found if d not in ("tp", "expert-dp"))
    lines, failed = report_lines(model, cfg, gathered)
    assert failed == 2 and sum("DIFFERS" in line for line in lines) == 2


@pytest.mark.parametrize("kind, pp, m, v", [("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1), ("gpipe", 3, 5, 1),
                                            ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 3)])
def test_the_in_flight_formula_is_the_peak_of_the_simulated_schedule(kind, pp, m, v):
    """in_flight_formula (the warm-up + 1) against the schedule's own op list, replayed."""
    from minimegatron.pp import peak_in_flight
    from minimegatron.pp.schedules import schedule
    from minimegatron.run_report import in_flight_formula
    cfg = TrainConfig(pipeline_model_parallel_size=pp, grad_accum_steps=m, pipeline_schedule=kind,
                      num_virtual_stages_per_pipeline_rank=v)
    for rank in range(pp):
        assert in_flight_formula(cfg, pp, rank) == peak_in_flight(schedule(kind, pp, rank, m, v)), rank


def test_activations_off_their_formulas_fail_the_run():
    """activation_lines: a sum of micro-batch bytes 20% above dp x one device, and a stage that
    held one micro-batch more than its schedule allows, are both reported and counted."""
    from minimegatron.run_report import activation_lines
    cfg = TrainConfig(pipeline_model_parallel_size=2, grad_accum_steps=4, tensor_model_parallel_size=2,
                      sequence_parallel=True)
    gathered = [{"pp_rank": r // 2, "saved": [300, 300], "peak_in_flight": 2 - r // 2, "peak_bytes": 600}
                for r in range(4)]
    lines, failed = activation_lines(cfg, gathered, 1200)
    assert failed == 0 and "1.000 x dp (1)" in lines[0] and "within 10%" in lines[0], lines
    gathered[3]["peak_in_flight"] = 2
    lines, failed = activation_lines(cfg, gathered, 1000)
    assert failed == 2 and "1.200 x dp (1)" in lines[0] and "NOT within 10%" in lines[0], lines
    assert "DIFFERS on ranks [3]" in lines[1], lines
    lines, failed = activation_lines(cfg, gathered, 1200)            # the bytes fine, one stage off
    assert failed == 1 and "within 10%" in lines[0] and "NOT within" not in lines[0], lines


def test_the_recorded_main_job_is_the_command_make_demo_runs():
    """The front page quotes chapter 05's recorded run "make-demo": it must be what `make demo`
    runs with its defaults (make -n prints the recipe without running it)."""
    from booktools.demo import ROOT, import_chapter
    recorded = import_chapter("05", "make_figures").RUNS["make-demo"]
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}   # under make test
    done = subprocess.run(["make", "--no-print-directory", "-n", "-W", ".venv/.installed", "demo"], cwd=ROOT,
                          capture_output=True, text=True, check=True, env=env)
    recipe = " ".join(done.stdout.replace("\\\n", " ").split())
    assert "--nproc_per_node=16" in recipe and "-m minimegatron.run_report" in recipe, recipe
    # the shell splits the words and works out the recipe's $((...)) as make demo's shell does
    words = subprocess.run(["bash", "-c", 'printf "%s\\n" ' + recipe.split("-m minimegatron.run_report", 1)[1]],
                           capture_output=True, text=True, check=True).stdout.split()
    assert words == recorded.split("-m minimegatron.run_report", 1)[1].split(), (words, recorded)


def test_under_zero_3_a_rank_holds_its_shards():
    """ZeRO-3 (dp/fsdp.py) holds a 1/D shard of each unit: D x the shards equals the formula
    plus the padding, under D elements a unit."""
    from minimegatron.run_report import _holds_its_parameters
    model_cfg, cfg, _ = parse_command_line(["--preset", "tiny", "--zero-stage", "3"], world_size=4)
    sizes = {"dp": 4, "cp": 1}
    dense = rank_parameters(model_cfg, cfg, 0)["dense"]
    shard = -(-dense // 4)
    assert _holds_its_parameters(model_cfg, cfg, {"pp_rank": 0, "params": {"dense": shard, "experts": 0}}, sizes)
    assert not _holds_its_parameters(model_cfg, cfg, {"pp_rank": 0, "params": {"dense": shard // 2, "experts": 0}},
                                     sizes)
    assert not _holds_its_parameters(model_cfg, cfg, {"pp_rank": 0, "params": {"dense": dense, "experts": 0}}, sizes)


def test_the_step_record_counts_the_activations_under_zero_3_too():
    """ZeRO-3's wrapper runs saved-tensor hooks of its own, which shadow the step record's; it
    hands what it keeps to observe_saved_tensors, so the record counts the same bytes as for the
    unwrapped model (one process, a world of one: every unit gathered whole)."""
    from minimegatron.dp import FullyShardedDataParallel
    from minimegatron.launch import init_from_torchrun
    from minimegatron.model import GPTModel
    from minimegatron.pp.timeline import StepRecord
    import torch.distributed as dist
    mine = not dist.is_initialized()
    init_from_torchrun()                         # a world of one, in memory; gone again below
    try:
        model_cfg, _, _ = parse_command_line(["--preset", "tiny"], world_size=1)
        torch.manual_seed(0)
        model = GPTModel(model_cfg)
        tokens = torch.randint(0, model_cfg.vocab_size, (2, 16))
        counted = []
        for wrap in (False, True):               # (the wrapper lays the weights out anew: built second)
            wrapped = FullyShardedDataParallel(model, None) if wrap else model
            record = StepRecord(params={p.untyped_storage().data_ptr() for p in wrapped.parameters()})
            with record.saving(0, 0):
                loss = wrapped(tokens, labels=tokens).mean()
            counted.append(record.saved_bytes[(0, 0)])
            del loss
    finally:
        if mine:
            dist.destroy_process_group()
    assert counted[0] > 0 and counted[1] == counted[0], counted


def test_without_sequence_parallelism_the_activation_sum_is_reported_not_compared():
    """Under tp without SP each tp rank keeps the whole [b, s, h] tensors outside attention and
    the MLP, so the sum over ranks exceeds dp x one device: reported, not a failure; with SP the
    same sum fails the check."""
    from minimegatron.run_report import activation_lines
    ranks = [{"pp_rank": 0, "saved": [1283], "peak_in_flight": 1, "peak_bytes": 1283}] * 2      # tp 2, dp 1
    for sp, fails in ((False, 0), (True, 1)):
        cfg = TrainConfig(tensor_model_parallel_size=2, sequence_parallel=sp, seq_length=16, micro_batch_size=2)
        lines, failed = activation_lines(cfg, ranks, 2000)
        assert failed == fails, lines
        assert ("not compared" in lines[0]) == (not sp), lines[0]
