"""Chapter 03, pipeline parallelism: schedules (pure), the bubble (simulated vs formula), the
stage partition, and real pipelines on 4 spawned ranks against the single-device run.

The expected orders below are written by hand from the rules Megatron-LM documents (warm-up
count, steady one-forward-one-backward, the interleaved group order), not printed by the code.
"""

import pytest
import torch

from minimegatron.config import ConfigError
from minimegatron.launch import spawn
from minimegatron.pp import (bubble_fraction, idle_fraction, peak_in_flight, schedule, simulate,
                             stage_layers)
from booktools.demo import import_chapter

ch03 = import_chapter("03")          # chapters/03_pp/demo.py: the chapter's runs and their checks


def compact(ops):
    return " ".join(f"{op}{mb}" + (f".{c}" if any(x[2] for x in ops) else "") for op, mb, c in ops)


# ------------------------------------------------------------------ schedules, by hand

def test_1f1b_orders_by_hand():
    # pp 4, m 6: stage r warms up with pp - r - 1 forwards
    assert compact(schedule("1f1b", 4, 0, 6)) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert compact(schedule("1f1b", 4, 2, 6)) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5"
    assert compact(schedule("1f1b", 4, 3, 6)) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
    # fewer micro-batches than stages: the warm-up is cut at m
    assert compact(schedule("1f1b", 4, 0, 2)) == "F0 F1 B0 B1"


def test_gpipe_order_by_hand():
    assert compact(schedule("gpipe", 3, 1, 3)) == "F0 F1 F2 B0 B1 B2"


def test_interleaved_order_by_hand():
    # pp 2, m 4, v 2. Forward order: groups of pp micro-batches, chunk 0 then chunk 1:
    # (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1); backwards the same with chunks reversed.
    # Warm-up of rank 0: 2 (pp - 0 - 1) + (v - 1) pp = 4; of rank 1: 0 + 2 = 2.
    assert compact(schedule("interleaved", 2, 0, 4, 2)) == (
        "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0")
    assert compact(schedule("interleaved", 2, 1, 4, 2)) == (
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0")
    # m == pp has no special case (Megatron-Core since November 2024): the warm-up is the formula,
    # cut at v m. pp 2, m 2, v 2: rank 0 warms up min(2 + 2, 4) = 4 = everything; rank 1 only
    # min(0 + 2, 4) = 2, then the pairs (F0.1, B0.1), (F1.1, B1.1), then B0.0 B1.0.
    assert compact(schedule("interleaved", 2, 0, 2, 2)) == "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0"
    assert compact(schedule("interleaved", 2, 1, 2, 2)) == "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 B1.0"
    # pp 4, m 4, v 2, last rank: warm-up 0 + (2 - 1) 4 = 4 < 8, the whole first chunk
    assert compact(schedule("interleaved", 4, 3, 4, 2)) == (
        "F0.0 F1.0 F2.0 F3.0 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1 B0.0 B1.0 B2.0 B3.0")


def test_interleaved_warmup_follows_megatron_core():
    from minimegatron.pp import num_warmup_microbatches
    # 2 (pp - r - 1) + (v - 1) pp, at most v m, written out for pp 4, v 2:
    # r = 0: 6 + 4 = 10 -> 8 (m 4) or 10 (m 8); r = 1: 8; r = 2: 6; r = 3: 4
    assert [num_warmup_microbatches("interleaved", 4, r, 4, 2) for r in range(4)] == [8, 8, 6, 4]
    assert [num_warmup_microbatches("interleaved", 4, r, 8, 2) for r in range(4)] == [10, 8, 6, 4]
    # v 3, pp 2, m 2: r = 0: 2 + 4 = 6 = v m; r = 1: 0 + 4 = 4
    assert [num_warmup_microbatches("interleaved", 2, r, 2, 3) for r in range(2)] == [6, 4]


@pytest.mark.parametrize("kind,pp,m,v", [("gpipe", 4, 5, 1), ("1f1b", 4, 7, 1), ("1f1b", 3, 2, 1),
                                         ("interleaved", 4, 8, 2), ("interleaved", 2, 6, 3)])
def test_every_microbatch_forward_once_then_backward_once(kind, pp, m, v):
    for rank in range(pp):
        ops = schedule(kind, pp, rank, m, v)
        fwd = [(mb, c) for op, mb, c in ops if op == "F"]
        bwd = [(mb, c) for op, mb, c in ops if op == "B"]
        assert sorted(fwd) == sorted(bwd) == sorted((mb, c) for mb in range(m) for c in range(v))
        for mb, c in bwd:
            assert ops.index(("F", mb, c)) < ops.index(("B", mb, c))


def test_in_flight_microbatches():
    m, pp = 8, 4
    assert [peak_in_flight(schedule("gpipe", pp, r, m)) for r in range(pp)] == [m] * pp
    assert [peak_in_flight(schedule("1f1b", pp, r, m)) for r in range(pp)] == [4, 3, 2, 1]   # pp - r
    # interleaved holds more micro-batch-CHUNKS (each 1/v of a micro-batch's activations):
    # the warm-up count + 1 = 2 (pp - r - 1) + (v - 1) pp + 1
    assert [peak_in_flight(schedule("interleaved", pp, r, m, 2)) for r in range(pp)] == [11, 9, 7, 5]
    # m == pp: the same formula, cut at v m = 8 (no all-warm-up special case): 8, 8, 7, 5
    assert [peak_in_flight(schedule("interleaved", pp, r, 4, 2)) for r in range(pp)] == [8, 8, 7, 5]


@pytest.mark.parametrize("args,message", [
    (("pipedream", 2, 0, 4), "schedule kind 'pipedream' is not one of"),
    (("1f1b", 2, 2, 4), "pp_rank=2 is not in [0, pp_size=2)"),
    (("1f1b", 2, 0, 0), "num_microbatches=0 must be at least 1"),
    (("1f1b", 2, 0, 4, 2), "num_chunks=2 needs kind 'interleaved'"),
    (("interleaved", 2, 0, 4, 1), "needs num_chunks >= 2"),
    (("interleaved", 4, 0, 6, 2), "num_microbatches=6 to be a multiple of pp_size=4"),
])
def test_impossible_schedules_name_the_numbers(args, message):
    with pytest.raises(ValueError) as info:
        schedule(*args)
    assert message in str(info.value)


# ------------------------------------------------------------------ the bubble

@pytest.mark.parametrize("kind,pp,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 3, 1),
                                         ("1f1b", 2, 1, 1), ("interleaved", 4, 8, 2),
                                         ("interleaved", 2, 4, 2), ("interleaved", 4, 4, 3),
                                         ("interleaved", 4, 4, 2), ("interleaved", 2, 2, 2)])
@pytest.mark.parametrize("t_f,t_b", [(1.0, 2.0), (1.0, 1.0), (0.5, 1.7)])
def test_simulated_bubble_equals_the_formula(kind, pp, m, v, t_f, t_b):
    intervals = simulate(kind, pp, m, v, t_f, t_b)
    # independent of the formula function: the makespan the fill/drain argument predicts
    makespan = max(i.end for i in intervals)
    assert makespan == pytest.approx((m + (pp - 1) / v) * (t_f + t_b))
    for rank in range(pp):
        assert idle_fraction(intervals, rank) == pytest.approx((pp - 1) / (v * m + pp - 1))
    formula = bubble_fraction(kind, pp, m, v)
    assert formula["idle"] == pytest.approx((pp - 1) / (v * m + pp - 1))
    assert formula["bubble_over_ideal"] == pytest.approx((pp - 1) / (v * m))


def test_a_wrong_schedule_deadlocks_in_simulation(monkeypatch):
    import minimegatron.pp.timeline as timeline
    # every stage runs its backwards first: B0 on stage 0 waits for stage 1's B0, which waits for F0
    monkeypatch.setattr(timeline, "schedule", lambda kind, p, r, m, v: [("B", 0, 0), ("F", 0, 0)])
    with pytest.raises(ValueError, match="deadlock"):
        timeline.simulate("1f1b", 2, 1)


# ------------------------------------------------------------------ the partition

def test_stage_layers_even_and_interleaved_and_uneven():
    assert [stage_layers(8, 4, r) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [[stage_layers(8, 2, r, 2, c) for c in range(2)] for r in range(2)] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert [stage_layers(5, 3, r, layers_per_stage=[1, 3, 1]) for r in range(3)] == [[0], [1, 2, 3], [4]]
    assert stage_layers(3, 2, 1, layers_per_stage=[3, 0]) == []          # a head-only last stage
    with pytest.raises(ConfigError, match="num_layers=6 is not divisible by pipeline_model_parallel_size=4"):
        stage_layers(6, 4, 0)
    with pytest.raises(ConfigError, match=r"layers_per_stage=\[1, 1\] must have .* summing to num_layers=3"):
        stage_layers(3, 2, 0, layers_per_stage=[1, 1])


# ------------------------------------------------------------------ real pipelines

M8 = ch03.tiny_model("gpt2", num_layers=8)
RUNS = [
    ch03.make_run(ch03.tiny_model("gpt2"), pp=4, kind="gpipe", micro_batches=4),
    ch03.make_run(ch03.tiny_model("llama"), pp=4, kind="1f1b", micro_batches=6),
    ch03.make_run(M8, pp=4, kind="interleaved", num_chunks=2, micro_batches=4),
    ch03.make_run(ch03.tiny_model("gpt2"), pp=2, dp=2, kind="1f1b", micro_batches=4),
    ch03.make_run(ch03.tiny_model("llama"), pp=2, dp=2, kind="gpipe", micro_batches=3),
    ch03.make_run(ch03.tiny_model("llama"), pp=2, dp=2, kind="interleaved", num_chunks=2, micro_batches=4),
    ch03.make_run(ch03.tiny_model("gpt2", num_layers=3), pp=4, kind="1f1b", micro_batches=4,
                  layers_per_stage=[0, 2, 1, 0]),                 # uneven; embedding-only and head-only stages
    ch03.make_run(ch03.tiny_model("gpt2", dtype="float32"), pp=2, dp=2, kind="1f1b", micro_batches=3),
    # TP x PP: every stage split over a TP group of 2 (tied: the vocab-parallel copies agree)
    ch03.make_run(ch03.tiny_model("gpt2"), tp=2, pp=2, kind="1f1b", micro_batches=4),
    ch03.make_run(ch03.tiny_model("llama", num_query_groups=2), tp=2, pp=2, kind="interleaved", num_chunks=2,
                  micro_batches=4),
]


@pytest.fixture(scope="module")
def pipelines():
    per_rank = spawn(ch03.train_runs, 4, RUNS, timeout=400)
    return [[r[i] for r in per_rank] for i in range(len(RUNS))]


@pytest.mark.parametrize("i", range(len(RUNS)))
def test_pipeline_trains_like_one_device(pipelines, i):
    run = RUNS[i]
    report = ch03.check_run(run, pipelines[i])
    assert report.ok, f"{run.kind} pp={run.pp} dp={run.dp} v={run.num_chunks}:\n{report.equivalence}\n{report.problems}"


def test_p2p_bytes_per_step_equal_the_formula(pipelines):
    """Independently of expected_p2p_ledger: 1F1B, pp 4, m 6, b 2, s 16, h 32, float64:
    an inner stage sends and receives one activation and one gradient per micro-batch."""
    per_rank = pipelines[1]
    nbytes = 2 * 16 * 32 * 8
    for rec in per_rank:
        inner = 0 < rec["pp_rank"] < 3
        sent = sum(n for op, n, tag in rec["ledger"][0] if op == "send")
        received = sum(n for op, n, tag in rec["ledger"][0] if op == "recv")
        assert sent == received == 6 * nbytes * (2 if inner else 1), rec["pp_rank"]


def test_gpipe_holds_every_microbatch_and_1f1b_at_most_the_depth(pipelines):
    gpipe, one_f_one_b = pipelines[0], pipelines[1]
    assert [r["peak_in_flight"] for r in gpipe] == [4, 4, 4, 4]
    assert [r["peak_in_flight"] for r in one_f_one_b] == [4, 3, 2, 1]
    # in bytes: a stage's saved activations grow with what it holds (same layers per stage)
    assert one_f_one_b[1]["peak_bytes"] > one_f_one_b[2]["peak_bytes"]
    per_mb = one_f_one_b[1]["saved_bytes"][(0, 0)]
    assert one_f_one_b[1]["peak_bytes"] == 3 * per_mb


def test_tied_embedding_copies_stay_equal(pipelines):
    """GPT-2 tied, pp 4: the last stage's output layer equals the first stage's embedding
    after training (their gradients were summed over the embedding group)."""
    per_rank = pipelines[0]
    first = per_rank[0]["params"]["embedding.word_embeddings.weight"]
    assert "output_layer.weight" not in per_rank[3]["params"]      # left out as a copy
    assert "output_layer.weight" not in per_rank[3]["names"]       # held, but not counted as its own
    assert torch.equal(per_rank[3]["tied_copy"], first)


@pytest.mark.slow
def test_3d_tp_pp_dp_on_8_ranks_trains_like_one_device():
    """The 2021 Megatron-LM paper's setting: TP 2 x PP 2 x DP 2 (tied GPT-2, 1F1B)."""
    run = ch03.make_run(ch03.tiny_model("gpt2"), tp=2, pp=2, dp=2, kind="1f1b", micro_batches=4)
    report = ch03.check_run(run, spawn(ch03.train_run, 8, run, timeout=400))
    assert report.ok, f"{report.equivalence}\n{report.problems}"
