"""The single-device GPT-MoE (chapter 05): the experts' two forms agree, the MoE
layer computes sum_k p_k expert_k(x) (+ the shared expert) as written out here independently,
the auxiliary losses reach the router's gradient with the micro-batch's scale and leave the
output alone, capacity drops tokens, the parameter count (total and active) matches the model,
and the command line takes Megatron's MoE flags while parallel layouts are refused by name."""

import math

import re

import pytest
import torch
import torch.nn.functional as F

from minimegatron.analysis import count_parameters
from minimegatron.arguments import parse_command_line
from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.model import GPTModel, MoELayer
from minimegatron.model.moe import experts_grouped, experts_loop
from minimegatron.optim import Optimizer
from minimegatron.parallel_state import Layout
from minimegatron.parallelize import validate_layout
from minimegatron.train import train_step


def _config(style="llama", **kw):
    base = dict(hidden_size=32, num_layers=2, num_attention_heads=4, vocab_size=64, max_position_embeddings=32,
                params_dtype="float64", num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
    return getattr(ModelConfig, style)(**{**base, **kw})


def _layer(cfg, seed=0):
    torch.manual_seed(seed)
    layer = MoELayer(cfg).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_the_grouped_experts_equal_the_loop(style):
    cfg = _config(style)
    layer = _layer(cfg)
    tokens = torch.randn(24, 32, dtype=torch.float64, requires_grad=True)
    _, probs, routing_map = layer.route(tokens)
    routing_map[:, 3] = False                                   # an expert without tokens
    experts = {int(e): m for e, m in layer.experts.local_experts.items()}
    dy = torch.randn(24, 32, dtype=torch.float64)
    results = []
    for form in (experts_loop, experts_grouped):
        out = form(tokens, probs, routing_map, experts)
        grads = torch.autograd.grad(out, [tokens, *layer.parameters()], dy, allow_unused=True, retain_graph=True)
        results.append((out, grads))
    (a, ga), (b, gb) = results
    assert torch.allclose(a, b, atol=1e-12)
    params = [None, *layer.parameters()]
    for x, y, p in zip(ga, gb, params):        # no gradient (the loop skips expert 3) = a zero one
        x = torch.zeros_like(p) if x is None else x
        y = torch.zeros_like(p) if y is None else y
        assert torch.allclose(x, y, atol=1e-12)


def test_the_layer_is_the_weighted_sum_of_its_chosen_experts():
    cfg = _config("gpt2", moe_shared_expert_intermediate_size=24)
    layer = _layer(cfg, seed=1)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    out = layer(x)
    # written out: softmax over each token's two largest logits, each expert's GELU MLP with biases
    def mlp(m, v):
        return F.linear(F.gelu(F.linear(v, m.linear_fc1.weight, m.linear_fc1.bias)), m.linear_fc2.weight,
                        m.linear_fc2.bias)
    expected = torch.zeros(10, 32, dtype=torch.float64)
    for t, v in enumerate(x.reshape(10, 32)):
        logits = layer.router.weight @ v
        top = logits.topk(2).indices
        weights = torch.softmax(logits[top], 0)
        for w, e in zip(weights, top.tolist()):
            expected[t] += w * mlp(layer.experts.local_experts[str(e)], v)
        expected[t] += mlp(layer.shared_experts, v)
    assert torch.allclose(out.reshape(10, 32), expected, atol=1e-12)


def test_aux_losses_reach_the_router_with_the_step_scale_and_leave_the_output_alone():
    cfg = _config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    layer = _layer(cfg, seed=2).train()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    w = torch.randn(2, 6, 32, dtype=torch.float64)
    layer.aux_loss_scale = 0.5
    out = layer(x)
    (out * w).sum().backward()
    got = layer.router.weight.grad.clone()
    # the same with the losses written out: E / (k T^2) sum_i (sum_t P) c_i and mean logsumexp^2
    layer.zero_grad()
    plain = MoELayer(cfg).double()
    plain.load_state_dict(layer.state_dict())
    plain.eval()                                                # no aux losses attached in eval mode
    out_plain = plain(x)
    assert torch.allclose(out_plain, out.detach(), atol=1e-12)  # the output itself is unchanged
    logits = x.reshape(12, 32) @ plain.router.weight.t()
    counts = torch.zeros(4, dtype=torch.float64).scatter_add(0, logits.topk(2, -1).indices.reshape(-1),
                                                             torch.ones(24, dtype=torch.float64))
    aux = 0.1 * 4 / (2 * 12 ** 2) * (torch.softmax(logits, -1).sum(0) * counts).sum()
    z = 0.01 * torch.logsumexp(logits, -1).pow(2).mean()
    ((out_plain * w).sum() + 0.5 * (aux + z)).backward()
    assert torch.allclose(got, plain.router.weight.grad, atol=1e-12)
    assert math.isclose(layer.aux_losses["load_balancing"], aux.item(), rel_tol=1e-12)
    assert math.isclose(layer.aux_losses["z_loss"], z.item(), rel_tol=1e-12)


def test_train_step_scales_the_aux_losses_by_the_micro_batches():
    cfg = _config(moe_aux_loss_coeff=0.01)
    model = GPTModel(cfg)
    optimizer = Optimizer([model], TrainConfig(train_iters=1, lr_warmup_iters=0, clip_grad=0.0))
    tokens = torch.randint(0, 64, (4, 9))
    mbs = [{"tokens": tokens[i:i + 2, :-1], "labels": tokens[i:i + 2, 1:]} for i in (0, 2)]
    train_step([model], optimizer, mbs, Layout(), 1e-3)
    assert all(m.aux_loss_scale == 0.5 for m in model.modules() if isinstance(m, MoELayer))


def test_capacity_keeps_at_most_its_slots_per_expert():
    cfg = _config(moe_expert_capacity_factor=0.5)
    layer = _layer(cfg, seed=3)
    _, probs, routing_map = layer.route(torch.randn(16, 32, dtype=torch.float64))
    # ceil(16 tokens x 2 / 4 experts x 0.5) = 4 slots per expert: 16 of the 32 routed copies at most
    assert (routing_map.sum(0) <= 4).all() and ((probs > 0) == routing_map).all()


def test_moe_layers_and_the_parameter_count():
    cfg = _config(num_layers=3, moe_layer_freq=2, moe_shared_expert_intermediate_size=24)
    model = GPTModel(cfg)
    kinds = [type(model.decoder.layers[str(i)].mlp).__name__ for i in range(3)]
    assert kinds == ["MoELayer", "MLP", "MoELayer"]
    counts = count_parameters(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    # one expert (SwiGLU, width 16): fc1 [32, 32] + fc2 [32, 16]; 2 MoE layers skip 4 - 2 experts each
    assert counts["moe"]["expert"] == 2 * 16 * 32 + 32 * 16
    assert counts["total"] - counts["active"] == 2 * 2 * counts["moe"]["expert"]


def test_command_line_and_layout_checks():
    model_cfg, _, _ = parse_command_line(["--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff",
                                          "0.01", "--moe-router-pre-softmax", "--moe-expert-capacity-factor", "1.25"])
    assert (model_cfg.num_experts, model_cfg.moe_router_topk, model_cfg.moe_router_pre_softmax) == (8, 2, True)
    assert model_cfg.moe_expert_capacity_factor == 1.25
    with pytest.raises(ConfigError, match="moe_router_topk=9 must be in \\[1, num_experts=8\\]"):
        ModelConfig(num_experts=8, moe_router_topk=9).validate()
    # every layout an expert grid cannot take is refused by name, before any process starts
    model = _config()                                               # 4 experts
    refusals = {
        "num_experts=4 is not divisible by expert_model_parallel_size=3":
            dict(expert_model_parallel_size=3),
        "needs sequence_parallel": dict(tensor_model_parallel_size=2),
        "is not divisible by expert_tensor_parallel_size=3 x expert_model_parallel_size=2":
            dict(expert_model_parallel_size=2, expert_tensor_parallel_size=3),
        "zero_stage=2": dict(expert_model_parallel_size=2, zero_stage=2),
        "ddp_impl='naive'": dict(expert_model_parallel_size=2, ddp_impl="naive"),
    }
    for message, sizes in refusals.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate_layout(model, TrainConfig(seq_length=32, **sizes), 4)
    with pytest.raises(ConfigError, match="a model without experts"):
        validate_layout(ModelConfig(), TrainConfig(seq_length=32, expert_model_parallel_size=2), 2)
    with pytest.raises(ConfigError, match="add_bias_linear"):
        validate_layout(ModelConfig.gpt2(**{**model.__dict__, "add_bias_linear": True}),
                        TrainConfig(seq_length=32, tensor_model_parallel_size=2, sequence_parallel=True), 2)
    validate_layout(model, TrainConfig(seq_length=32, expert_model_parallel_size=2), 4)     # ep 2 x expert dp 2


def test_moe_flops_match_the_flop_counter_and_megatrons_formula():
    """training_flops for a GPT-MoE (router, k experts per token, shared expert, a dense layer
    in between) equals what torch's FlopCounterMode measures on the model, matmul by matmul;
    its MLP part (everything but the router) equals Megatron's closed form."""
    from torch.utils.flop_counter import FlopCounterMode
    from minimegatron.analysis import megatron_mlp_flops, training_flops

    for style, extra in (("llama", dict(moe_shared_expert_intermediate_size=24, num_layers=3, moe_layer_freq=2)),
                         ("gpt2", dict(moe_router_topk=1))):
        cfg = _config(style, attention_backend="naive", **extra)
        b, s = 2, 12
        model = GPTModel(cfg)
        tokens = torch.randint(0, cfg.vocab_size, (b, s))
        with FlopCounterMode(display=False) as forward:
            loss = model(tokens, labels=tokens).sum()
        with FlopCounterMode(display=False) as backward:
            loss.backward()
        flops = training_flops(cfg, b, s)
        assert forward.get_total_flops() == flops["forward"]["total"], style
        assert backward.get_total_flops() == flops["backward"]["total"], style
        fwd = flops["forward"]
        mlp = 3 * sum(fwd[k] for k in ("fc1", "fc2", "experts_fc1", "experts_fc2", "shared_fc1", "shared_fc2"))
        assert mlp == megatron_mlp_flops(cfg, b * s), style
