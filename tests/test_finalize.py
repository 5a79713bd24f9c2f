"""model/finalize.py: the gradient hooks live on the modules they finish (`grad_finalizers`),
where a reader of build_model lists them, and finalize_model_grads runs each name once."""

from __future__ import annotations

from torch import nn

from minimegatron.config import ModelConfig
from minimegatron.model import GPTModel, finalize_model_grads, grad_finalizers, register_grad_finalizer
from minimegatron.model.moe import update_expert_bias


def test_hooks_run_outermost_module_first_then_in_registration_order():
    inner = nn.Linear(2, 2)
    outer = nn.Sequential(inner)
    calls = []
    register_grad_finalizer(inner, "b", lambda chunks: calls.append("b"))
    register_grad_finalizer(inner, "c", lambda chunks: calls.append("c"))
    register_grad_finalizer(outer, "a", lambda chunks: calls.append("a"))
    register_grad_finalizer(inner, "b", lambda chunks: calls.append("b again"))   # replaced in place
    assert list(inner.grad_finalizers) == ["b", "c"] and list(outer.grad_finalizers) == ["a"]
    assert list(grad_finalizers([outer])) == ["a", "b", "c"]
    finalize_model_grads([outer])
    assert calls == ["a", "b again", "c"]


def test_a_name_registered_on_every_chunk_runs_once_with_all_of_them():
    chunks = [nn.Linear(1, 1), nn.Linear(1, 1)]
    calls = []
    for i, chunk in enumerate(chunks):
        register_grad_finalizer(chunk, "sync", lambda got, i=i: calls.append((i, got)))
    finalize_model_grads(chunks)
    assert calls == [(0, chunks)]


def test_the_model_lists_what_it_registered():
    small = dict(hidden_size=16, num_layers=2, num_attention_heads=2, max_position_embeddings=8)
    assert grad_finalizers([GPTModel(ModelConfig(**small))]) == {}
    moe = GPTModel(ModelConfig(**small, num_experts=2))
    assert moe.grad_finalizers == {"expert-bias": update_expert_bias}
    assert grad_finalizers([moe]) == {"expert-bias": update_expert_bias}
