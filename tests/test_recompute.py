"""Activation recompute (minimegatron/recompute.py, chapter 07): Megatron's flags and rules; the
units full recompute cuts; and on every layout, the run with recompute equal bit for bit to the
same run without (dropout on, tensor-parallel streams, the pipeline's micro-batches in flight,
context-parallel rings run again, experts, bf16 and FP8), with its recomputed collectives in the
ledger under their tags after "recompute "."""

import dataclasses

import pytest
import torch

from minimegatron.arguments import parse_command_line
from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.launch import spawn
from minimegatron.parallelize import validate_layout
from minimegatron.recompute import recompute_units
from minimegatron.testing import make_batches, single_device_run
from tests.workers import recompute as W


# ---------------------------------------------------------------------------------------
# flags and rules
# ---------------------------------------------------------------------------------------
def test_megatron_flags_set_the_fields():
    _, cfg, _ = parse_command_line(["--recompute-granularity", "full", "--recompute-method", "block",
                                    "--recompute-num-layers", "1"], world_size=1)
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "block", 1)
    _, cfg, _ = parse_command_line(["--recompute-granularity", "selective", "--recompute-modules", "core_attn",
                                    "mlp"], world_size=1)
    assert cfg.recompute_modules == ("core_attn", "mlp")
    _, cfg, _ = parse_command_line(["--recompute-activations"], world_size=1)     # Megatron's older switch
    assert cfg.recompute_granularity == "selective" and cfg.recompute_modules == ("core_attn",)


@pytest.mark.parametrize("fields, message", [
    (dict(recompute_granularity="full"), "needs recompute_method 'uniform' or 'block', got None"),
    (dict(recompute_granularity="full", recompute_method="uniform"), "needs recompute_num_layers >= 1, got None"),
    (dict(recompute_granularity="selective", recompute_method="block"), "are for recompute_granularity='full'"),
    (dict(recompute_granularity="selective", recompute_modules=("shared_experts",)), "is Megatron's, not in this book"),
    (dict(recompute_granularity="selective", recompute_modules=("attn",)), "'attn' is not one of core_attn"),
    (dict(recompute_granularity="partial"), "recompute_granularity='partial' is not 'full' or 'selective'"),
])
def test_a_combination_megatron_refuses_is_named(fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**fields).validate()


def test_the_layout_checks_name_the_numbers():
    model = ModelConfig.llama(hidden_size=32, num_layers=4, num_attention_heads=4, vocab_size=64)
    too_many = TrainConfig(recompute_granularity="full", recompute_method="block", recompute_num_layers=3,
                           pipeline_model_parallel_size=2)
    with pytest.raises(ConfigError, match="recompute_num_layers=3 must be between 1 and the 2 layers of a model chunk"):
        validate_layout(model, too_many, 2)
    with pytest.raises(ConfigError, match="zero_stage=3"):
        validate_layout(model, TrainConfig(recompute_granularity="selective", zero_stage=3), 2)


def test_uniform_cuts_units_and_block_recomputes_the_first_layers():
    assert recompute_units(5, "uniform", 2) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    assert recompute_units(4, "block", 1) == [(0, 1, True), (1, 2, False), (2, 3, False), (3, 4, False)]


# ---------------------------------------------------------------------------------------
# one process: every granularity equals the run without, dropout on
# ---------------------------------------------------------------------------------------
def _model(layers=4, dropout=0.1, attention_dropout=None, experts=None, dtype="float64", style="llama"):
    return getattr(ModelConfig, style)(
        hidden_size=32, num_layers=layers, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        vocab_size=64, max_position_embeddings=32, params_dtype=dtype, hidden_dropout=dropout,
        attention_dropout=dropout if attention_dropout is None else attention_dropout,
        **({"num_experts": experts, "moe_router_topk": 2} if experts else {}))


BASE = TrainConfig(seq_length=16, micro_batch_size=2, grad_accum_steps=2, train_iters=2, lr=1e-2, lr_warmup_iters=0,
                   eval_interval=0, progress=False)
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _one_device(model, cfg, batches):
    torch.manual_seed(0)                             # the dropout masks
    return single_device_run(model, batches, cfg, grad_accum_steps=cfg.grad_accum_steps)


@pytest.mark.parametrize("style", ["llama", "gpt2"])
@pytest.mark.parametrize("recompute", [
    FULL, dict(FULL, recompute_num_layers=3), dict(FULL, recompute_method="block", recompute_num_layers=2),
    dict(recompute_granularity="selective", recompute_modules=("core_attn", "mlp")),
    dict(recompute_granularity="selective", recompute_modules=("layernorm",)),
], ids=["full-uniform-1", "full-uniform-3", "full-block-2", "selective-core_attn-mlp", "selective-layernorm"])
def test_recompute_equals_the_run_without_on_one_device(style, recompute):
    """Bit for bit, dropout on: the random states of the first forward are set again for the
    recompute. One exception, stated in the chapter: recomputing the book's written-out RMSNorm
    adds its input's two gradient paths before the residual's, not with it (summation order)."""
    model = _model(style=style)
    batches = make_batches(model, 2, 4, 16)
    plain = _one_device(model, BASE, batches)
    run = _one_device(model, dataclasses.replace(BASE, **recompute), batches)
    assert run.losses == plain.losses
    exact = not (style == "llama" and "layernorm" in recompute.get("recompute_modules", ()))
    for kind in ("grads", "params"):
        for name, want in getattr(plain, kind).items():
            got = getattr(run, kind)[name]
            if exact:
                assert torch.equal(got, want), (kind, name, (got - want).abs().max())
            else:
                torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)     # the float64 row of testing.TOLERANCES


def test_a_recompute_that_draws_other_masks_is_caught():
    """The check above can fail: recompute without setting the random states again draws
    other dropout masks in the backward, and the gradients differ."""
    from minimegatron import recompute
    model = _model()
    batches = make_batches(model, 1, 4, 16)
    plain = _one_device(model, dataclasses.replace(BASE, train_iters=1), batches)
    real = recompute.set_rng_states
    recompute.set_rng_states = lambda states: None
    try:
        run = _one_device(model, dataclasses.replace(BASE, train_iters=1, **FULL), batches)
    finally:
        recompute.set_rng_states = real
    assert any(not torch.equal(run.grads[n], g) for n, g in plain.grads.items())


# ---------------------------------------------------------------------------------------
# every layout: the run with recompute equals the same run without, bit for bit
# ---------------------------------------------------------------------------------------
STEPS = 2


def _layout(name, model, recompute, tp=1, cp=1, pp=1, dp=1, sp=False, ep=1, chunks=1, **train):
    cfg = dataclasses.replace(
        BASE, train_iters=STEPS, tensor_model_parallel_size=tp, context_parallel_size=cp,
        pipeline_model_parallel_size=pp, sequence_parallel=sp, expert_model_parallel_size=ep,
        num_virtual_stages_per_pipeline_rank=chunks, pipeline_schedule="interleaved" if chunks > 1 else "1f1b",
        **recompute, **train)
    assert tp * cp * pp * dp == 4
    return name, model, cfg, dp, make_batches(model, STEPS, cfg.micro_batch_size * cfg.grad_accum_steps * dp,
                                              cfg.seq_length)


SELECTIVE = dict(recompute_granularity="selective")
FP8 = dict(fp8_format="hybrid", fp8_amax_history_len=4, fp8_amax_compute_algo="max")
LAYOUTS = [
    _layout("full uniform, tp2 + SP x dp2, dropout", _model(), FULL, tp=2, sp=True, dp=2),
    _layout("full block, pp2 interleaved x dp2", _model(), dict(FULL, recompute_method="block"), pp=2, dp=2,
            chunks=2, grad_accum_steps=4),
    # GPT-2's LayerNorm is one autograd node (F.layer_norm): its recompute is exact too
    _layout("selective core_attn + layernorm, tp2 x cp2 (the ring again)", _model(attention_dropout=0.0, style="gpt2"),
            dict(SELECTIVE, recompute_modules=("core_attn", "layernorm")), tp=2, cp=2),
    _layout("selective moe + core_attn, tp2 + SP x ep2 x dp2", _model(experts=4, dropout=0.0),
            dict(SELECTIVE, recompute_modules=("core_attn", "moe")), tp=2, sp=True, ep=2, dp=2),
    _layout("selective moe_act + mlp, ep2 x pp2", _model(experts=4, dropout=0.0),
            dict(SELECTIVE, recompute_modules=("moe_act", "mlp")), pp=2, ep=2, dp=2),
    _layout("bf16, full uniform 2, tp2 x pp2", _model(dtype="bfloat16"), dict(FULL, recompute_num_layers=2),
            tp=2, pp=2, bf16=True),
    _layout("FP8 delayed, full uniform, tp2 + SP x pp2", _model(dropout=0.0), FULL, tp=2, sp=True, pp=2,
            fp8_recipe="delayed", **FP8),
    _layout("FP8 tensorwise, selective mlp, tp2 + SP x dp2", _model(dropout=0.0),
            dict(SELECTIVE, recompute_modules=("mlp",)), tp=2, sp=True, dp=2, fp8_recipe="tensorwise", **FP8),
]


@pytest.fixture(scope="module")
def trained():
    return spawn(W.with_and_without_recompute, 4, LAYOUTS, timeout=600)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[name for name, *_ in LAYOUTS])
def test_each_layout_with_recompute_equals_the_same_layout_without(trained, index):
    name = LAYOUTS[index][0]
    for rank, runs in enumerate(trained):
        plain, run = runs[index]["plain"], runs[index]["recompute"]
        assert run["losses"] == plain["losses"], (name, rank)
        for kind in ("grads", "params"):
            for key, want in plain[kind].items():
                assert torch.equal(run[kind][key], want), (name, rank, kind, key, (run[kind][key] - want).abs().max())
    assert plain["recomputed"] == []


def test_the_recomputed_collectives_are_in_the_ledger_under_their_own_tag(trained):
    by_name = {name: i for i, (name, *_) in enumerate(LAYOUTS)}
    ranks = trained
    tp_sp = ranks[0][by_name["full uniform, tp2 + SP x dp2, dropout"]]["recompute"]["recomputed"]
    assert {op for op, _ in tp_sp} == {"all_gather", "reduce_scatter"}        # SP's forward, again
    ring = ranks[0][by_name["selective core_attn + layernorm, tp2 x cp2 (the ring again)"]]["recompute"]["recomputed"]
    assert {op for op, _ in ring} == {"send", "recv"}                         # the ring, and nothing of tp
    fp8 = ranks[0][by_name["FP8 delayed, full uniform, tp2 + SP x pp2"]]["recompute"]["recomputed"]
    assert fp8 and all(nbytes > 4 for op, nbytes in fp8)                      # no amax taken again


def test_every_recomputed_message_is_the_one_the_formula_adds(trained):
    """run_report's check of each rank's step against analysis.step_communication, whose
    "recompute ..." lines count the forwards run again."""
    from minimegatron.run_report import communication_checks
    for index, (name, model, cfg, dp, _) in enumerate(LAYOUTS):
        checks = communication_checks(model, cfg, [runs[index]["summary"] for runs in trained])
        assert not any(checks.values()), (name, {dim: found[:1] for dim, found in checks.items() if found})


# ---------------------------------------------------------------------------------------
# memory: what a forward keeps for the backward, measured against analysis.activation_memory
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("style, backend, dtype", [("llama", "sdpa", "float32"), ("gpt2", "naive", "float32"),
                                                   ("llama", "naive", "bfloat16"), ("gpt2", "sdpa", "float64")])
@pytest.mark.parametrize("recompute", [
    {}, FULL, dict(FULL, recompute_num_layers=3), dict(FULL, recompute_method="block", recompute_num_layers=2),
    dict(recompute_granularity="selective", recompute_modules=("core_attn",)),
    dict(recompute_granularity="selective", recompute_modules=("mlp",)),
    dict(recompute_granularity="selective", recompute_modules=("layernorm",)),
    dict(recompute_granularity="selective", recompute_modules=("core_attn", "mlp", "layernorm")),
], ids=["none", "full-uniform-1", "full-uniform-3", "full-block-2", "core_attn", "mlp", "layernorm", "all-three"])
def test_the_bytes_kept_for_the_backward_are_the_formula(style, backend, dtype, recompute):
    from minimegatron.analysis import activation_memory, measure_saved_activation_bytes
    from minimegatron.model import GPTModel
    from minimegatron.recompute import apply_recompute
    model_cfg = dataclasses.replace(_model(dropout=0.1 if backend == "naive" else 0.0, dtype=dtype, style=style),
                                    attention_backend=backend)
    model = apply_recompute(GPTModel(model_cfg), recompute.get("recompute_granularity"),
                            recompute.get("recompute_method"), recompute.get("recompute_num_layers"),
                            recompute.get("recompute_modules", ("core_attn",))).train()
    b, s = 2, 16
    tokens = torch.randint(0, model_cfg.vocab_size, (b, s))
    labels = torch.randint(0, model_cfg.vocab_size, (b, s))
    measured = measure_saved_activation_bytes(model, tokens, labels)
    assert measured == activation_memory(model_cfg, b, s, **recompute)["total"]
