"""Tests for minimegatron.tp.random: the shared stream and the per-TP-rank stream.

First on one process (the tracker's mechanics, and "two TP ranks" simulated by seeding
twice), then in ONE spawned world of 4 ranks laid out as TP=2 x DP=2 by
``rank_groups(4, tp=2)``: TP groups [0, 1], [2, 3], DP groups [0, 2], [1, 3]. Each rank
returns its masks and the parent compares them across ranks; no collective is needed.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minimegatron import parallel_state
from minimegatron.launch import spawn
from minimegatron.tp.random import (MODEL_PARALLEL_RNG, RNGStatesTracker, get_rng_tracker,
                                    model_parallel_manual_seed)

SEED, N, P = 1234, 256, 0.5
WORLD = 4


def mask(n=N):
    """A dropout keep-mask drawn from torch's default generator, as F.dropout draws it."""
    return F.dropout(torch.ones(n), p=P, training=True) != 0


def masks_from_seed(seed, k):
    """k masks from a fresh generator seeded ``seed``; leaves this process's RNG alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return [mask() for _ in range(k)]


@pytest.fixture(autouse=True)
def restore_global_rng():
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)
    get_rng_tracker().reset()


def draw_pattern():
    """outside, inside, outside, inside: what a layer with both kinds of dropout does."""
    tracker = get_rng_tracker()
    out = {"out1": mask()}
    with tracker.fork():
        out["in1"] = mask()
    out["out2"] = mask()
    with tracker.fork():
        out["in2"] = mask()
    return out


# ---------------------------------------------------------------------- one process

def test_seeds_follow_megatron_convention():
    for tp_rank, pp_rank in [(0, 0), (1, 0), (1, 2)]:
        model_parallel_manual_seed(SEED, tp_rank, pp_rank)
        got = draw_pattern()
        base = SEED + 100 * pp_rank
        assert torch.equal(got["out1"], masks_from_seed(base, 2)[0])
        assert torch.equal(got["out2"], masks_from_seed(base, 2)[1])
        # the forked stream continues across forks, as one generator would
        assert torch.equal(got["in1"], masks_from_seed(base + 2718 + tp_rank, 2)[0])
        assert torch.equal(got["in2"], masks_from_seed(base + 2718 + tp_rank, 2)[1])


def test_fork_leaves_default_stream_as_if_it_had_not_run():
    model_parallel_manual_seed(SEED, tp_rank=0)
    with_fork = draw_pattern()
    torch.manual_seed(SEED)
    assert torch.equal(with_fork["out1"], mask()) and torch.equal(with_fork["out2"], mask())


def test_two_tp_ranks_simulated_and_reproducible():
    runs = {}
    for tp_rank in (0, 1, 0):
        model_parallel_manual_seed(SEED, tp_rank)
        runs.setdefault(tp_rank, []).append(draw_pattern())
    a, b = runs[0][0], runs[1][0]
    assert torch.equal(a["out1"], b["out1"]) and torch.equal(a["out2"], b["out2"])
    assert not torch.equal(a["in1"], b["in1"]) and not torch.equal(a["in2"], b["in2"])
    for key in a:  # same seed, same tp_rank: the same masks again
        assert torch.equal(a[key], runs[0][1][key])


def test_get_set_states_round_trip_into_fresh_tracker():
    model_parallel_manual_seed(SEED, tp_rank=1)
    draw_pattern()  # advance both streams
    tracker = get_rng_tracker()
    snapshot = torch.get_rng_state(), tracker.get_states()
    first = draw_pattern()
    tracker.reset()  # as after a restart: nothing left but the checkpoint
    torch.set_rng_state(snapshot[0])
    tracker.set_states(snapshot[1])
    second = draw_pattern()
    for key in first:
        assert torch.equal(first[key], second[key]), key
    # get_states returned copies: the streams advanced since, the snapshot did not
    assert not torch.equal(snapshot[1][MODEL_PARALLEL_RNG],
                           tracker.get_states()[MODEL_PARALLEL_RNG])


def test_fork_restores_on_exception_and_nests():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    tracker.add("b", 2)
    torch.manual_seed(SEED)
    with pytest.raises(RuntimeError, match="boom"):
        with tracker.fork("a"):
            mask()  # the first mask of "a": drawn, and kept by the tracker despite the raise
            raise RuntimeError("boom")
    with tracker.fork("a"):
        a1 = mask()
        with tracker.fork("b"):
            b1 = mask()
        with tracker.fork("a"):  # the active stream again: just continues
            a2 = mask()
        a3 = mask()
    assert torch.equal(mask(), masks_from_seed(SEED, 1)[0])  # default untouched by all that
    assert all(torch.equal(x, y) for x, y in zip([a1, a2, a3], masks_from_seed(1, 4)[1:]))
    assert torch.equal(b1, masks_from_seed(2, 1)[0])


def test_bad_use_is_named():
    tracker = RNGStatesTracker()
    tracker.add("a", 7)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 8)
    with pytest.raises(ValueError, match="seed 7 is already used"):
        tracker.add("b", 7)
    with pytest.raises(KeyError, match="'nope' was not added"):
        with tracker.fork("nope"):
            pass
    with pytest.raises(ValueError, match="tp_rank must be >= 0, got -1"):
        model_parallel_manual_seed(SEED, tp_rank=-1)


# ---------------------------------------------------------------------- the spawned world

def rank_worker():
    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    model_parallel_manual_seed(SEED)  # tp_rank read from parallel_state
    out = draw_pattern()
    out["tp_rank"] = tp_rank

    # The residual stream: x is replicated (same on both TP ranks, e.g. after the
    # row-parallel all-reduce). Dropout from the shared stream keeps the replicas equal;
    # from the per-rank stream it would make them diverge.
    x = torch.randn(N, generator=torch.Generator().manual_seed(5))
    out["residual_shared"] = x + F.dropout(x, P, training=True)
    with get_rng_tracker().fork():
        out["residual_forked"] = x + F.dropout(x, P, training=True)

    # checkpoint round trip on this rank
    tracker = get_rng_tracker()
    snapshot = torch.get_rng_state(), tracker.get_states()
    first = draw_pattern()
    tracker.reset()
    torch.set_rng_state(snapshot[0])
    tracker.set_states(snapshot[1])
    second = draw_pattern()
    out["resume_exact"] = all(torch.equal(first[k], second[k]) for k in first)
    out["rank"] = rank
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def world():
    return spawn(rank_worker, WORLD, timeout=120.0, collective_timeout=20.0)


GROUPS = parallel_state.rank_groups(WORLD, tp=2)


def test_world_layout(world):
    assert GROUPS["tp"] == [[0, 1], [2, 3]] and GROUPS["dp"] == [[0, 2], [1, 3]]
    assert [r["tp_rank"] for r in world] == [0, 1, 0, 1]


def test_world_outside_masks_identical_across_tp_group(world):
    for group in GROUPS["tp"]:
        for key in ("out1", "out2", "residual_shared"):
            assert all(torch.equal(world[group[0]][key], world[r][key]) for r in group), key


def test_world_inside_masks_differ_across_tp_group(world):
    for a, b in GROUPS["tp"]:
        for key in ("in1", "in2", "residual_forked"):
            assert not torch.equal(world[a][key], world[b][key]), key


def test_world_same_tp_rank_in_other_dp_group_same_stream(world):
    for group in GROUPS["dp"]:
        for key in ("in1", "in2"):
            assert all(torch.equal(world[group[0]][key], world[r][key]) for r in group), key


def test_world_streams_are_the_documented_seeds(world):
    # reproducible across processes: the parent redraws every rank's masks from the formula
    for r in world:
        default = masks_from_seed(SEED, 2)
        forked = masks_from_seed(SEED + 2718 + r["tp_rank"], 2)
        assert torch.equal(r["out1"], default[0]) and torch.equal(r["out2"], default[1])
        assert torch.equal(r["in1"], forked[0]) and torch.equal(r["in2"], forked[1])


def test_world_checkpoint_round_trip(world):
    assert [r["resume_exact"] for r in world] == [True] * WORLD
