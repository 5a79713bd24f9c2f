"""ZeRO with the other dimensions, equal to the single device in float64: losses, first-step
gradients and final parameters, every step clipped.

- ZeRO-1 and ZeRO-2 with pipeline parallelism: one distributed optimizer over every chunk of a
  rank (1F1B and interleaved), each stage's parameters sharded over its data-parallel ranks, the
  tied embedding in a bucket of its own on the first and the last stage (sharded alike, so its
  two gradients are summed shard by shard after the reduce-scatter); chapter 03's experiment
  (chapters/03_pp/demo.py, with --zero-stage), also with tensor parallelism.
- ZeRO-3 with tensor parallelism (torchtitan's FSDP2 + TP, "2D"): each unit flattens this rank's
  tensor-parallel shards; the gatherer and the norm read the placement records.
The training entry with exact resume: tests/test_train_pp.py, tests/test_train_tp.py."""

import dataclasses

import torch

from booktools.demo import import_chapter
from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.launch import spawn
from minimegatron.testing import RunRecord, assert_equivalent, global_batches, single_device_run, train_layout

ch03 = import_chapter("03")


def _runs(world: int):
    if world == 4:
        return [ch03.make_run(ch03.tiny_model("gpt2"), pp=2, dp=2, kind="1f1b", zero_stage=1),
                ch03.make_run(ch03.tiny_model("gpt2"), pp=2, dp=2, kind="interleaved", num_chunks=2, zero_stage=2),
                ch03.make_run(ch03.tiny_model("llama"), pp=2, dp=2, kind="interleaved", num_chunks=2, zero_stage=1)]
    return [ch03.make_run(ch03.tiny_model("gpt2", num_query_groups=2), pp=2, dp=2, tp=2, kind="interleaved",
                          num_chunks=2, zero_stage=2)]


def test_zero_1_and_2_with_pipelines_equal_the_single_device():
    for world in (4, 8):
        runs = _runs(world)
        results = spawn(ch03.train_runs, world, runs, timeout=300)
        for i, run in enumerate(runs):
            report = ch03.check_run(run, [r[i] for r in results])
            assert report.ok, f"{run.name()}:\n{report}"
            assert report.equivalence.max_param_diff < 1e-12


def _zero3_tp(style: str) -> tuple[ModelConfig, TrainConfig]:
    base = dict(hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=16, params_dtype="float64")
    model = ModelConfig.gpt2(**base) if style == "gpt2" else ModelConfig.llama(**base, num_query_groups=2)
    return model, TrainConfig(seq_length=16, micro_batch_size=2, grad_accum_steps=2, train_iters=2, lr_warmup_iters=0,
                              clip_grad=0.05, progress=False, eval_interval=0, tensor_model_parallel_size=2,
                              zero_stage=3)


def _zero3_tp_worker(styles):
    results = []
    for style in styles:
        model, train = _zero3_tp(style)
        results.append(train_layout(model, train, 2, global_batches(model, train, 2))[0])
    return results


def test_zero_3_with_tensor_parallelism_equals_the_single_device():
    styles = ("gpt2", "llama")                      # tied embeddings (the head borrows the embedding's unit); GQA
    ranks = spawn(_zero3_tp_worker, 4, styles, timeout=300)
    for i, style in enumerate(styles):
        model, train = _zero3_tp(style)
        reference = single_device_run(model, global_batches(model, train, 2),
                                      dataclasses.replace(train, tensor_model_parallel_size=1, zero_stage=0),
                                      grad_accum_steps=2)
        r = ranks[0][i]
        assert_equivalent(reference, RunRecord(r["losses"], r["grads"], r["params"]), torch.float64)
