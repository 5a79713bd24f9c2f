"""Chapter 04 on one process: the zig-zag layout, blockwise attention with its log-sum-exp
(forward and backward, both backends, grouped-query attention) against the written-out causal
attention and autograd, the chunk-pair rule of the ring, the layout checks, Korthikanti's
formulas, and the command line's chapter-04 flags."""

import itertools

import pytest
import torch

from minimegatron.arguments import parse_command_line
from minimegatron.analysis.activations import korthikanti_activation_memory
from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.cp import (attention_block_backward, attention_block_forward, block_pairs, causal_work_per_rank,
                             contiguous_positions, cp_chunk_ids, get_batch_on_this_cp_rank, merge_attention,
                             ring_attention, zigzag_positions)
from minimegatron.model.attention import causal_attention
from minimegatron.parallelize import validate_layout

LLAMA = ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                          max_position_embeddings=64, params_dtype="float64")


# ---- layout -----------------------------------------------------------------------------
def test_zigzag_positions_follow_the_contract():
    # written out by hand from the rule: 2 cp chunks, rank r keeps chunk r then chunk 2cp-1-r
    assert zigzag_positions(8, 2, 0) == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1) == [2, 3, 4, 5]
    assert zigzag_positions(12, 3, 1) == [2, 3, 8, 9]
    assert contiguous_positions(8, 2, 1) == [4, 5, 6, 7]
    for s, cp in [(16, 2), (24, 3), (32, 4), (64, 8)]:
        every = sorted(p for r in range(cp) for p in zigzag_positions(s, cp, r))
        assert every == list(range(s))                                   # a permutation of the sequence
    with pytest.raises(ValueError, match="seq_length=10 is not divisible by 2 x context_parallel_size = 2 x 3"):
        zigzag_positions(10, 3, 0)


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    s = 4096
    for cp in (2, 4, 8):
        zig, plain = causal_work_per_rank(s, cp, True), causal_work_per_rank(s, cp, False)
        assert sum(zig) == sum(plain) == s * (s + 1) // 2
        assert max(zig) - min(zig) <= s // cp                            # equal up to the diagonals
        # contiguous rank r: queries r c .. (r+1) c - 1, c = s / cp: c^2 r + c (c + 1) / 2 entries
        c = s // cp
        assert plain == [c * c * r + c * (c + 1) // 2 for r in range(cp)]


def test_get_batch_on_this_cp_rank_cuts_tokens_labels_and_positions():
    tokens = torch.arange(16).view(2, 8)
    batch = {"tokens": tokens, "labels": tokens + 100}
    out = get_batch_on_this_cp_rank(batch, 2, 1)
    assert out["position_ids"].tolist() == [2, 3, 4, 5]
    assert out["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert out["labels"].tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert get_batch_on_this_cp_rank(batch, 1, 0)["position_ids"].tolist() == list(range(8))


def test_block_pairs_are_the_unmasked_chunk_pairs():
    assert block_pairs([0, 3], [0, 3]) == [(0, 0, True), (1, 0, False), (1, 1, True)]    # the diagonal step
    assert block_pairs([1, 2], [0, 3]) == [(0, 0, False), (1, 0, False)]                  # lower rank: first half
    assert block_pairs([0, 3], [1, 2]) == [(1, 0, False), (1, 1, False)]                  # higher rank: second half


# ---- blockwise attention ----------------------------------------------------------------
def _qkv(b=2, a=4, g=2, s=16, d=8, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, s, d, generator=gen, dtype=dtype) for n in (a, g, g)]


def _reference(q, k, v):
    rep = q.shape[1] // k.shape[1]
    return causal_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
def test_block_forward_and_backward_equal_autograd(backend):
    q, k, v = _qkv()
    for causal in (True, False):
        qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
        rep = 2
        if causal:
            ref = _reference(qa, ka, va)
        else:
            scores = qa @ ka.repeat_interleave(rep, 1).transpose(-2, -1) / 8 ** 0.5
            ref = torch.softmax(scores, -1) @ va.repeat_interleave(rep, 1)
        dout = torch.randn_like(ref)
        grads = torch.autograd.grad(ref, (qa, ka, va), dout)
        out, lse = attention_block_forward(q, k, v, causal, backend)
        assert torch.allclose(out, ref, atol=1e-12)
        mine = attention_block_backward(dout, q, k, v, out, lse, causal, backend)
        for a, b in zip(mine, grads):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-12)


def test_merging_blocks_in_any_order_is_the_softmax_over_all():
    q, k, v = _qkv(g=4, s=12)
    k = k * 30                                                # large scores: a naive exp would overflow
    full, full_lse = attention_block_forward(q, k, v, False, "naive")
    blocks = [attention_block_forward(q, k[:, :, i:i + 4], v[:, :, i:i + 4], False, "naive") for i in (0, 4, 8)]
    for order in itertools.permutations(blocks):
        out, lse = order[0]
        for o, l in order[1:]:
            out, lse = merge_attention(out, lse, o, l)
        assert torch.allclose(out, full, atol=1e-12) and torch.allclose(lse, full_lse, atol=1e-12)


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("ids", [[0, 1, 2, 3], [0, 3, 1, 2], [3, 2, 1, 0]])
def test_chunked_attention_in_any_storage_order_equals_causal_attention(backend, ids):
    """ring_attention without a ring (group None): tokens stored chunk by chunk in any order."""
    q, k, v = (t.requires_grad_() for t in _qkv(s=16))
    ref = _reference(q, k, v)
    dout = torch.randn_like(ref)
    grads = torch.autograd.grad(ref, (q, k, v), dout)
    c = 4
    perm = torch.tensor([i * c + j for i in ids for j in range(c)])
    qp, kp, vp = (t.detach().index_select(2, perm).requires_grad_() for t in (q, k, v))
    out = ring_attention(qp, kp, vp, None, ids, [ids], backend)
    assert torch.allclose(out, ref.index_select(2, perm), atol=1e-12)
    mine = torch.autograd.grad(out, (qp, kp, vp), dout.index_select(2, perm))
    for a, b in zip(mine, grads):
        assert torch.allclose(a, b.index_select(2, perm), atol=1e-12)


def test_chunk_ids_of_both_layouts():
    assert cp_chunk_ids(4, 1) == [1, 6] and cp_chunk_ids(4, 1, load_balance=False) == [2, 3]
    with pytest.raises(ValueError, match="cp_rank=4"):
        cp_chunk_ids(4, 4)


# ---- layout checks, formulas, command line ------------------------------------------------
@pytest.mark.parametrize("overrides, world, message", [
    (dict(sequence_parallel=True), 1, "sequence_parallel with tensor_model_parallel_size=1"),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True, zero_stage=2), 2, "sequence_parallel with zero_stage=2"),
    (dict(context_parallel_size=3, seq_length=16), 3, "seq_length=16 is not divisible by 2 x context_parallel_size"),
    (dict(context_parallel_size=4, cp_comm_type="a2a"), 4, "num_query_groups per tensor-parallel rank = 2 is not "
                                                            "divisible by the all-to-all size 4"),
    (dict(context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=(2, 3)), 4,
     r"hierarchical_context_parallel_sizes=\[2, 3\]: expected .* product is context_parallel_size=4"),
    (dict(context_parallel_size=2, cp_comm_type="p2p", hierarchical_context_parallel_sizes=(2, 1)), 2,
     "only used with cp_comm_type 'a2a\\+p2p'"),
    (dict(context_parallel_size=2), 5, "world size 5 is not divisible by tensor_model_parallel_size=1 x "
                                       "context_parallel_size=2 x pipeline_model_parallel_size=1"),
])
def test_impossible_layouts_are_named(overrides, world, message):
    cfg = TrainConfig(**{"seq_length": 32, **overrides})
    with pytest.raises(ConfigError, match=message):
        validate_layout(LLAMA, cfg, world)


def test_sequence_parallel_needs_the_tokens_per_rank_divisible_by_tp():
    model = ModelConfig.llama(hidden_size=48, num_layers=2, num_attention_heads=6, num_query_groups=3,
                              ffn_hidden_size=96, max_position_embeddings=64)
    cfg = TrainConfig(seq_length=32, tensor_model_parallel_size=3, sequence_parallel=True)
    with pytest.raises(ConfigError, match="seq_length=32 / context_parallel_size=1 = 32 tokens per rank is not "
                                          "divisible by tensor_model_parallel_size=3"):
        validate_layout(model, cfg, 3)


def test_attention_dropout_is_refused_under_context_parallelism():
    model = ModelConfig.llama(**{**LLAMA.__dict__, "attention_dropout": 0.1})
    with pytest.raises(ConfigError, match="attention_dropout=0.1 with context_parallel_size=2"):
        validate_layout(model, TrainConfig(seq_length=32, context_parallel_size=2), 2)


def test_korthikanti_formulas():
    # Korthikanti et al. 2022, eqs. for one layer: sbh(34 + 5as/h); TP sbh(10 + 24/t + 5as/(ht));
    # TP + SP sbh(34/t + 5as/(ht)); here s=64, b=2, h=32, a=4, t=2, so sbh = 4096, 5as/h = 40
    sbh = 64 * 2 * 32
    assert korthikanti_activation_memory(LLAMA, 2, 64)["per_layer"] == sbh * (34 + 40)
    assert korthikanti_activation_memory(LLAMA, 2, 64, tp=2)["per_layer"] == sbh * (10 + 12 + 20)
    assert korthikanti_activation_memory(LLAMA, 2, 64, tp=2, sequence_parallel=True)["per_layer"] == sbh * (17 + 20)


def test_command_line_takes_megatrons_chapter_04_flags():
    _, cfg, _ = parse_command_line(["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                    "--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                    "--hierarchical-context-parallel-sizes", "2", "2",
                                    "--micro-batch-size", "1", "--global-batch-size", "4"], world_size=16)
    assert (cfg.tensor_model_parallel_size, cfg.sequence_parallel, cfg.context_parallel_size) == (2, True, 4)
    assert cfg.cp_comm_type == "a2a+p2p" and cfg.hierarchical_context_parallel_sizes == (2, 2)
    assert cfg.grad_accum_steps == 2          # dp = 16 / (tp 2 x cp 4) = 2: 4 / (1 x 2) micro-batches
