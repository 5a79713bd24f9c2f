"""Graders of chapter 00: causal attention (0.1), the RoPE rotation (0.2), the memory of Adam
training (0.3).

Each grader reaches the graded function through `implementation(id)` (or runs the whole
reference model with it plugged in, `plug(id)`), so the same test grades the book's code,
the learner's, or the bare stub (see tests/graders/conftest.py). The oracles, strongest
first: the whole model trained with the learner's function equals the model trained with the
book's; the function equals the book's on random inputs in float64; and properties that any
correct answer has whatever the book did (causality, rotations preserve norms, RoPE scores
depend on relative position only, memory equals bytes counted on a real model).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from minimegatron.analysis.memory import training_memory
from minimegatron.config import ModelConfig, TrainConfig
from booktools.exercises import implementation, plug
from minimegatron.model import GPTModel
from minimegatron.testing import assert_equivalent, make_batches, single_device_run

F64 = torch.float64


def _randn(*shape, seed=0, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _qkv(b=2, n=3, s=7, d=8, seed=0, dtype=F64):
    return tuple(_randn(b, n, s, d, seed=seed + i, dtype=dtype) for i in range(3))


def _tiny(style: str) -> ModelConfig:
    """A float64 model small enough to train two steps in well under a second."""
    make = ModelConfig.llama if style == "llama" else ModelConfig.gpt2
    extra = {"num_query_groups": 2} if style == "llama" else {}
    return make(hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=16,
                params_dtype="float64", attention_backend="naive", **extra)


def _two_steps(cfg: ModelConfig):
    """Two AdamW steps of the single-device model: losses, first gradients, final weights."""
    batches = make_batches(cfg, steps=2, batch_size=2, seq_length=12)
    return single_device_run(cfg, batches, TrainConfig(train_iters=2, lr_warmup_iters=0, clip_grad=0.0))


@functools.cache
def _book_run(style: str):
    """`_two_steps` of the book's own model (called outside any `plug`), computed once."""
    return _two_steps(_tiny(style))


# --------------------------------------------------------------------------------------
# 0.1 causal self-attention
# --------------------------------------------------------------------------------------

@pytest.mark.exercise("0.1")
@pytest.mark.parametrize("shape", [(2, 3, 7, 8), (1, 1, 1, 4), (3, 2, 16, 5)])
def test_attention_equals_reference_float64(shape):
    attention, reference = implementation("0.1"), implementation("0.1", "reference")
    q, k, v = _qkv(*shape)
    torch.testing.assert_close(attention(q, k, v), reference(q, k, v), rtol=1e-12, atol=1e-12)


@pytest.mark.exercise("0.1")
def test_attention_equals_torch_sdpa():
    """An oracle that is not the book's code: PyTorch's own causal attention."""
    attention = implementation("0.1")
    q, k, v = _qkv(2, 4, 9, 6, seed=3)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(attention(q, k, v), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.exercise("0.1")
def test_attention_is_causal():
    """Changing the tokens after position i changes no output at or before i (but does
    change the later ones: the answer really attends)."""
    attention = implementation("0.1")
    q, k, v = _qkv(2, 2, 10, 8, seed=5)
    out = attention(q, k, v)
    torch.testing.assert_close(out[..., 0, :], v[..., 0, :], rtol=1e-12, atol=1e-12,
                               msg="position 0 can only attend to itself: its output is v[0]")
    for i in range(q.shape[-2] - 1):
        q2, k2, v2 = (t.clone() for t in (q, k, v))
        for t, seed in ((q2, 10), (k2, 11), (v2, 12)):
            t[..., i + 1:, :] = _randn(*t[..., i + 1:, :].shape, seed=seed + i)
        out2 = attention(q2, k2, v2)
        torch.testing.assert_close(out2[..., :i + 1, :], out[..., :i + 1, :], rtol=1e-12, atol=1e-12,
                                   msg=f"outputs at positions <= {i} changed when only later tokens changed")
        assert not torch.allclose(out2[..., i + 1:, :], out[..., i + 1:, :]), \
            f"outputs after position {i} ignore the tokens they should attend to"


@pytest.mark.exercise("0.1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_keeps_the_dtype(dtype):
    attention = implementation("0.1")
    q, k, v = _qkv(2, 2, 8, 8, seed=7, dtype=dtype)
    out = attention(q, k, v)
    assert out.dtype == dtype, f"returned {out.dtype}, the spec says the dtype of query ({dtype})"
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.exercise("0.1")
def test_attention_ignores_dropout_outside_training():
    attention = implementation("0.1")
    q, k, v = _qkv(seed=9)
    torch.testing.assert_close(attention(q, k, v, dropout_p=0.5, training=False),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               rtol=1e-12, atol=1e-12, msg="dropout must be off when training=False")


@pytest.mark.exercise("0.1")
@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_model_with_your_attention_trains_like_the_reference(style):
    """The whole model (two AdamW steps, float64) with your attention inside equals the book's."""
    with plug("0.1"):
        yours = _two_steps(_tiny(style))
    assert_equivalent(_book_run(style), yours, F64)


# --------------------------------------------------------------------------------------
# 0.2 the RoPE rotation
# --------------------------------------------------------------------------------------

def _angles(positions: torch.Tensor, d: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [.., s, d] built here, independently of the book's rope_cos_sin:
    pair i (channels i and i + d/2) turns by position * base^(-2i/d)."""
    theta = base ** (-2.0 * torch.arange(d // 2, dtype=F64) / d)           # [d/2]
    angle = positions.to(F64).unsqueeze(-1) * theta                         # [.., s, d/2]
    angle = torch.cat([angle, angle], dim=-1)                               # [.., s, d]
    return angle.cos(), angle.sin()


def _rope_by_complex_numbers(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """The expected answer, derived another way: the pair (x_i, x_{i+d/2}) is the complex number
    x_i + j x_{i+d/2}, and turning it by the angle a is multiplying it by e^{j a}."""
    d = x.shape[-1]
    theta = base ** (-2.0 * torch.arange(d // 2, dtype=F64) / d)
    angle = positions.to(F64).unsqueeze(-1) * theta                         # [.., s, d/2]
    if angle.dim() == 3:
        angle = angle.unsqueeze(1)                                          # [b, 1, s, d/2]
    z = torch.complex(x[..., :d // 2], x[..., d // 2:]) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.exercise("0.2")
@pytest.mark.parametrize("batched_table", [False, True], ids=["cos[s,d]", "cos[b,s,d]"])
def test_rope_equals_reference_float64(batched_table):
    rope, reference = implementation("0.2"), implementation("0.2", "reference")
    x = _randn(2, 3, 6, 8, seed=1)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 3, 9, 0, 11, 2]]) if batched_table else torch.arange(6)
    cos, sin = _angles(positions, 8)
    torch.testing.assert_close(rope(x, cos, sin), reference(x, cos, sin), rtol=1e-12, atol=1e-12)


@pytest.mark.exercise("0.2")
@pytest.mark.parametrize("batched_table", [False, True], ids=["cos[s,d]", "cos[b,s,d]"])
def test_rope_is_a_rotation_of_each_pair(batched_table):
    """Against complex multiplication; and every pair keeps its length."""
    rope = implementation("0.2")
    x = _randn(2, 4, 5, 12, seed=2)
    positions = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]]) if batched_table else torch.arange(5) * 7
    cos, sin = _angles(positions, 12)
    out = rope(x, cos, sin)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, _rope_by_complex_numbers(x, positions), rtol=1e-12, atol=1e-12)
    pair_norm = lambda t: t[..., :6] ** 2 + t[..., 6:] ** 2   # noqa: E731
    torch.testing.assert_close(pair_norm(out), pair_norm(x), rtol=1e-12, atol=1e-12,
                               msg="a rotation keeps the length of every pair (x_i, x_{i+d/2})")


@pytest.mark.exercise("0.2")
def test_rope_position_zero_is_the_identity():
    rope = implementation("0.2")
    x = _randn(1, 2, 1, 8, seed=4)
    cos, sin = _angles(torch.zeros(1, dtype=torch.long), 8)
    torch.testing.assert_close(rope(x, cos, sin), x, rtol=0, atol=0)


@pytest.mark.exercise("0.2")
def test_rope_scores_depend_only_on_relative_position():
    """q rotated to position m, k to position n: q.k depends on m - n only. Shifting both
    positions by the same amount leaves every score unchanged; the score itself does change
    with m - n (so the identity map does not pass)."""
    rope = implementation("0.2")
    d, s = 16, 6
    q, k = _randn(1, 1, s, d, seed=5), _randn(1, 1, s, d, seed=6)
    q[..., :, :], k[..., :, :] = q[..., :1, :], k[..., :1, :]      # the same vectors at every position

    def scores(offset):
        cos, sin = _angles(torch.arange(s) + offset, d)
        return rope(q, cos, sin) @ rope(k, cos, sin).transpose(-2, -1)   # [1, 1, s, s], [m, n]

    base = scores(0)
    for offset in (1, 5, 100):
        torch.testing.assert_close(scores(offset), base, rtol=1e-10, atol=1e-10,
                                   msg=f"shifting every position by {offset} changed the scores")
    diagonals = [torch.diagonal(base[0, 0], offset=o) for o in range(-s + 1, s)]
    for diag in diagonals:                     # constant along each diagonal m - n = const
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), rtol=1e-10, atol=1e-10)
    assert not torch.allclose(base[0, 0, 0, 0], base[0, 0, 1, 0]), "scores do not depend on m - n at all"


@pytest.mark.exercise("0.2")
def test_model_with_your_rope_trains_like_the_reference():
    """The LLaMA-style model (RoPE) trained two AdamW steps with your rotation equals the book's."""
    with plug("0.2"):
        yours = _two_steps(_tiny("llama"))
    assert_equivalent(_book_run("llama"), yours, F64)


# --------------------------------------------------------------------------------------
# 0.3 the memory of Adam training
# --------------------------------------------------------------------------------------

def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _measured_bytes_per_parameter(param_dtype: str, master_weights: bool, fp32_grads: bool) -> dict:
    """Train one AdamW step of a real model and count the bytes it holds, per parameter.

    Mixed precision is done here by hand, the way Megatron does it: gradients of the 16-bit
    model are copied into fp32 (`fp32_grads`, Megatron's main_grad), and AdamW steps fp32
    master copies of the weights, so its moments are allocated like the weights it steps.
    """
    cfg = ModelConfig.gpt2(hidden_size=32, num_layers=2, num_attention_heads=4,
                           max_position_embeddings=16, params_dtype=param_dtype)
    model = GPTModel(cfg)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    batch = make_batches(cfg, steps=1, batch_size=2, seq_length=8)[0]
    model(batch["tokens"], labels=batch["labels"]).float().mean().backward()
    grads = [p.grad.float() if fp32_grads else p.grad for p in params]

    if master_weights:
        stepped = [p.detach().float().clone().requires_grad_(True) for p in params]
        for w, g in zip(stepped, grads):
            w.grad = g.float()
    else:
        stepped = params
    optimizer = torch.optim.AdamW(stepped, lr=1e-3)
    optimizer.step()
    state = [optimizer.state[w] for w in stepped]
    counted = {"params": _nbytes(params), "grads": _nbytes(grads),
               "master_weights": _nbytes(stepped) if master_weights else 0,
               "exp_avg": _nbytes(s["exp_avg"] for s in state),
               "exp_avg_sq": _nbytes(s["exp_avg_sq"] for s in state)}
    return {k: v / n for k, v in counted.items()}


ADAM_CASES = [  # (param dtype, master weights, fp32 gradients)
    ("float32", False, False),
    ("float64", False, False),
    ("bfloat16", False, False),
    ("bfloat16", True, False),
    ("bfloat16", True, True),
]


@pytest.mark.exercise("0.3")
@pytest.mark.parametrize("param_dtype,master_weights,fp32_grads", ADAM_CASES)
def test_adam_bytes_equal_the_bytes_counted_on_a_real_model(param_dtype, master_weights, fp32_grads):
    bytes_per_parameter = implementation("0.3")
    got = bytes_per_parameter(getattr(torch, param_dtype), master_weights=master_weights,
                              grad_dtype=torch.float32 if fp32_grads else None)
    measured = _measured_bytes_per_parameter(param_dtype, master_weights, fp32_grads)
    for key, value in measured.items():
        assert got.get(key) == value, (f"{key}: your formula says {got.get(key)} bytes per parameter, "
                                       f"a real {param_dtype} model trained with AdamW holds {value}")
    optimizer = measured["master_weights"] + measured["exp_avg"] + measured["exp_avg_sq"]
    assert got.get("optimizer") == optimizer, f"optimizer: {got.get('optimizer')} != {optimizer} (master + m + v)"
    total = measured["params"] + measured["grads"] + optimizer
    assert got.get("total") == total, f"total: {got.get('total')} != {total} (params + grads + optimizer)"


@pytest.mark.exercise("0.3")
def test_adam_bytes_accept_dtype_names():
    bytes_per_parameter = implementation("0.3")
    assert bytes_per_parameter("bfloat16", master_weights=True) == \
        bytes_per_parameter(torch.bfloat16, master_weights=True)
    assert bytes_per_parameter("float32")["total"] == 16, "fp32 AdamW: 4 + 4 + 4 + 4 bytes"


@pytest.mark.exercise("0.3")
def test_training_memory_with_your_formula_equals_a_real_model():
    """The book's training_memory, with your per-parameter formula inside, predicts the exact
    bytes of parameters, gradients and AdamW state of a real fp32 model after one step."""
    cfg = ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                            max_position_embeddings=16)
    with plug("0.3"):
        predicted = training_memory(cfg)
    model = GPTModel(cfg)
    batch = make_batches(cfg, steps=1, batch_size=2, seq_length=8)[0]
    model(batch["tokens"], labels=batch["labels"]).mean().backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    params = list(model.parameters())
    state = [optimizer.state[p] for p in params]
    measured = _nbytes(params) + _nbytes(p.grad for p in params) \
        + _nbytes(s["exp_avg"] for s in state) + _nbytes(s["exp_avg_sq"] for s in state)
    assert predicted["total"] == measured, f"predicted {predicted['total']} bytes, the model holds {measured}"
