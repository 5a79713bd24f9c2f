"""The output layer fused with the cross-entropy inside the model (chapter 07,
kernels/cross_entropy.linear_cross_entropy, GPTModel.output_and_loss under --kernels triton):
its vocabulary-parallel form under tp 2, with and without sequence parallelism, with a padded
vocabulary (one rank holding padding only, too), against one device's F.cross_entropy on the
full logits, and against the unfused ColumnParallelLinear + vocab-parallel loss message for
message. The model-level runs are in tests/test_kernels.py (one device, fused against unfused;
tp 2 + SP x dp 2 and tp 2 x pp 2 against one device with the kernels)."""

import pytest
import torch

from minimegatron.kernels import available      # tests/conftest.py imported minimegatron first (TRITON_INTERPRET)

if available() is not None:
    pytest.skip(available(), allow_module_level=True)

from minimegatron.launch import spawn            # noqa: E402
from tests.workers import fused_loss as W        # noqa: E402

B, S, H = 2, 6, 8
CASES = {"vocab 63 padded to 64": (63, 64, False), "vocab 63 padded to 64, SP": (63, 64, True),
         "vocab 10 padded to 32: rank 1 holds padding only": (10, 32, False)}


def _inputs(vocab: int):
    g = torch.Generator().manual_seed(vocab)
    x, w = torch.randn(B, S, H, generator=g, dtype=torch.float64), torch.randn(vocab, H, generator=g, dtype=torch.float64)
    return x, w, torch.randint(0, vocab, (B, S), generator=g)


@pytest.fixture(scope="module")
def ranks():
    # one spawned world of 2 ranks for every case (a rank costs seconds to start)
    return {name: spawn(W.output_and_loss_both_ways, 2, *_inputs(vocab), padded, sp, 5, timeout=300)
            for name, (vocab, padded, sp) in CASES.items()}


@pytest.mark.parametrize("name", CASES)
def test_the_fused_vocab_parallel_loss_equals_one_device(ranks, name):
    vocab, padded, sp = CASES[name]
    x, w, labels = _inputs(vocab)
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy((x @ w.t()).view(-1, vocab), labels.view(-1), reduction="none")
    want.sum().backward()
    dw_padded = torch.cat([w.grad, w.grad.new_zeros(padded - vocab, H)])         # padding rows: no gradient
    for rank, result in enumerate(ranks[name]):
        fused = result["fused"]
        torch.testing.assert_close(fused["losses"].view(-1), want.detach())
        torch.testing.assert_close(fused["dx"], x.grad.chunk(2, dim=1)[rank] if sp else x.grad)
        torch.testing.assert_close(fused["dw"], dw_padded.chunk(2)[rank])


@pytest.mark.parametrize("name", CASES)
def test_the_fused_loss_sends_what_the_unfused_output_layer_and_loss_send(ranks, name):
    for result in ranks[name]:
        fused, unfused = result["fused"]["calls"], result["unfused"]["calls"]
        assert len(fused) >= 4, fused                             # three all-reduces and the input gradient's
        assert [(op, tag, nbytes) for op, tag, _, nbytes in fused] == \
            [(op, tag, nbytes) for op, tag, _, nbytes in unfused], (fused, unfused)
        torch.testing.assert_close(result["fused"]["losses"], result["unfused"]["losses"])
