"""Graders of chapter 07, activation recompute: the spot-the-bug random states (7.1) and full
recompute's units (7.2).

The oracles: random draws that must repeat once the states are set again (a generator replays
the same numbers from the same state, whatever the code), Megatron-Core's unit rules worked out
by hand (megatron/core/recompute.py: uniform cuts every num_layers layers, the last unit
shorter; block recomputes the first num_layers layers of the chunk one by one), and the whole
model: with the learner's function inside, a tensor-parallel run with dropout and full
recompute must equal the same run without recompute bit for bit (chapters/07_kernels/demo.py),
once with sequence parallelism (every dropout then draws from the tracker's stream) and once
without (the dropout after the row-parallel layers draws from torch's default generator, the
same on every tensor-parallel rank): a set_rng_states that leaves out either generator fails one
of the two (tests/test_graders.py checks that it does).
"""

from __future__ import annotations

import pytest
import torch

from booktools.demo import import_chapter
from booktools.exercises import implementation, plugged
from differences import assert_equal, differs
from minimegatron.launch import spawn
from minimegatron.tp import get_rng_tracker

ch07 = import_chapter("07")          # chapters/07_kernels/demo.py


# --------------------------------------------------------------------------------------
# 7.1 spot the bug: the recompute's random states
# --------------------------------------------------------------------------------------
def _draws() -> tuple[torch.Tensor, torch.Tensor]:
    """One draw from torch's default generator and one from the tracker's stream."""
    default = torch.rand(4)
    with get_rng_tracker().fork():
        stream = torch.rand(4)
    return default, stream


@pytest.mark.exercise("7.1")
def test_setting_the_states_again_replays_every_generator():
    from minimegatron.recompute import get_rng_states
    set_rng_states = implementation("7.1")
    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(0)
    states = get_rng_states()
    first = _draws()
    _draws()                                              # the generators move on
    set_rng_states(states)
    again = _draws()
    given = ("states = get_rng_states() (torch.manual_seed(0), the tracker's 'model-parallel-rng' stream seeded 1234), "
             "a draw of torch.rand(4) from each generator, a second draw, then set_rng_states(states)")
    assert_equal(again[0], first[0], "torch's default (CPU) generator's draw after set_rng_states", given=given,
                 why="set the saved states again and the generator draws the first draw's numbers again")
    assert_equal(again[1], first[1], "the tracker's stream's draw after set_rng_states", given=given,
                 why="tensor-parallel dropout draws from the tracker's streams (tp/random.py): set the saved states "
                     "again and the stream draws the first draw's numbers again")
    tracker.reset()


def _train_runs(runs):
    return [ch07.train_run(run) for run in runs]


@pytest.mark.exercise("7.1")
def test_tensor_parallel_recompute_with_your_states_equals_the_run_without():
    model = ch07.tiny_model()
    runs = [ch07.make_run(model, "full", tp=2, sp=False, dp=1), ch07.make_run(model, "full", tp=2, sp=True, dp=1)]
    per_rank = spawn(plugged(_train_runs, "7.1"), 2, runs, timeout=300)
    draws = ("torch's default generator (the dropout after the row-parallel layers, the same on both ranks) and the "
             "tracker's stream (attention dropout)", "the tracker's stream only (every dropout, under SP)")
    failures = []                                           # one message per run that differs
    for i, run in enumerate(runs):
        lines, problems = ch07.bit_for_bit([r[i] for r in per_rank])
        if problems:
            failures.append("\n".join([
                f"{run.name()}, your set_rng_states in the recompute: {problems[0]}",
                f"  given: the demo's tiny_model() (llama, h 32, 2 layers, float64, dropout {model.hidden_dropout}, "
                f"attention dropout {model.attention_dropout}), 2 steps of 2 micro-batches; its dropout draws from "
                f"{draws[i]}",
                "  want: every loss, gradient and parameter torch.equal to the same run without recompute: the "
                "recompute must draw the masks the first forward drew", *lines, *("  " + x for x in problems[1:4])]))
    if failures:
        raise AssertionError("\n".join(failures))


# --------------------------------------------------------------------------------------
# 7.2 full recompute's units
# --------------------------------------------------------------------------------------
@pytest.mark.exercise("7.2")
@pytest.mark.parametrize("layers, method, per_unit, want", [
    (4, "uniform", 1, [(0, 1, True), (1, 2, True), (2, 3, True), (3, 4, True)]),
    (5, "uniform", 2, [(0, 2, True), (2, 4, True), (4, 5, True)]),        # the last unit is shorter
    (3, "uniform", 3, [(0, 3, True)]),                                     # the whole chunk one unit
    (4, "block", 2, [(0, 1, True), (1, 2, True), (2, 3, False), (3, 4, False)]),
    (2, "block", 2, [(0, 1, True), (1, 2, True)]),
])
def test_the_units_are_megatrons(layers, method, per_unit, want):
    got = implementation("7.2")(layers, method, per_unit)
    assert_equal([tuple(u) for u in got], want, f"recompute_units({layers}, {method!r}, {per_unit})",
                 why=f"(start, end, recomputed) runs covering layers 0..{layers - 1} once, in order: " + (
                     f"units of {per_unit} layers, the last one shorter, all recomputed" if method == "uniform" else
                     f"one run per layer, the first {per_unit} recomputed"))


def _kept_bytes(method: str, per_unit: int) -> tuple[int, int]:
    """(measured, formula): the bytes a 4-layer model under full recompute keeps for the backward."""
    from minimegatron.analysis import activation_memory, measure_saved_activation_bytes
    from minimegatron.config import ModelConfig
    from minimegatron.model import GPTModel
    from minimegatron.recompute import apply_recompute
    cfg = ModelConfig.llama(hidden_size=32, num_layers=4, num_attention_heads=4, vocab_size=64,
                            max_position_embeddings=16, params_dtype="float32")
    tokens, labels = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    model = apply_recompute(GPTModel(cfg), "full", method, per_unit).train()
    measured = measure_saved_activation_bytes(model, tokens, labels)
    return measured, activation_memory(cfg, 2, 16, recompute_granularity="full", recompute_method=method,
                                       recompute_num_layers=per_unit)["total"]


@pytest.mark.exercise("7.2")
@pytest.mark.parametrize("method, per_unit", [("uniform", 2), ("block", 1)])
def test_the_model_with_your_units_keeps_what_the_formula_says(method, per_unit):
    """Uniform units of 2: the inputs of two units kept; block 1: one layer's input and three
    whole layers (analysis.activation_memory; measured with saved-tensor hooks)."""
    measured, want = plugged(_kept_bytes, "7.2")(method, per_unit)
    assert_equal(measured, want, "the bytes the model keeps for the backward (measured with saved-tensor hooks)",
                 given=f"a 4-layer llama (h 32, float32, batch 2 x 16 tokens) under full recompute, method {method!r}, "
                       f"{per_unit} layer(s) per unit, your recompute_units inside",
                 why="analysis.activation_memory's formula for the same recompute")
