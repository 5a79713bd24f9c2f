"""Graders of chapter 01's ZeRO exercises: ZeRO-1's gradient reduce-scatter (1.3) and the
ZeRO-3 gather of a unit (1.4).

Both run in spawned ranks with the learner's function plugged into the book's code
(`spawn(plugged(worker, id), n)`; the workers are in tests/workers/dp_zero.py), which trains
with the training loop's own step (`train.train_step`): for 1.3, ZeroDataParallel's
finish_grad_sync calls the learner's reduce_scatter_gradients. The oracles, strongest first:
training with the learner's function equals the single-device run on the same global
batches (float64); the collectives it issued, read from the ledger, are exactly the ones the
spec names (a correct-looking answer that all-reduces instead of reduce-scattering leaves the
same numbers in this rank's shard, but the ledger names the op, and a ring sends twice the
bytes); the memory it holds is freed (1.4). DP size 3 makes the buckets and units need padding.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from booktools.exercises import plugged
from minimegatron.launch import spawn
from minimegatron.testing import RunRecord, assert_equivalent, single_device_run
from workers.dp_zero import case_batches, fsdp_gather_worker, tiny_config, train_config, zero1_training_worker

DP, STEPS = 3, 2


def _reference(style: str, M: int) -> RunRecord:
    case = {"style": style, "steps": STEPS, "mbs": 1, "M": M}
    return single_device_run(tiny_config(style), case_batches(case, DP), train_config(STEPS, 0.0), grad_accum_steps=M)


def _as_record(ranks: list[dict]) -> RunRecord:
    losses = [sum(r["losses"][s] for r in ranks) / len(ranks) for s in range(STEPS)]
    return RunRecord(losses, ranks[0]["grads"], ranks[0]["params"])


# --------------------------------------------------------------------------------------
# 1.3 ZeRO-1's gradient reduce-scatter, inside the ZeRO-1 training step
# --------------------------------------------------------------------------------------

@functools.cache
def _zero1_world():
    return spawn(plugged(zero1_training_worker, "1.3"), DP, "llama", STEPS, timeout=180)


@pytest.mark.exercise("1.3")
def test_zero1_with_your_reduce_scatter_trains_like_one_device():
    ranks = _zero1_world()
    assert_equivalent(_reference("llama", 1), _as_record(ranks), torch.float64)
    assert all(r["params_equal_on_ranks"] for r in ranks), \
        "after the step the ranks hold different parameters: did every rank get its own shard's average?"


@pytest.mark.exercise("1.3")
def test_zero1_step_issues_exactly_the_zero1_collectives():
    ranks = _zero1_world()
    for rank, r in enumerate(ranks):
        expected = ([("reduce_scatter", padded * 8, "grads") for _, padded, _ in r["buckets"]]
                    + [("all_reduce", 8, "grad-norm")]
                    + [("all_gather", shard * 8, "params") for _, _, shard in r["buckets"]])
        for step, got in enumerate(r["ledger"]):
            assert got == expected, (
                f"rank {rank}, step {step}: the ZeRO-1 step with your function issued\n  {got}\nit must be one "
                f"reduce-scatter (avg, the whole padded bucket) per bucket from your function, then the norm's "
                f"all-reduce and one all-gather (this rank's padded shard) per bucket:\n  {expected}")
    assert any(numel % DP for numel, _, _ in ranks[0]["buckets"]), "the grader must exercise padding"


# --------------------------------------------------------------------------------------
# 1.4 the ZeRO-3 gather of a unit
# --------------------------------------------------------------------------------------

@functools.cache
def _fsdp_world():
    return spawn(plugged(fsdp_gather_worker, "1.4"), DP, "gpt2", STEPS, timeout=180)


@pytest.mark.exercise("1.4")
def test_gather_returns_every_parameter_of_the_unit():
    for rank, r in enumerate(_fsdp_world()):
        for d in r["direct"]:
            where = f"rank {rank}, unit {d['unit']}"
            assert d["values_ok"], f"{where}: the tensors differ from the unit's full parameters (order, shapes, values)"
            assert d["ledger"] == [("all_gather", d["shard_bytes"], "probe")], \
                f"{where}: expected one all_gather of the {d['shard_bytes']}-byte shard with the given tag, got {d['ledger']}"
            assert d["one_buffer"] and d["buffer_bytes"] == d["padded_bytes"], \
                f"{where}: the parameters must be views of one gathered buffer of {d['padded_bytes']} bytes"
            assert d["freed"], f"{where}: the gathered buffer survived its views: something keeps a reference"


@pytest.mark.exercise("1.4")
def test_zero3_with_your_gather_trains_like_one_device():
    ranks = _fsdp_world()
    assert_equivalent(_reference("gpt2", 2), _as_record(ranks), torch.float64)


@pytest.mark.exercise("1.4")
def test_zero3_with_your_gather_frees_each_layer():
    """The profile of a training step: a layer's gathered bytes are back to zero after it."""
    units = {name: math.ceil(n / DP) for name, n in [("layer", 12704), ("embedding", 8224 + 512), ("head", 64)]}
    for rank, r in enumerate(_fsdp_world()):
        profile = r["profile"]
        for i, (label, _, gathered) in enumerate(profile):
            if "free decoder.layers" in label:
                assert gathered == 0, f"rank {rank}: {gathered} bytes still gathered after '{label}'"
            if "gather decoder.layers" in label:
                assert gathered == DP * units["layer"] * 8, f"rank {rank}: '{label}' holds {gathered} bytes"
        assert profile[-1][2] == 0
        assert max(g for _, _, g in profile) == DP * 8 * max(units["layer"], units["embedding"] + units["head"])
