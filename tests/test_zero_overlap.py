"""ZeRO-1 and ZeRO-2 with Megatron's --overlap-grad-reduce and --overlap-param-gather (chapter
07): the reduce-scatters launched from the backward, the parameter all-gathers waited in the
next forward. Only when the communication is waited for moves, so a run with the overlaps
equals the same run without them bit for bit, sends the same messages, and ZeRO-1 launches
its buckets before the backward ends. One 2-rank world trains every variant."""

import dataclasses

import pytest
import torch

from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.launch import spawn
from minimegatron.testing import make_batches
from tests.workers import zero_overlap as W

MODEL = ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                          vocab_size=64, max_position_embeddings=32)
# three steps of two micro-batches each; buckets of 2,000 elements, so that a backward completes several
BASE = TrainConfig(seq_length=16, micro_batch_size=2, grad_accum_steps=2, train_iters=3, lr=1e-2, lr_warmup_iters=0,
                   eval_interval=0, progress=False, ddp_bucket_size=2000)
STAGES = (1, 2)


@pytest.fixture(scope="module")
def ranks():
    batches = make_batches(MODEL, 3, 2 * 2 * 2, 16)
    return {stage: spawn(W.with_and_without_overlap, 2, MODEL, dataclasses.replace(BASE, zero_stage=stage), 2,
                         batches, timeout=300) for stage in STAGES}


@pytest.mark.parametrize("stage", STAGES)
def test_the_overlapped_runs_equal_the_plain_one_bit_for_bit_with_the_same_messages(ranks, stage):
    for rank in ranks[stage]:
        plain = rank["plain"]
        for name in ("grads", "grads+params"):
            run = rank[name]
            assert run["losses"] == plain["losses"], name
            for kind in ("grads", "params"):
                for key, want in plain[kind].items():
                    assert torch.equal(run[kind][key], want), f"{name}: {kind} {key}"
            assert run["messages"] == plain["messages"], name


def test_zero1_launches_its_reduce_scatters_during_the_backward(ranks):
    for rank in ranks[1]:
        assert rank["grads"]["buckets"] >= 3
        assert rank["plain"]["launched_in_backward"] == []
        # every bucket but the last one the backward completes is on its way before the backward ends
        assert len(rank["grads"]["launched_in_backward"]) >= rank["grads"]["buckets"] - 1


@pytest.mark.parametrize("stage", STAGES)
def test_the_parameter_all_gathers_are_still_in_flight_when_the_step_returns(ranks, stage):
    for rank in ranks[stage]:
        assert rank["plain"]["gathers_in_flight"] == [0, 0, 0]
        assert rank["grads+params"]["gathers_in_flight"] == [rank["grads+params"]["buckets"]] * 3


@pytest.mark.parametrize("fields, message", [
    (dict(zero_stage=1, overlap_param_gather=True), "overlap_param_gather needs overlap_grad_reduce"),
    (dict(zero_stage=0, overlap_grad_reduce=True), "overlap_grad_reduce / overlap_param_gather with zero_stage=0"),
    (dict(zero_stage=3, overlap_grad_reduce=True), "with zero_stage=3"),
])
def test_the_overlap_switches_refuse_what_they_do_not_time(fields, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(BASE, **fields).validate()
