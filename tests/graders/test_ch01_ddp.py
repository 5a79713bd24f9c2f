"""Graders of chapter 01, data parallelism: gradient averaging (1.1), bucket assignment (1.2)
and the spot-the-bug gradient hook (1.5).

Each grader reaches the graded function through `implementation(id)`, or runs the book's
data-parallel wrappers with it plugged into every spawned rank (`spawn(plugged(worker, id))`,
workers in tests/workers/dp_ddp.py). The oracles, strongest first: the data-parallel
run with your function inside trains exactly like the single-device run (float64, AdamW, two
steps); the communication it issues equals the formula (the ledger: numbers alone cannot tell
one all-reduce per gradient from one per micro-batch); your function equals the book's on
hand-made and random inputs; and properties any correct answer has.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from booktools.exercises import implementation, plugged
from minimegatron.launch import spawn
from minimegatron.model import GPTModel
from workers.dp_ddp import DPCase, check_replicas, check_run, grade_allreduce_gradients, run_world


# --------------------------------------------------------------------------------------
# 1.1 gradient averaging
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def averaging_world():
    """3 ranks (a hard-coded 1/2 would pass with 2): known gradients averaged by your
    allreduce_gradients, then naive DP trained with it (2 micro-batches, 2 steps)."""
    return spawn(plugged(grade_allreduce_gradients, "1.1"), 3, timeout=180)


@pytest.mark.exercise("1.1")
def test_gradients_become_the_average(averaging_world):
    for name in averaging_world[0]["before"]:
        mean = sum(r["before"][name] for r in averaging_world) / len(averaging_world)
        for rank, result in enumerate(averaging_world):
            torch.testing.assert_close(result["after"][name], mean, rtol=1e-12, atol=1e-14,
                                       msg=f"rank {rank}: {name} is not the average over the 3 ranks")
            assert torch.equal(result["after"][name], averaging_world[0]["after"][name]), \
                f"rank {rank}'s {name} differs from rank 0's: every rank must end with the same gradient"


@pytest.mark.exercise("1.1")
def test_one_allreduce_per_gradient(averaging_world):
    """Exactly one all-reduce of each gradient, in model.parameters() order, over the group."""
    for rank, result in enumerate(averaging_world):
        ledger = result["ledger"]
        ops = sorted({op for op, _, _, _ in ledger})
        assert ops == ["all_reduce"], f"rank {rank}: collectives {ops}, expected only all_reduce"
        shapes = [shape for _, _, shape, _ in ledger]
        assert shapes == result["param_shapes"], (
            f"rank {rank}: all-reduced shapes {shapes[:4]}... ({len(shapes)} calls); expected each "
            f"gradient once, in parameter order ({len(result['param_shapes'])} calls)")
        assert {group for _, _, _, group in ledger} == {(0, 1, 2)}, f"rank {rank}: not over the DP group"


@pytest.mark.exercise("1.1")
def test_naive_dp_with_your_averaging_trains_like_one_device(averaging_world):
    case = averaging_world[0]["case"]
    check_run(case, [r["run"] for r in averaging_world])


# --------------------------------------------------------------------------------------
# 1.2 bucket assignment
# --------------------------------------------------------------------------------------

HAND_MADE = [  # (numels, bucket_size, buckets)
    ([4, 4, 4], 6, [[0, 1], [2]]),
    ([4, 4, 4], 4, [[0], [1], [2]]),
    ([4, 4, 4], 5, [[0, 1], [2]]),
    ([4, 4, 4], 13, [[0, 1, 2]]),
    ([1, 100, 2], 10, [[0, 1], [2]]),
    ([100, 1, 2], 10, [[0], [1, 2]]),
    ([2, 3, 5, 1, 1, 8], 5, [[0, 1], [2], [3, 4, 5]]),
    ([7], 3, [[0]]),
    ([4, 4, 4], None, [[0, 1, 2]]),
    ([], 5, []),
]


@pytest.mark.exercise("1.2")
@pytest.mark.parametrize("numels,bucket_size,expected", HAND_MADE)
def test_assign_buckets_by_hand(numels, bucket_size, expected):
    assign_buckets = implementation("1.2")
    got = assign_buckets(list(numels), bucket_size)
    assert [list(b) for b in got] == expected, \
        f"assign_buckets({numels}, {bucket_size}) returned {got}, expected {expected}"


@pytest.mark.exercise("1.2")
def test_assign_buckets_follows_the_rule_on_random_inputs():
    """Equal to the book's function, and with the rule's properties: a partition of the
    indices in order; each bucket but the last holds >= bucket_size elements, and fewer
    without its last parameter."""
    assign_buckets, reference = implementation("1.2"), implementation("1.2", "reference")
    rng = random.Random(1)
    for _ in range(300):
        numels = [rng.randint(1, 60) for _ in range(rng.randint(1, 15))]
        size = rng.randint(1, 150)
        got = [list(b) for b in assign_buckets(numels, size)]
        assert [i for b in got for i in b] == list(range(len(numels))), \
            f"assign_buckets({numels}, {size}) = {got} is not the indices 0..{len(numels) - 1} in order"
        for b in got[:-1]:
            total = sum(numels[i] for i in b)
            assert total >= size, f"assign_buckets({numels}, {size}): bucket {b} closed early ({total} < {size})"
            assert total - numels[b[-1]] < size, f"assign_buckets({numels}, {size}): bucket {b} closed late"
        assert got == reference(numels, size), f"assign_buckets({numels}, {size}) = {got}"


def _expected_buckets(case: DPCase) -> list[list[str]]:
    assign_buckets = implementation("1.2", "reference")
    named = list(GPTModel(case.model_config()).named_parameters())[::-1]
    size = math.ceil(case.bucket_size_bytes / named[0][1].element_size())
    return [[named[i][0] for i in b] for b in assign_buckets([p.numel() for _, p in named], size)]


@pytest.mark.exercise("1.2")
def test_ddp_with_your_buckets_trains_like_one_device():
    """Bucketed DDP (2 ranks, 2 micro-batches, overlap) built with your assign_buckets:
    the book's buckets, one all-reduce per bucket, and the single-device training run."""
    case = DPCase("ddp-grader", "ddp", style="llama", grad_accum=2, bucket_size_bytes=65536)
    per_rank = [r[2][case.name] for r in spawn(plugged(run_world, "1.2"), 2, {2: [case]}, timeout=180)]
    expected = _expected_buckets(case)
    assert per_rank[0]["buckets"] == expected, f"buckets {per_rank[0]['buckets']}, expected {expected}"
    check_run(case, per_rank)


# --------------------------------------------------------------------------------------
# 1.5 spot the bug: the gradient-averaging hook
# --------------------------------------------------------------------------------------

@pytest.mark.exercise("1.5")
def test_hooked_dp_with_your_hook_trains_like_one_device():
    """HookedDataParallel with your hook, 2 ranks: with 2 micro-batches (GPT-2) and with one
    (LLaMA). Losses, gradients and parameters equal the single-device run, the replicas stay
    identical, and the ledger shows one all-reduce per parameter per step, none in no_sync."""
    cases = [DPCase("hook-grader-M2", "hooked", grad_accum=2),
             DPCase("hook-grader-M1", "hooked", style="llama")]
    results = spawn(plugged(run_world, "1.5"), 2, {2: cases}, timeout=180)
    for case in cases:
        per_rank = [r[2][case.name] for r in results]
        check_replicas(per_rank)
        check_run(case, per_rank)
