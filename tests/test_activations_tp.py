"""The activation memory of a tensor-parallel rank (analysis.activation_memory with tp and
sequence_parallel, chapter 07) against what the rank's forward saves, measured with the
saved-tensor hooks, to the byte: tp 2 with and without sequence parallelism, GPT-2 and LLaMA
styles, naive and fused attention, float32 and bf16, with dropout, and with selective and full
recompute. One 2-rank world measures every case."""

import dataclasses

import pytest

from minimegatron.analysis import activation_memory, korthikanti_activation_memory
from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.launch import spawn
from minimegatron.testing import saved_activation_bytes_per_rank

GPT2 = ModelConfig.gpt2(hidden_size=64, num_layers=2, num_attention_heads=4, vocab_size=96, max_position_embeddings=64,
                        hidden_dropout=0.1, attention_dropout=0.1, attention_backend="naive")
LLAMA = ModelConfig.llama(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2, vocab_size=95,
                          max_position_embeddings=64, hidden_dropout=0.1)
TP2 = TrainConfig(seq_length=32, micro_batch_size=2, tensor_model_parallel_size=2, progress=False)
SP = dataclasses.replace(TP2, sequence_parallel=True)
CASES = {
    "gpt2 naive, dropout, tp 2": (GPT2, TP2),
    "gpt2 naive, dropout, tp 2 + SP": (GPT2, SP),
    "llama sdpa, V 95 padded, tp 2": (LLAMA, TP2),
    "llama sdpa bf16, tp 2 + SP": (dataclasses.replace(LLAMA, params_dtype="bfloat16"), dataclasses.replace(SP, bf16=True)),
    "gpt2 selective core_attn mlp, tp 2 + SP": (dataclasses.replace(GPT2, attention_dropout=0.0),
                                                dataclasses.replace(SP, recompute_granularity="selective",
                                                                    recompute_modules=("core_attn", "mlp"))),
    "llama full uniform 1, tp 2 + SP": (LLAMA, dataclasses.replace(SP, recompute_granularity="full",
                                                                   recompute_method="uniform", recompute_num_layers=1)),
}
B, S = 2, 32


@pytest.fixture(scope="module")
def measured():
    return spawn(saved_activation_bytes_per_rank, 2, [(m, t, B, S) for m, t in CASES.values()], timeout=300)


def _formula(model, train):
    return activation_memory(model, B, S, tp=train.tensor_model_parallel_size, sequence_parallel=train.sequence_parallel,
                             recompute_granularity=train.recompute_granularity, recompute_method=train.recompute_method,
                             recompute_num_layers=train.recompute_num_layers,
                             recompute_modules=train.recompute_modules)


@pytest.mark.parametrize("index, name", list(enumerate(CASES)), ids=list(CASES))
def test_every_rank_saves_what_the_formula_counts(measured, index, name):
    want = _formula(*CASES[name])["total"]
    assert [rank[index] for rank in measured] == [want, want]


def test_sequence_parallelism_cuts_every_per_layer_term_but_the_mask_and_the_norm_weights():
    """Korthikanti's s b h (34 + 5 a s / h) / t with SP: the book's per-layer count under tp 2 + SP
    is its count on one process over 2, but for the s x s causal mask every rank keeps whole."""
    one = activation_memory(GPT2, B, S)["per_layer"]
    sp = activation_memory(GPT2, B, S, tp=2, sequence_parallel=True)["per_layer"]
    assert sp["total"] - sp["causal_mask"] == (one["total"] - one["causal_mask"]) // 2
    assert korthikanti_activation_memory(GPT2, B, S, tp=2, sequence_parallel=True)["per_layer"] * 2 == \
        korthikanti_activation_memory(GPT2, B, S)["per_layer"]
