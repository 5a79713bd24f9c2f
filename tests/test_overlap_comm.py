"""Chapter 07 §8: sequence parallelism's backward collectives behind its GEMMs
(--overlap-sp-backward, tp/overlap.py) and the pipeline's receives posted one op ahead
(--overlap-p2p-communication, pp/p2p.py). Only when communication is launched and waited for
moves: a 4-rank world (tp 2 + SP x pp 2, interleaved, 4 micro-batches) trains with both and
without, and the runs agree bit for bit with the same messages; both equal one device."""

import dataclasses

import pytest
import torch

from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.launch import spawn
from minimegatron.parallelize import validate_layout
from minimegatron.testing import RunRecord, compare_runs, make_batches, one_device_config, single_device_run
from tests.workers import overlap_comm as W

MODEL = ModelConfig.llama(hidden_size=32, num_layers=4, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                          vocab_size=64, max_position_embeddings=32)
# AdamW eps 1e-3: see tests/test_kernels.py (a float32 rounding of a near-zero gradient would flip a step)
CFG = TrainConfig(seq_length=16, micro_batch_size=2, grad_accum_steps=4, train_iters=2, lr=1e-2, lr_warmup_iters=0,
                  eval_interval=0, progress=False, adam_eps=1e-3, tensor_model_parallel_size=2, sequence_parallel=True,
                  pipeline_model_parallel_size=2, pipeline_schedule="interleaved",
                  num_virtual_stages_per_pipeline_rank=2)


@pytest.fixture(scope="module")
def runs():
    batches = make_batches(MODEL, 2, 2 * 4, 16)
    one = single_device_run(MODEL, batches, one_device_config(CFG), grad_accum_steps=4)
    return one, spawn(W.plain_and_overlapped, 4, MODEL, CFG, 1, batches, timeout=300)


def test_the_overlapped_run_equals_the_plain_one_bit_for_bit_with_the_same_messages(runs):
    _, ranks = runs
    for rank in ranks:
        plain, overlapped = rank["plain"], rank["overlapped"]
        assert overlapped["losses"] == plain["losses"]
        for kind in ("grads", "params"):
            for key, want in plain[kind].items():
                assert torch.equal(overlapped[kind][key], want), f"{kind} {key}"
        assert overlapped["messages"] and sorted(overlapped["messages"]) == sorted(plain["messages"])


def test_both_equal_one_device(runs):
    one, ranks = runs
    for rank in ranks:
        for name in ("plain", "overlapped"):
            run = rank[name]
            report = compare_runs(one, RunRecord(run["losses"], run["grads"], run["params"]), torch.float32)
            assert report.ok, f"{name}\n{report}"


def test_the_switches_select_the_overlapped_paths(runs):
    _, ranks = runs
    for rank in ranks:
        assert rank["plain"]["backward"] == 0 and rank["plain"]["ahead"] == 0
        # 2 layers a chunk x 2 chunks, qkv and fc1 each: 8 column-parallel backwards a micro-batch
        # (the tied output layer is one too on the last stage), over 2 steps x 4 micro-batches
        assert rank["overlapped"]["backward"] >= 2 * 4 * 4
        # every op but a rank's last posts the next one's receive, when that op has one
        assert rank["overlapped"]["ahead"] > 0


@pytest.mark.parametrize("fields, message", [
    (dict(overlap_sp_backward=True), "overlap_sp_backward without sequence_parallel"),
    (dict(overlap_p2p_comm=True), "overlap_p2p_comm with pipeline_model_parallel_size=1"),
])
def test_the_switches_refuse_layouts_without_what_they_overlap(fields, message):
    with pytest.raises(ConfigError, match=message):
        validate_layout(MODEL, dataclasses.replace(CFG, tensor_model_parallel_size=1, sequence_parallel=False,
                                                   pipeline_model_parallel_size=1, pipeline_schedule="1f1b",
                                                   num_virtual_stages_per_pipeline_rank=1, **fields), 1)
