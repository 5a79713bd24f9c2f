"""The Triton kernels of chapter 07 (minimegatron/kernels/): FlashAttention-2, RMSNorm, LayerNorm and
SwiGLU, forward and every gradient, against the book's PyTorch functions (float32, in Triton's
interpreter on this CPU, small shapes); the PyTorch references the kernels mirror (the online
softmax step, RMSNorm's and LayerNorm's backward); and the model with --kernels triton, on one
device and under tensor, sequence and pipeline parallelism, against one device with the same kernels."""

import dataclasses

import pytest
import torch

from minimegatron.kernels import available      # tests/conftest.py imported minimegatron first (TRITON_INTERPRET)

if available() is not None:
    pytest.skip(available(), allow_module_level=True)

from minimegatron.config import ConfigError, ModelConfig, TrainConfig          # noqa: E402
from minimegatron.kernels.flash_attention import attention_tiles, flash_attention, online_softmax_step   # noqa: E402
from minimegatron.kernels.layernorm import layer_norm, layernorm_backward    # noqa: E402
from minimegatron.kernels.rmsnorm import rms_norm, rmsnorm_backward          # noqa: E402
from minimegatron.kernels.swiglu import swiglu                               # noqa: E402
from minimegatron.launch import spawn                                        # noqa: E402
from minimegatron.model.attention import causal_attention, document_attention, sdpa_attention    # noqa: E402
from minimegatron.model.linear import LayerNorm, RMSNorm                     # noqa: E402
from minimegatron.model.mlp import mlp_activation                            # noqa: E402
from minimegatron.parallelize import validate_layout                         # noqa: E402
from minimegatron.testing import RunRecord, compare_runs, make_batches, single_device_run, Tolerance   # noqa: E402
from tests.workers import precision as W                                     # noqa: E402


def _grads(fn, inputs, dout):
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*inputs)
    out.backward(dout)
    return out.detach(), [x.grad for x in inputs]


@pytest.mark.parametrize("b, a, g, s, d", [(2, 4, 2, 24, 8), (1, 2, 2, 16, 16), (1, 4, 1, 33, 8)],
                         ids=["gqa, s not a multiple of the block", "mha", "one kv head, s 33"])
def test_flash_attention_equals_the_naive_attention_and_sdpa(b, a, g, s, d):
    torch.manual_seed(0)
    q, k, v = torch.randn(b, a, s, d), torch.randn(b, g, s, d), torch.randn(b, g, s, d)
    dout = torch.randn(b, a, s, d)
    got, got_grads = _grads(flash_attention, (q, k, v), dout)
    naive = lambda q, k, v: causal_attention(q, k.repeat_interleave(a // g, 1), v.repeat_interleave(a // g, 1))  # noqa: E731
    for reference in (naive, sdpa_attention):
        want, want_grads = _grads(reference, (q, k, v), dout)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for name, x, y in zip(("dq", "dk", "dv"), got_grads, want_grads):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=name)


def test_flash_attention_with_documents_equals_the_block_diagonal_mask_and_skips_tiles():
    """Packed documents (THD's cu_seqlens as ids): documents that start inside a block, end at a
    block's edge, one that spans three blocks, one token long; against SDPA with the mask."""
    torch.manual_seed(0)
    b, a, g, s, d = 2, 4, 2, 48, 8
    ids = torch.tensor([[0] * 5 + [1] * 27 + [2] * 1 + [3] * 15, [0] * 16 + [1] * 32])
    q, k, v = torch.randn(b, a, s, d), torch.randn(b, g, s, d), torch.randn(b, g, s, d)
    dout = torch.randn(b, a, s, d)
    got, got_grads = _grads(lambda q, k, v: flash_attention(q, k, v, document_ids=ids), (q, k, v), dout)
    want, want_grads = _grads(lambda q, k, v: document_attention(q, k, v, ids), (q, k, v), dout)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, x, y in zip(("dq", "dk", "dv"), got_grads, want_grads):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=name)
    # causal alone: query block i reads key blocks 0..i, 1 + 2 + 3 a row. With the documents,
    # row 0's third query block starts at key 32 (its first row's document, 2, starts there):
    # 1 + 2 + 1; row 1's second and third start at key 16 (document 1): 1 + 1 + 2
    assert attention_tiles(None, b, s) == 12
    assert attention_tiles(ids, b, s) == 8
    with pytest.raises(ValueError, match="must not decrease"):
        flash_attention(q, k, v, document_ids=ids.flip(-1))


def test_the_online_softmax_step_merges_blocks_into_the_full_softmax():
    torch.manual_seed(0)
    scores, v = torch.randn(5, 12), torch.randn(12, 3)
    scores[0, :7] = float("-inf")                                  # a row whose first blocks are all masked
    m, l, acc = torch.full((5,), float("-inf")), torch.zeros(5), torch.zeros(5, 3)
    for block in range(0, 12, 4):
        m, l, acc = online_softmax_step(m, l, acc, scores[:, block:block + 4], v[block:block + 4])
    torch.testing.assert_close(acc / l[:, None], torch.softmax(scores, -1) @ v)
    torch.testing.assert_close(m + l.log(), scores.logsumexp(-1))


def test_rmsnorm_forward_and_backward_equal_the_books_rmsnorm():
    torch.manual_seed(0)
    x, w, dy = torch.randn(3, 10, 48), torch.randn(48), torch.randn(3, 10, 48)    # h 48: not a power of 2
    got, (dx, dw) = _grads(lambda x, w: rms_norm(x, w, 1e-5, block_rows=4), (x, w), dy)
    book = lambda x, w: torch.func.functional_call(RMSNorm(48, 1e-5), {"weight": w}, (x,))    # noqa: E731
    want, (want_dx, want_dw) = _grads(book, (x, w), dy)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(dx, want_dx)
    torch.testing.assert_close(dw, want_dw)
    rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-5).reshape(-1)               # the PyTorch backward the kernel mirrors
    ref_dx, ref_dw = rmsnorm_backward(dy.reshape(-1, 48), x.reshape(-1, 48), w, rstd)
    torch.testing.assert_close(ref_dx.view_as(x), want_dx)
    torch.testing.assert_close(ref_dw, want_dw)


@pytest.mark.parametrize("shape", [(10, 48), (3, 10, 48)], ids=["rows 10, h 48", "3-D"])   # h 48: not a power of 2
def test_layernorm_forward_and_backward_equal_the_books_layernorm(shape):
    torch.manual_seed(0)
    x, w, b, dy = torch.randn(shape) + 1.0, torch.randn(48), torch.randn(48), torch.randn(shape)   # rows' mean not 0
    got, (dx, dw, db) = _grads(lambda x, w, b: layer_norm(x, w, b, 1e-5, block_rows=4), (x, w, b), dy)
    book = lambda x, w, b: torch.func.functional_call(LayerNorm(48, 1e-5), {"weight": w, "bias": b}, (x,))  # noqa: E731
    want, (want_dx, want_dw, want_db) = _grads(book, (x, w, b), dy)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(dx, want_dx)
    torch.testing.assert_close(dw, want_dw)
    torch.testing.assert_close(db, want_db)
    x2, dy2 = x.reshape(-1, 48), dy.reshape(-1, 48)                        # the PyTorch backward the kernel mirrors
    mean, rstd = x2.mean(-1), torch.rsqrt(x2.var(-1, unbiased=False) + 1e-5)
    ref_dx, ref_dw, ref_db = layernorm_backward(dy2, x2, w, mean, rstd)
    torch.testing.assert_close(ref_dx.view_as(x), want_dx)
    torch.testing.assert_close(ref_dw, want_dw)
    torch.testing.assert_close(ref_db, want_db)


def test_swiglu_forward_and_backward_equal_the_books_swiglu():
    torch.manual_seed(0)
    y, dout = torch.randn(3, 10, 80), torch.randn(3, 10, 40)
    got, (dy,) = _grads(lambda y: swiglu(y, block_rows=4), (y,), dout)
    want, (want_dy,) = _grads(lambda y: mlp_activation(y, True), (y,), dout)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(dy, want_dy)


def _model(preset="llama", **kw):
    sizes = dict(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                 vocab_size=64, max_position_embeddings=32, params_dtype="float32")
    return getattr(ModelConfig, preset)(**{**sizes, **kw})


# AdamW eps 1e-3: a float32 rounding of a near-zero gradient would otherwise flip a whole lr-sized
# step (tests/test_precision.py says the same for 16-bit models)
BASE = TrainConfig(seq_length=16, micro_batch_size=2, grad_accum_steps=2, train_iters=2, lr=1e-2, lr_warmup_iters=0,
                   eval_interval=0, progress=False, adam_eps=1e-3)
FLOAT32 = Tolerance(loss=1e-5, rtol=1e-3, atol=1e-5)     # Triton's float32 against PyTorch's, summation order


@pytest.mark.parametrize("preset", ["llama", "gpt2"], ids=["llama: RMSNorm, SwiGLU", "gpt2: LayerNorm, GELU"])
def test_the_model_with_triton_kernels_trains_as_with_torchs(preset):
    model = _model(preset)
    batches = make_batches(model, 2, 4, 16)
    torch_run = single_device_run(model, batches, BASE, grad_accum_steps=2)
    triton_run = single_device_run(model, batches, dataclasses.replace(BASE, kernels="triton"), grad_accum_steps=2)
    report = compare_runs(torch_run, triton_run, torch.float32, FLOAT32)
    assert report.ok, str(report)


def test_packed_documents_train_through_the_triton_kernels_as_through_torchs():
    from tests.test_packing import PACKED, _packed_batches
    model = _model()
    batches = _packed_batches(model, 2, 4, 16)                            # documents of 7 tokens
    cfg = dataclasses.replace(BASE, **PACKED)
    torch_run = single_device_run(model, batches, cfg, grad_accum_steps=2)
    triton_run = single_device_run(model, batches, dataclasses.replace(cfg, kernels="triton"), grad_accum_steps=2)
    report = compare_runs(torch_run, triton_run, torch.float32, FLOAT32)
    assert report.ok, str(report)


@pytest.mark.parametrize("fields, model_kw, message", [
    (dict(kernels="triton"), dict(attention_dropout=0.1), "attention_dropout=0.1: the Triton FlashAttention"),
    (dict(kernels="triton", context_parallel_size=2), {}, "context_parallel_size=2"),
    (dict(kernels="triton"), dict(hidden_size=48, num_attention_heads=4), "head size 12"),
])
def test_what_the_kernels_cannot_run_is_named(fields, model_kw, message):
    with pytest.raises(ConfigError, match=message):
        validate_layout(_model(**model_kw), dataclasses.replace(BASE, **fields), 2)


def _layout(name, tp=1, pp=1, dp=1, sp=False, **train):
    model = _model()
    cfg = dataclasses.replace(BASE, kernels="triton", tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              sequence_parallel=sp, **train)
    return name, model, cfg, dp, make_batches(model, 2, 2 * 2 * dp, 16)


LAYOUTS = [_layout("tp2 + SP x dp2", tp=2, sp=True, dp=2),
           _layout("tp2 x pp2, full recompute", tp=2, pp=2, recompute_granularity="full", recompute_method="uniform",
                   recompute_num_layers=1)]


@pytest.fixture(scope="module")
def trained():
    return spawn(W.train_layouts, 4, LAYOUTS, timeout=600)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[name for name, *_ in LAYOUTS])
def test_each_layout_with_triton_kernels_equals_one_device_with_them(trained, index):
    name, model, cfg, dp, batches = LAYOUTS[index]
    one = dataclasses.replace(cfg, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              sequence_parallel=False, recompute_granularity=None, recompute_method=None,
                              recompute_num_layers=None)
    reference = single_device_run(model, batches, one, grad_accum_steps=cfg.grad_accum_steps * dp)
    run = trained[0][index]
    report = compare_runs(reference, RunRecord(run["losses"], run["grads"], run["params"]), torch.float32)
    assert report.ok, f"{name}\n{report}"


def test_a_bf16_model_runs_the_kernels_in_float32():
    """16-bit tensors are upcast for the kernels (Triton's dot takes one dtype; its interpreter
    gets 16-bit arithmetic wrong) and the results cast back: a bf16 model with the kernels trains
    as the bf16 model without them, within the bf16 row of testing.TOLERANCES."""
    q, k, v = (torch.randn(1, 4, 24, 8).bfloat16() for _ in range(3))
    got = flash_attention(q, k[:, :2], v[:, :2])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, sdpa_attention(q, k[:, :2], v[:, :2]), rtol=2e-2, atol=2e-2)
    model = _model(params_dtype="bfloat16")
    batches = make_batches(model, 2, 4, 16)
    bf16 = dataclasses.replace(BASE, bf16=True)
    plain = single_device_run(model, batches, bf16, grad_accum_steps=2)
    fused = single_device_run(model, batches, dataclasses.replace(bf16, kernels="triton"), grad_accum_steps=2)
    report = compare_runs(plain, fused, torch.bfloat16)
    assert report.ok, str(report)


def test_the_fused_linear_cross_entropy_equals_the_unfused_one():
    from minimegatron.kernels.cross_entropy import cross_entropy_grad, linear_cross_entropy
    torch.manual_seed(0)
    x, w, labels = torch.randn(37, 16), torch.randn(100, 16), torch.randint(0, 100, (37,))
    g = torch.rand(37) * (torch.rand(37) > 0.3)                 # per-token gradients, some masked to 0
    got, (dx, dw) = _grads(lambda x, w: linear_cross_entropy(x, w, labels, chunk=8), (x, w), g)
    want, (want_dx, want_dw) = _grads(lambda x, w: torch.nn.functional.cross_entropy(x @ w.t(), labels,
                                                                                      reduction="none"), (x, w), g)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(dx, want_dx)
    torch.testing.assert_close(dw, want_dw)
    logits = x @ w.t()                                          # the PyTorch gradient the backward uses
    dlogits = cross_entropy_grad(logits.clone(), labels, logits.logsumexp(-1), g)
    torch.testing.assert_close(dlogits, torch.func.grad(lambda z: (torch.nn.functional.cross_entropy(
        z, labels, reduction="none") * g).sum())(logits))


def test_the_fused_cross_entropy_never_keeps_the_logits():
    """At Llama-3's vocabulary (128,256) the unfused loss keeps a [T, V] float32 tensor for the
    backward; the fused one keeps one log-sum-exp a token besides its inputs."""
    from minimegatron.kernels.cross_entropy import linear_cross_entropy
    from minimegatron.model.gpt import language_model_loss
    T, h, V = 8, 16, 128256
    x, w = torch.randn(T, h, requires_grad=True), torch.randn(V, h, requires_grad=True)
    labels = torch.randint(0, V, (T,))

    def kept(fn) -> int:
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in (x.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()):
                storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(storages.values())
    unfused = kept(lambda: language_model_loss((x @ w.t()).view(1, T, V), labels.view(1, T)))
    fused = kept(lambda: linear_cross_entropy(x, w, labels, chunk=4))
    assert unfused >= T * V * 4, unfused                         # the log-probabilities, [T, V] float32
    assert fused == T * 4 + T * 8, fused                          # lse (float32) and the labels (int64)
