"""Tests for minimegatron.tp.parallel: the one GPTModel cut by tp.apply_tensor_parallel, against
the single-device GPTModel.

ONE spawned world of 4 ranks: TP 2 on [0, 1] and [2, 3] (Megatron's contiguous TP groups),
TP 4 on the world. float64, vocabulary 257 (divisible by neither 2 nor 4), GPT-2 style (tied,
learned positions, biases, GELU, LayerNorm) and LLaMA style (untied, RoPE, GQA, SwiGLU,
RMSNorm, no biases). Each rank trains the TP model for 3 AdamW steps over its LOCAL shards
with the training loop's step (train.train_step; AdamW is elementwise, so sharded AdamW is
the full one; clipping is off here: tests/test_train_tp.py and the chapter's graders clip) and
compares losses, first-step gradients and final parameters, reassembled under single-device
names, with testing.single_device_run.
"""


import pytest
import torch
import torch.distributed as dist

from minimegatron.analysis import tensor_parallel_parameters
from minimegatron.comm import record_communication
from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.launch import spawn
from minimegatron.model import GPTModel
from minimegatron.optim import NormGroup, Optimizer, learning_rate
from minimegatron.parallelize import full_model_tensors
from minimegatron.placement import placement_of
from minimegatron.parallel_state import Layout
from minimegatron.testing import RunRecord, assert_equivalent, make_batches, single_device_run
from workers.checks import rank_failures, run_named_checks
from minimegatron.tp import apply_tensor_parallel, pad_vocab_size
from minimegatron.tp.random import model_parallel_manual_seed
from minimegatron.train import before_optimizer_step, train_step

WORLD = 4
CHECKS = []
E = 8                      # bytes per float64
STEPS, B, S = 3, 2, 16


def check(fn):
    CHECKS.append(fn)
    return fn


def gpt2(**kw):
    base = dict(vocab_size=257, hidden_size=32, num_layers=2, num_attention_heads=4,
                max_position_embeddings=S, params_dtype="float64")
    return ModelConfig.gpt2(**{**base, **kw})


def llama(tp, **kw):
    # GQA with 2 query heads per group; g must be divisible by tp, so g = tp
    return ModelConfig.llama(vocab_size=257, hidden_size=32, num_layers=2,
                             num_attention_heads=2 * tp, num_query_groups=tp,
                             max_position_embeddings=S, params_dtype="float64", **kw)


def tp_model(cfg, group):
    """The one model, cut over `group`: GPTModel(cfg), then apply_tensor_parallel."""
    return apply_tensor_parallel(GPTModel(cfg), group)


def is_split(p) -> bool:
    """Megatron's attribute (a field of the placement record): set on every parameter cut over the TP group."""
    return placement_of(p).tensor_model_parallel


def plain_gather(t, group):
    """Every rank's copy of t (plain torch.distributed: not the code under test, not counted)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def tp_run(cfg, group, batches, train_cfg):
    """The same loop as single_device_run (train.train_step) on the TP model; its RunRecord."""
    model = tp_model(cfg, group)
    tp_rank = dist.get_rank(group)
    optimizer = Optimizer([model], train_cfg, [NormGroup(groups=(group,), tp_rank=tp_rank)])   # this rank's shards
    layout = Layout(world=dist.get_world_size(), rank=dist.get_rank(), tp=dist.get_world_size(group),
                    tp_rank=tp_rank, tp_group=group)
    losses, first_grads = [], {}

    def on_grads():
        if first_grads:
            return
        first_grads.update(full_model_tensors([model], layout, grads=True))
        # replicated parameters: identical gradients on every TP rank, with no all-reduce
        for name, p in model.named_parameters():
            if not is_split(p):
                for other in plain_gather(p.grad, group):
                    assert torch.equal(other, p.grad), f"{name}: gradient differs across TP ranks"

    for step, batch in enumerate(batches):
        with before_optimizer_step(optimizer, on_grads):
            loss, _ = train_step([model], optimizer, [batch], layout, learning_rate(step, train_cfg))
        losses.append(loss)
    return RunRecord(losses, first_grads, full_model_tensors([model], layout))


# ---------------------------------------------------------------------- equivalence

@check
def check_training_equals_single_device(rank, G):
    for tp, group in G["tps"]:
        # Megatron's padding (to a multiple of 128 x tp): at tp 4, 257 ids in 512 rows, so the
        # last rank holds padding only
        megatron_padding = [gpt2(make_vocab_size_divisible_by=128)] if tp == 4 else []
        for cfg in (gpt2(), llama(tp), *megatron_padding):
            batches = make_batches(cfg, STEPS, B, S, seed=7)
            train_cfg = TrainConfig(train_iters=STEPS, lr_warmup_iters=0, clip_grad=0.0)
            reference = single_device_run(cfg, batches, train_cfg)
            record = tp_run(cfg, group, batches, train_cfg)
            try:
                assert_equivalent(reference, record, torch.float64)
            except AssertionError as e:
                raise AssertionError(f"tp={tp} {cfg.normalization}/{cfg.activation}: {e}") from None


@check
def check_initial_parameters_and_logits_equal_single_device(rank, G):
    tokens = make_batches(gpt2(), 1, B, S, seed=3)[0]["tokens"]
    for tp, group in G["tps"]:
        for cfg in (gpt2(), llama(tp)):
            ref = GPTModel(cfg)
            model = tp_model(cfg, group)
            full = full_model_tensors([model], Layout())
            assert set(full) == {n for n, _ in ref.named_parameters()}
            for name, p in ref.named_parameters():
                assert torch.equal(full[name], p.detach()), name   # cut, not re-drawn
            shard = model(tokens)                                  # [b, s, Vp/tp]
            assert shard.shape == (B, S, model.embedding.word_embeddings.padded_vocab_size // tp)
            logits = torch.cat(plain_gather(shard.detach(), group), dim=-1)[..., :cfg.vocab_size]
            torch.testing.assert_close(logits, ref(tokens).detach(), rtol=1e-12, atol=1e-12)


@check
def check_parameters_per_rank_equal_the_formula(rank, G):
    """analysis.tensor_parallel_parameters (from the config alone) against the real shards."""
    for tp, group in G["tps"]:
        for cfg in (gpt2(), llama(tp), gpt2(make_vocab_size_divisible_by=128)):
            model = tp_model(cfg, group)
            counts = {"split": 0, "replicated": 0}
            for name, p in model.named_parameters():
                counts["split" if is_split(p) else "replicated"] += p.numel()
            formula = tensor_parallel_parameters(cfg, tp)
            assert (counts["split"], counts["replicated"]) == (formula["split"], formula["replicated"]), \
                (tp, cfg.normalization, cfg.make_vocab_size_divisible_by, counts, formula)
            assert formula["per_rank"] == sum(counts.values())
            padded_rows = pad_vocab_size(cfg.vocab_size, tp, cfg.make_vocab_size_divisible_by) - cfg.vocab_size
            matrices = 2 if cfg.untie_embeddings_and_output_weights else 1
            assert formula["padding"] == matrices * padded_rows * cfg.hidden_size // tp


# ---------------------------------------------------------------------- communication

@check
def check_two_all_reduces_per_layer_forward_and_backward(rank, G):
    for tp, group in G["tps"]:
        cfg = gpt2()
        h, L = cfg.hidden_size, cfg.num_layers
        model = tp_model(cfg, group)
        bsh = B * S * h
        x = torch.randn(B, S, h, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        x.requires_grad_()
        with record_communication() as fwd:
            y = model.decoder.layers["0"](x, None)
        with record_communication() as bwd:
            y.sum().backward()
        # g after linear_proj, g after linear_fc2; f before linear_qkv, f before linear_fc1
        for ledger, tag in ((fwd, "fwd"), (bwd, "bwd")):
            assert ledger.count() == ledger.count("all_reduce", group, tag) == 2, ledger.records
            assert [r.shape for r in ledger.records] == [(B, S, h)] * 2
            assert ledger.total_bytes() == 2 * bsh * E

        # the whole model with the loss: embedding 1 + 2 per layer of [b, s, h], loss 3 of [b, s]
        batch = make_batches(cfg, 1, B, S, seed=1)[0]
        with record_communication() as fwd:
            losses = model(batch["tokens"], labels=batch["labels"])
        with record_communication() as bwd:
            losses.mean().backward()
        assert fwd.count() == fwd.count("all_reduce", group, "fwd") == 1 + 2 * L + 3
        assert fwd.total_bytes() == (1 + 2 * L) * bsh * E + 3 * B * S * E
        # the loss path moves b*s numbers per all-reduce, never the [b, s, Vp/tp] logits
        assert sum(r.shape == (B, S) for r in fwd.records) == 3
        assert max(r.nbytes for r in fwd.records) == bsh * E < B * S * cfg.vocab_size * E
        # backward: 2 per layer, plus the output layer's f; the embedding and loss need none
        assert bwd.count() == bwd.count("all_reduce", group, "bwd") == 2 * L + 1
        assert bwd.total_bytes() == (2 * L + 1) * bsh * E


# ---------------------------------------------------------------------- dropout streams

@check
def check_dropout_masks_shared_on_replicated_and_per_rank_on_split_activations(rank, G):
    tp, group = G["tps"][0]                                  # tp 2
    tokens = make_batches(gpt2(), 1, B, S, seed=5)
    batch = tokens[0]

    # hidden dropout only: the masks are the default stream's, drawn in the single-device
    # order, so the TP model in train mode computes exactly the single-device losses
    cfg = gpt2(hidden_dropout=0.3)
    ref = GPTModel(cfg).train()
    torch.manual_seed(11)
    expected = ref(batch["tokens"], labels=batch["labels"]).detach()
    model = tp_model(cfg, group).train()
    model_parallel_manual_seed(11, tp_rank=dist.get_rank(group))
    got = model(batch["tokens"], labels=batch["labels"]).detach()
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)

    # attention dropout: give both ranks the SAME query/key/value weights (the first rank's
    # rows twice), so that without dropout their heads compute identical outputs; with it,
    # the per-rank stream must cut different masks. The residual stream stays replicated.
    cfg = gpt2(attention_dropout=0.3, hidden_dropout=0.3)
    model = tp_model(cfg, group)
    qkv = model.decoder.layers["0"].self_attention.linear_qkv
    with torch.no_grad():
        first = plain_gather(qkv.weight.detach(), group)[0]
        qkv.weight.copy_(first)
        if qkv.bias is not None:
            qkv.bias.copy_(plain_gather(qkv.bias.detach(), group)[0])
    seen = {}
    model.decoder.layers["0"].self_attention.linear_proj.register_forward_hook(
        lambda m, inp, out: seen.__setitem__("heads", inp[0].detach()))
    model.decoder.layers["0"].register_forward_hook(lambda m, inp, out: seen.__setitem__("residual", out.detach()))
    model_parallel_manual_seed(11, tp_rank=dist.get_rank(group))
    model.eval()(batch["tokens"])
    a, b = plain_gather(seen["heads"], group)
    assert torch.equal(a, b), "set-up: identical weights should give identical heads without dropout"
    model.train()(batch["tokens"])
    a, b = plain_gather(seen["heads"], group)
    assert not torch.equal(a, b), "attention dropout drew the same mask on both TP ranks"
    r0, r1 = plain_gather(seen["residual"], group)
    assert torch.equal(r0, r1), "the replicated residual stream differs across TP ranks"


# ---------------------------------------------------------------------- bad input

@check
def check_config_errors_name_the_numbers(rank, G):
    world = G["tps"][-1][1]
    with pytest.raises(ConfigError, match="num_query_groups=2 is not divisible by the "
                                          "tensor-parallel size tp=4"):
        tp_model(llama(2), world)
    with pytest.raises(ConfigError, match="num_attention_heads=2 is not divisible by the "
                                          "tensor-parallel size tp=4"):
        tp_model(gpt2(num_attention_heads=2), world)


# ---------------------------------------------------------------------- the spawned world

def run_checks():
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]   # every rank creates every group
    G = {"tps": [(2, pairs[rank // 2]), (4, dist.group.WORLD)]}
    return run_named_checks(CHECKS, rank, G)


@pytest.fixture(scope="module")
def world_results():
    return spawn(run_checks, WORLD, timeout=120.0, collective_timeout=30.0)


@pytest.mark.parametrize("name", [fn.__name__ for fn in CHECKS])
def test_in_world_of_4(world_results, name):
    failures = rank_failures(world_results, name)
    assert not failures, failures
