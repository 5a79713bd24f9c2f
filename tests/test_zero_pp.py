"""ZeRO with pipeline parallelism: one distributed optimizer over every chunk of a rank (1F1B
and interleaved), each stage's parameters sharded over its data-parallel ranks, the tied
embedding in a bucket of its own on the first and the last stage (sharded alike, so its two
gradients are summed shard by shard after the reduce-scatter), equal to the single device in
float64: losses, first-step gradients and final parameters, every step clipped (chapter 03's
experiment, chapters/03_pp/demo.py, with --zero-stage). The training entry with exact resume:
tests/test_train_pp.py."""

from booktools.demo import import_chapter
from minimegatron.launch import spawn

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
