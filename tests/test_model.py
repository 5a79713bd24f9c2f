"""The baseline model: shapes, dtypes, causality, GQA, RoPE, the loss, SwiGLU, init, pipeline stages, errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from minimegatron.config import ConfigError, ModelConfig
from minimegatron.placement import placement_of
from minimegatron.model import (GPTModel, apply_rotary_pos_emb, causal_attention, initial_value, language_model_loss,
                                 rope_cos_sin, sdpa_attention)
from minimegatron.model.mlp import SwiGLU

STYLES = {
    "gpt2": ModelConfig.gpt2(hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=16),
    "gpt2-untied": ModelConfig.gpt2(hidden_size=32, num_layers=2, num_attention_heads=4,
                                    max_position_embeddings=16, untie_embeddings_and_output_weights=True),
    "llama": ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                               max_position_embeddings=16),
    "llama-tied": ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=1,
                                    max_position_embeddings=16, untie_embeddings_and_output_weights=False),
}


def _with(cfg: ModelConfig, **kw) -> ModelConfig:
    return ModelConfig(**{**cfg.__dict__, **kw})


def _tokens(b=2, s=16, vocab=257, seed=0):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_forward_backward_shapes_and_dtypes(style, dtype):
    cfg = _with(STYLES[style], params_dtype=dtype)
    model = GPTModel(cfg)
    tokens = _tokens()
    logits = model(tokens)
    assert logits.shape == (2, 16, cfg.vocab_size) and logits.dtype == cfg.dtype
    labels = _tokens(seed=1)
    losses = model(tokens, labels=labels)
    assert losses.shape == (2, 16)
    losses.mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    # At initialisation (std 0.02) the logits are near zero: the loss on unrelated labels is
    # close to ln V (the uniform distribution's cross-entropy).
    assert abs(losses.mean().item() - math.log(cfg.vocab_size)) < 0.1


def test_tied_and_untied_output_layer():
    tied, untied = GPTModel(STYLES["gpt2"]), GPTModel(STYLES["gpt2-untied"])
    # tied: the output layer exists (tensor parallelism swaps it) but owns no weight; the
    # logits use the word embedding, and the names are the single-device ones
    assert tied.output_layer is not None and tied.output_layer.weight is None
    assert tied.output_weight() is tied.embedding.word_embeddings.weight
    assert "output_layer.weight" not in dict(tied.named_parameters())
    assert not any(k.startswith("output_layer") for k in tied.state_dict())
    assert set(tied.state_dict()) == set(dict(tied.named_parameters()))
    assert "output_layer.weight" in dict(untied.named_parameters())
    assert "output_layer.weight" in untied.state_dict()
    assert untied.output_weight() is untied.output_layer.weight
    assert not getattr(untied.output_layer.weight, "shared", False)
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == 257 * 32


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("backend", ["naive", "sdpa"])
def test_causal_future_tokens_do_not_change_the_past(style, backend):
    model = GPTModel(_with(STYLES[style], params_dtype="float64", attention_backend=backend))
    a = _tokens(1, 16, seed=1)
    b = a.clone()
    b[:, 10:] = _tokens(1, 6, seed=2)
    la, lb = model(a), model(b)
    assert torch.equal(la[:, :10], lb[:, :10])
    assert not torch.allclose(la[:, 10:], lb[:, 10:])


def test_naive_attention_equals_pytorch_sdpa():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, generator=g, dtype=torch.float64) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(causal_attention(q, k, v), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 1), (4, 4)])
def test_sdpa_with_shared_kv_heads_equals_naive_on_repeated_heads(heads, kv_heads):
    """sdpa_attention takes k, v with g heads (no copies); the oracle is the written-out
    attention on k, v repeated to a heads. Outputs and all three gradients, float64."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, 13, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 13, 8, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    n = heads // kv_heads
    fast = sdpa_attention(q, k, v)
    oracle = causal_attention(q, k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1))
    torch.testing.assert_close(fast, oracle, rtol=1e-12, atol=1e-12)
    grad_out = torch.randn(fast.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(fast, (q, k, v), grad_out)
    expected = torch.autograd.grad(oracle, (q, k, v), grad_out)
    for name, x, y in zip("qkv", got, expected):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12, msg=f"grad of {name}")


@pytest.mark.parametrize("style", sorted(STYLES))
def test_default_sdpa_backend_trains_like_the_naive_one(style):
    """The default backend (sdpa) and the book's written-out one compute the same model: equal
    losses and gradients in float64, for MHA, GQA and MQA."""
    assert ModelConfig().attention_backend == "sdpa"
    cfg = _with(STYLES[style], params_dtype="float64")
    fast, naive = GPTModel(cfg), GPTModel(_with(cfg, attention_backend="naive"))
    tokens, labels = _tokens(), _tokens(seed=1)
    losses = {}
    for name, model in (("sdpa", fast), ("naive", naive)):
        losses[name] = model(tokens, labels=labels).mean()
        losses[name].backward()
    torch.testing.assert_close(losses["sdpa"], losses["naive"], rtol=1e-12, atol=1e-12)
    grads = dict(naive.named_parameters())
    for name, p in fast.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-10, atol=1e-12, msg=name)


def test_sdpa_backend_does_not_copy_kv_heads():
    """Grouped-query attention on the default path reads each k, v head in place: no
    repeat_interleave (the naive path, the oracle, does copy them)."""
    cfg = _with(STYLES["llama"], params_dtype="float64")
    assert cfg.query_groups < cfg.num_attention_heads
    ops = {}
    for backend in ("sdpa", "naive"):
        model = GPTModel(_with(cfg, attention_backend=backend))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(_tokens(), labels=_tokens(seed=1)).mean().backward()
        ops[backend] = {e.name for e in prof.events()}
    assert "aten::repeat_interleave" in ops["naive"]      # the check can see a copy
    assert "aten::repeat_interleave" not in ops["sdpa"], sorted(o for o in ops["sdpa"] if "attention" in o)


def test_loss_equals_pytorch_cross_entropy():
    """language_model_loss (CrossEntropy, whose backward works in place in what the forward
    saved) gives F.cross_entropy's losses and gradients; float32 for 16-bit logits, the
    gradient back in the logits' dtype; a second backward through the graph refuses."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    weights = torch.rand(3, 5, dtype=torch.float64, generator=g)      # as a loss mask / mean would
    oracle = F.cross_entropy(logits.reshape(15, 11), labels.reshape(15), reduction="none").view(3, 5)
    expected = torch.autograd.grad((oracle * weights).sum(), logits)[0]
    loss = language_model_loss(logits, labels)
    torch.testing.assert_close(loss, oracle, rtol=1e-14, atol=1e-14)
    total = (loss * weights).sum()
    torch.testing.assert_close(torch.autograd.grad(total, logits, retain_graph=True)[0], expected,
                               rtol=1e-14, atol=1e-14)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(total, logits)            # the saved log-probabilities were consumed

    half = logits.detach().bfloat16().requires_grad_()
    loss = language_model_loss(half, labels)
    assert loss.dtype == torch.float32
    loss.sum().backward()
    assert half.grad.dtype == torch.bfloat16


def test_swiglu_equals_autograd_on_its_halves_without_a_concatenation():
    """The SwiGLU autograd function equals silu(gate) * up differentiated by autograd, and its
    backward writes d[gate; up] in one tensor: no aten::cat (autograd's version has one)."""
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float64, 1e-15), (torch.float32, 1e-6)):
        y = torch.randn(3, 4, 2 * 6, dtype=dtype, generator=g, requires_grad=True)   # [.., 2f], f = 6
        d_out = torch.randn(3, 4, 6, dtype=dtype, generator=g)
        gate, up = y.chunk(2, dim=-1)
        oracle = F.silu(gate) * up
        out = SwiGLU.apply(y)
        torch.testing.assert_close(out, oracle, rtol=tol, atol=tol)
        torch.testing.assert_close(torch.autograd.grad(out, y, d_out)[0],
                                   torch.autograd.grad(oracle, y, d_out)[0], rtol=tol, atol=tol)
    ops = {}
    for name, fn in (("autograd", lambda t: F.silu(t.chunk(2, -1)[0]) * t.chunk(2, -1)[1]), ("SwiGLU", SwiGLU.apply)):
        y = torch.randn(8, 12, requires_grad=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn(y).sum().backward()
        ops[name] = {e.name for e in prof.events()}
    assert "aten::cat" in ops["autograd"]                 # the check can see the concatenation
    assert "aten::cat" not in ops["SwiGLU"]


def test_gqa_equals_multi_head_attention_with_repeated_kv_heads():
    """A GQA model equals an MHA model whose key/value heads are copies of the group's heads."""
    gqa_cfg = ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                                max_position_embeddings=16, params_dtype="float64")
    mha_cfg = _with(gqa_cfg, num_query_groups=4)
    gqa, mha = GPTModel(gqa_cfg), GPTModel(mha_cfg)
    a, g, d, h = 4, 2, 8, 32
    state = gqa.state_dict()
    for i in range(gqa_cfg.num_layers):
        name = f"decoder.layers.{i}.self_attention.linear_qkv.weight"
        w = state[name].view(g, a // g + 2, d, h)               # per group: q heads, k, v
        heads = []
        for head in range(a):
            group = head // (a // g)
            heads.append(torch.stack([w[group, head % (a // g)], w[group, -2], w[group, -1]]))
        state[name] = torch.stack(heads).reshape((a + 2 * a) * d, h)   # MHA layout: [q, k, v] per head
    mha.load_state_dict(state)
    tokens = _tokens()
    torch.testing.assert_close(mha(tokens), gqa(tokens), rtol=1e-12, atol=1e-12)


def test_rope_is_a_rotation_with_relative_positions():
    g = torch.Generator().manual_seed(0)
    d = 8
    q = torch.randn(1, 1, 1, d, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 1, d, generator=g, dtype=torch.float64)

    def rotated(x, pos):
        cos, sin = rope_cos_sin(torch.tensor([pos]), d, dtype=torch.float64)
        return apply_rotary_pos_emb(x, cos, sin)

    # norm preserved: a rotation
    assert torch.allclose(rotated(q, 5).norm(), q.norm())
    # position 0 is the identity
    assert torch.allclose(rotated(q, 0), q)
    # the score depends only on the distance m - n
    s1 = (rotated(q, 7) * rotated(k, 3)).sum()
    s2 = (rotated(q, 14) * rotated(k, 10)).sum()
    s3 = (rotated(q, 8) * rotated(k, 3)).sum()
    assert torch.allclose(s1, s2) and not torch.allclose(s1, s3)
    # channel j pairs with j + d/2 (rotate half): by hand for pair 0, angle = position * 1
    x = torch.zeros(1, 1, 1, d, dtype=torch.float64)
    x[..., 0] = 1.0
    y = rotated(x, 1)
    assert torch.allclose(y[..., 0], torch.tensor(math.cos(1.0), dtype=torch.float64))
    assert torch.allclose(y[..., d // 2], torch.tensor(math.sin(1.0), dtype=torch.float64))


def test_init_depends_only_on_seed_and_name():
    cfg = STYLES["llama"]
    model = GPTModel(cfg)
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    p = dict(model.named_parameters())[name]
    assert torch.equal(p, initial_value(name, tuple(p.shape), cfg))
    # a pipeline stage holding only layer 1 starts from the same values
    stage = GPTModel(cfg, pre_process=False, layer_numbers=[1])
    assert torch.equal(dict(stage.named_parameters())[name], p)
    # another name, another seed: other values
    other = dict(model.named_parameters())["decoder.layers.0.mlp.linear_fc1.weight"]
    assert not torch.equal(other, p)
    assert not torch.equal(GPTModel(_with(cfg, seed=7)).state_dict()[name], p)
    # the residual projections are scaled by 1/sqrt(2L) (Megatron's scaled init)
    proj = dict(model.named_parameters())["decoder.layers.0.self_attention.linear_proj.weight"]
    assert 0.5 < proj.std().item() / (0.02 / math.sqrt(2 * cfg.num_layers)) < 1.5
    # dtypes start from the same draws
    p64 = dict(GPTModel(_with(cfg, params_dtype="float64")).named_parameters())[name]
    assert torch.equal(p64.float(), p)


@pytest.mark.parametrize("style", ["gpt2", "llama", "gpt2-untied"])
def test_pipeline_stages_chained_equal_the_full_model(style):
    cfg = _with(STYLES[style], params_dtype="float64", num_layers=3)
    full = GPTModel(cfg)
    first = GPTModel(cfg, post_process=False, layer_numbers=[0, 1])
    last = GPTModel(cfg, pre_process=False, layer_numbers=[2])
    tokens = _tokens()
    assert torch.equal(last(hidden_states=first(tokens), labels=tokens), full(tokens, labels=tokens))


def test_tied_output_layer_on_a_last_stage_without_the_embedding_is_a_shared_copy():
    """A pipeline's last stage of a tied model holds its own copy of the word embedding, as
    output_layer.weight, its placement record marked shared (the gradient norm and the gatherer
    count it once) and shared_embedding (ZeRO's own bucket), like the first stage's embedding (not
    shared: the original); it starts equal to the embedding of the full model. A model that holds
    both uses marks neither."""
    cfg = STYLES["gpt2"]
    full = GPTModel(cfg)
    last = GPTModel(cfg, pre_process=False, layer_numbers=[1])
    first = GPTModel(cfg, post_process=False, layer_numbers=[0])
    weight = dict(last.named_parameters())["output_layer.weight"]
    record = placement_of(weight)
    assert (record.name, record.shape, record.shared, record.shared_embedding) == (
        "output_layer.weight", (cfg.vocab_size, cfg.hidden_size), True, True)
    embedding = placement_of(first.embedding.word_embeddings.weight)
    assert (embedding.name, embedding.shared, embedding.shared_embedding) == ("embedding.word_embeddings.weight", False, True)
    assert not any(placement_of(p).shared or placement_of(p).shared_embedding for p in full.parameters())
    assert last.output_weight() is weight
    assert torch.equal(weight, full.embedding.word_embeddings.weight)


@pytest.mark.parametrize("overrides, words", [
    (dict(hidden_size=30, num_attention_heads=4), ["hidden_size=30", "num_attention_heads=4"]),
    (dict(num_attention_heads=4, num_query_groups=3), ["num_attention_heads=4", "num_query_groups=3"]),
    (dict(normalization="BatchNorm"), ["normalization"]),
    (dict(hidden_dropout=1.5), ["hidden_dropout=1.5"]),
    (dict(params_dtype="float8_e4m3fn"), ["dtype='float8_e4m3fn'"]),      # float16 is a model dtype since chapter 06
])
def test_bad_configs_name_the_field(overrides, words):
    with pytest.raises(ConfigError) as err:
        GPTModel(_with(STYLES["llama"], **overrides))
    for w in words:
        assert w in str(err.value)


def test_sequence_longer_than_positions_is_refused():
    model = GPTModel(STYLES["gpt2"])
    with pytest.raises(ValueError, match="max_position_embeddings=16"):
        model(_tokens(1, 17))
