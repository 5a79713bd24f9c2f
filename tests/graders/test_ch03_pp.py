"""Graders of chapter 03, pipeline parallelism: the schedules (3.1), the stage partition (3.2),
the bubble formula (3.3) and the spot-the-bug tied-embedding gradient sync (3.4).

Oracles, strongest first: a real pipeline on 4 spawned ranks running with your function
inside (`spawn(plugged(ch03.train_runs, id))`) trains exactly like the single-device run
(float64, AdamW, clipping active; `check_run` of chapters/03_pp/demo.py); orders written by hand from
Megatron-LM's documented rules; the unit-cost simulation of the schedules (pp/timeline.py),
which does not use the formula; your function equals the book's on many random inputs; and the
ledger (which collectives ran, over which group).
"""

from __future__ import annotations

import random

import pytest

from minimegatron.comm import record_communication
from minimegatron.config import ConfigError
from booktools.exercises import implementation, plugged
from minimegatron.launch import spawn
from minimegatron.model import GPTModel
from minimegatron.pp.timeline import idle_fraction, simulate
from booktools.demo import import_chapter

ch03 = import_chapter("03")          # chapters/03_pp/demo.py: the chapter's runs and their checks

WORLD = 4


def _check(runs, per_rank) -> None:
    """The headline names the first thing that is wrong: a run can match the single-device losses
    and still break its schedule (an off-by-one warm-up holds one micro-batch too many)."""
    for i, run in enumerate(runs):
        report = ch03.check_run(run, [r[i] for r in per_rank])
        if report.ok:
            continue
        what = f"{run.kind} pp={run.pp} dp={run.dp} v={run.num_chunks} with your function inside"
        if report.equivalence.ok:
            headline = (f"{what} trains like one device but does not run the schedule: {report.problems[0]}"
                        + (f" (and {len(report.problems) - 1} more problems)" if len(report.problems) > 1 else ""))
        else:
            headline = f"{what} does not train like one device: {report.equivalence.problems[0]}"
        raise AssertionError(f"{headline}\n{report.equivalence}\n" + "\n".join(report.problems[:6]))


def compact(ops):
    return " ".join(f"{op}{mb}" + (f".{c}" if any(x[2] for x in ops) else "") for op, mb, c in ops)


# --------------------------------------------------------------------------------------
# 3.1 the schedules
# --------------------------------------------------------------------------------------
@pytest.mark.exercise("3.1")
def test_schedule_orders_by_hand():
    schedule = implementation("3.1")
    cases = {   # written from the rules: warm-up pp - r - 1 (1F1B); interleaved: groups of pp micro-batches,
                # warm-up min(2 (pp - r - 1) + (v - 1) pp, v m), no special case for m == pp
        ("gpipe", 3, 1, 3, 1): "F0 F1 F2 B0 B1 B2",
        ("1f1b", 4, 0, 6, 1): "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
        ("1f1b", 4, 3, 6, 1): "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
        ("1f1b", 4, 0, 2, 1): "F0 F1 B0 B1",
        ("interleaved", 2, 0, 4, 2): "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0",
        ("interleaved", 2, 0, 2, 2): "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0",        # w = min(4, 4)
        ("interleaved", 2, 1, 2, 2): "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 B1.0",        # w = 2
    }
    for args, want in cases.items():
        got = compact(schedule(*args))
        assert got == want, f"schedule{args}:\n  got      {got}\n  expected {want}"


@pytest.mark.exercise("3.1")
def test_schedules_are_complete_runnable_and_the_books_on_random_inputs():
    schedule, reference = implementation("3.1"), implementation("3.1", "reference")
    rng = random.Random(3)
    for _ in range(60):
        kind = rng.choice(["gpipe", "1f1b", "interleaved"])
        pp = rng.randint(2 if kind == "interleaved" else 1, 5)
        v = rng.randint(2, 3) if kind == "interleaved" else 1
        m = pp * rng.randint(1, 3) if kind == "interleaved" else rng.randint(1, 9)
        for r in range(pp):
            got = schedule(kind, pp, r, m, v)
            assert got == reference(kind, pp, r, m, v), f"schedule({kind!r}, {pp}, {r}, {m}, {v}) = {compact(got)}"
    with pytest.raises(ValueError) as info:              # the spec: the message names both numbers
        schedule("interleaved", 4, 0, 6, 2)
    assert "num_microbatches=6" in str(info.value) and "pp_size=4" in str(info.value), str(info.value)


@pytest.mark.exercise("3.1")
def test_a_pipeline_running_your_schedules_trains_like_one_device():
    runs = [ch03.make_run(ch03.tiny_model("gpt2"), pp=4, kind="1f1b", micro_batches=6),
            ch03.make_run(ch03.tiny_model("llama"), pp=2, dp=2, kind="interleaved", num_chunks=2, micro_batches=4)]
    _check(runs, spawn(plugged(ch03.train_runs, "3.1"), WORLD, runs, timeout=300))


# --------------------------------------------------------------------------------------
# 3.2 the stage partition
# --------------------------------------------------------------------------------------
@pytest.mark.exercise("3.2")
def test_stage_layers_by_hand_and_errors():
    stage_layers = implementation("3.2")
    assert [stage_layers(8, 4, r) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [[stage_layers(8, 2, r, 2, c) for c in range(2)] for r in range(2)] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert [stage_layers(12, 2, r, 3, c) for c in range(3) for r in range(2)] == [
        [0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert [stage_layers(5, 3, r, layers_per_stage=[1, 3, 1]) for r in range(3)] == [[0], [1, 2, 3], [4]]
    assert [stage_layers(4, 2, r, 2, c, layers_per_stage=[0, 2, 1, 1]) for c in range(2) for r in range(2)] == [
        [], [0, 1], [2], [3]]
    with pytest.raises(ConfigError, match="num_layers=6 is not divisible"):
        stage_layers(6, 4, 0)
    with pytest.raises(ConfigError, match="layers_per_stage"):
        stage_layers(3, 2, 0, layers_per_stage=[1, 1])


@pytest.mark.exercise("3.2")
def test_a_pipeline_cut_by_your_partition_trains_like_one_device():
    runs = [ch03.make_run(ch03.tiny_model("gpt2", num_layers=8), pp=4, kind="interleaved", num_chunks=2,
                          micro_batches=4),
            ch03.make_run(ch03.tiny_model("gpt2", num_layers=3), pp=4, kind="1f1b", micro_batches=4,
                          layers_per_stage=[0, 2, 1, 0])]
    _check(runs, spawn(plugged(ch03.train_runs, "3.2"), WORLD, runs, timeout=300))


# --------------------------------------------------------------------------------------
# 3.3 the bubble formula
# --------------------------------------------------------------------------------------
@pytest.mark.exercise("3.3")
@pytest.mark.parametrize("kind,pp,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 3, 1), ("1f1b", 2, 1, 1),
                                         ("1f1b", 8, 16, 1), ("interleaved", 4, 8, 2), ("interleaved", 4, 4, 3),
                                         ("interleaved", 2, 6, 4)])
def test_bubble_formula_equals_the_simulated_idle_time(kind, pp, m, v):
    bubble_fraction = implementation("3.3")
    got = bubble_fraction(kind, pp, m, v)
    idle = idle_fraction(simulate(kind, pp, m, v, 1.0, 2.0), 0)
    assert got["idle"] == pytest.approx(idle, rel=1e-12), \
        f"bubble_fraction({kind!r}, {pp}, {m}, {v})['idle'] = {got['idle']}, the simulation measures {idle}"
    # bubble time over ideal time: idle / (1 - idle)
    assert got["bubble_over_ideal"] == pytest.approx(idle / (1 - idle), rel=1e-12)


# --------------------------------------------------------------------------------------
# 3.4 spot the bug: the tied-embedding gradient sync
# --------------------------------------------------------------------------------------
@pytest.mark.exercise("3.4")
def test_one_stage_holds_both_uses_and_syncs_nothing():
    """pp = 1: one chunk is the first and the last stage; a tied model has no output layer there."""
    sync = implementation("3.4")
    chunks = [GPTModel(ch03.tiny_model("gpt2"))]          # pre_process and post_process: both uses
    with record_communication() as ledger:
        sync(chunks, None)
    assert ledger.count() == 0, f"pp=1 communicated: {ledger.records}"


@pytest.mark.exercise("3.4")
def test_tied_pipelines_with_your_sync_train_like_one_device():
    runs = [ch03.make_run(ch03.tiny_model("gpt2"), pp=2, dp=2, kind="1f1b", micro_batches=4),
            ch03.make_run(ch03.tiny_model("gpt2", num_layers=8), pp=4, kind="interleaved", num_chunks=2,
                          micro_batches=4),
            ch03.make_run(ch03.tiny_model("llama"), pp=4, kind="gpipe", micro_batches=2)]
    per_rank = spawn(plugged(ch03.train_runs, "3.4"), WORLD, runs, timeout=300)
    _check(runs, per_rank)
    # the pattern: the first and the last stage all-reduce the V x h embedding gradient once
    # per step, the middle stages nothing (pp 4, tied)
    cfg = runs[1].model
    nbytes = cfg.vocab_size * cfg.hidden_size * 8
    for rank, rec in enumerate(r[1] for r in per_rank):
        calls = [c for c in rec["ledger"][0] if c[2] == "embedding-grads"]
        want = [("all_reduce", nbytes, "embedding-grads")] if rec["pp_rank"] in (0, 3) else []
        assert calls == want, f"rank {rank} (stage {rec['pp_rank']}): {calls}, expected {want}"
