"""Chapter 05's router (minimegatron.moe.router) against hand-computed values: the choice and
the weights of each score function (Megatron-Core's semantics), group-limited routing, the
load-balancing loss in the Switch Transformer paper's own form, the z-loss, token dropping
with both policies and padding, and the expert-bias update."""

import math

import pytest
import torch

from minimegatron.moe import apply_token_dropping, aux_loss, expert_bias_update, expert_capacity, topk_routing, z_loss


def test_softmax_over_the_chosen_logits_by_default():
    probs, routing_map = topk_routing(torch.tensor([[1.0, 2.0, 3.0, 0.0]], dtype=torch.float64), 2)
    assert routing_map.tolist() == [[False, True, True, False]]
    e = math.e
    assert torch.allclose(probs, torch.tensor([[0.0, e**2 / (e**2 + e**3), e**3 / (e**2 + e**3), 0.0]],
                                              dtype=torch.float64))


def test_pre_softmax_keeps_the_probabilities_over_all_experts():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]], dtype=torch.float64)
    probs, _ = topk_routing(logits, 2, pre_softmax=True)
    z = sum(math.exp(x) for x in (1, 2, 3, 0))
    assert torch.allclose(probs, torch.tensor([[0.0, math.exp(2) / z, math.exp(3) / z, 0.0]], dtype=torch.float64))


def test_sigmoid_with_expert_bias_steers_the_choice_not_the_weights():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]], dtype=torch.float64)
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    probs, routing_map = topk_routing(logits, 2, score_function="sigmoid", expert_bias=bias)
    assert routing_map.tolist() == [[True, False, False, True]]            # expert 0 only thanks to its bias
    s0, s3 = 0.5, 1 / (1 + math.exp(-3))                                   # sigmoid scores, bias left out
    assert torch.allclose(probs, torch.tensor([[s0 / (s0 + s3), 0, 0, s3 / (s0 + s3)]], dtype=torch.float64))
    with pytest.raises(ValueError, match="expert_bias is used with score_function='sigmoid'"):
        topk_routing(logits, 2, expert_bias=bias)


def test_group_limited_routing_and_scaling():
    # groups {0, 1} and {2, 3}; each group's score = its best 2 // 1 = 2 scores summed: 5 + 0 < 4 + 4
    logits = torch.tensor([[5.0, 0.0, 4.0, 4.0]], dtype=torch.float64)
    probs, routing_map = topk_routing(logits, 2, num_groups=2, group_topk=1, scaling_factor=2.0)
    assert routing_map.tolist() == [[False, False, True, True]]           # expert 0 is best but its group loses
    assert torch.allclose(probs, torch.tensor([[0.0, 0.0, 1.0, 1.0]], dtype=torch.float64))   # 2 x softmax(4, 4)


def test_every_token_gets_exactly_topk_experts_and_the_weights_are_differentiable():
    logits = torch.randn(16, 8, dtype=torch.float64, requires_grad=True)
    probs, routing_map = topk_routing(logits, 3)
    assert (routing_map.sum(-1) == 3).all() and torch.allclose(probs.sum(-1), torch.ones(16, dtype=torch.float64))
    assert ((probs > 0) == routing_map).all()
    probs.pow(2).sum().backward()
    assert logits.grad.abs().sum() > 0


def test_aux_loss_is_the_switch_transformer_loss():
    torch.manual_seed(0)
    T, E, k, coeff = 12, 4, 2, 0.01
    logits = torch.randn(T, E, dtype=torch.float64, requires_grad=True)
    _, routing_map = topk_routing(logits, k)
    loss = aux_loss(logits, routing_map, k, coeff)
    # the paper's form: coeff * E * sum_i f_i P_i, f_i the fraction of the T k routed copies that go to
    # expert i, P_i the mean router probability of expert i
    f = routing_map.sum(0).double() / (T * k)
    P = torch.softmax(logits, -1).mean(0)
    assert torch.allclose(loss, coeff * E * (f * P).sum())
    loss.backward()
    assert logits.grad.abs().sum() > 0
    # uniform routing and uniform probabilities give the minimum, coeff
    uniform = aux_loss(torch.zeros(4, 4), torch.eye(4, dtype=torch.bool), 1, coeff)
    assert abs(uniform.item() - coeff) < 1e-9


def test_aux_loss_over_several_ranks_sums_to_the_loss_of_all_tokens():
    torch.manual_seed(1)
    logits = torch.randn(8, 4, dtype=torch.float64)
    _, routing_map = topk_routing(logits, 2)
    whole = aux_loss(logits, routing_map, 2, 0.1)
    counts = routing_map.sum(0)
    parts = sum(aux_loss(logits[i:i + 4], routing_map[i:i + 4], 2, 0.1, tokens_per_expert=counts, num_tokens=8)
                for i in (0, 4))
    assert torch.allclose(whole, parts)


def test_z_loss():
    assert torch.allclose(z_loss(torch.zeros(3, 2, dtype=torch.float64), 0.5),
                          torch.tensor(0.5 * math.log(2) ** 2, dtype=torch.float64))


def test_token_dropping_keeps_capacity_tokens_per_expert():
    # 4 tokens, 2 experts, top-1, capacity factor 1: ceil(4 x 1 / 2 x 1) = 2 slots per expert
    assert expert_capacity(4, 2, 1, 1.0) == 2
    probs = torch.tensor([[0.9, 0], [0.5, 0], [0.7, 0], [0.6, 0]], dtype=torch.float64)
    routing_map = probs > 0                                                # everything goes to expert 0
    kept_probs, kept = apply_token_dropping(probs, routing_map, 1, 1.0, "probs")
    assert kept[:, 0].tolist() == [True, False, True, False]               # the two largest weights
    assert kept_probs[:, 0].tolist() == [0.9, 0.0, 0.7, 0.0]
    _, kept = apply_token_dropping(probs, routing_map, 1, 1.0, "position")
    assert kept[:, 0].tolist() == [True, True, False, False]               # the first two in order
    kept_probs, slots = apply_token_dropping(probs, routing_map, 1, 1.0, "position", pad_to_capacity=True)
    assert slots.sum(0).tolist() == [2, 2] and kept_probs[:, 1].abs().sum() == 0   # expert 1: 2 empty slots
    _, kept = apply_token_dropping(probs, routing_map, 1, 4.0, "probs")    # capacity 8 >= 4 tokens: no drop
    assert (kept == routing_map).all()


def test_expert_bias_update_moves_towards_the_mean_load():
    bias = expert_bias_update(torch.tensor([3, 1, 2, 2]), torch.zeros(4), 0.001)
    assert torch.allclose(bias, torch.tensor([-0.001, 0.001, 0.0, 0.0]))
