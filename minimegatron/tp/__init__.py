"""Chapter 02: tensor parallelism, Megatron-LM style (megatron/core/tensor_parallel/).

Read in this order:

  layers.py         cutting a weight matrix by columns (ColumnParallelLinear) and by rows
                    (RowParallelLinear), the vocabulary-split embedding, the shard helpers
                    and the placement record of a split parameter
  cross_entropy.py  the loss over a split vocabulary with three all-reduces of [b, s]
                    numbers instead of gathering the [b, s, V] logits
  random.py         two random streams: one shared by the tensor-parallel group (dropout on
                    replicated activations), one per rank (dropout inside split regions)
  parallel.py       apply_tensor_parallel: the one model, its layers swapped by a plan (with
                    sequence_parallel, chapter 04: the regions between them cut along s)

The communication operators they use (copy and reduce, the 2019 paper's f and g; split and gather) live in
minimegatron/comm/regions.py, with every call recorded in the ledger.
"""

from .cross_entropy import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, pad_vocab_size,
                     set_tensor_model_parallel_attributes, shard_cols, shard_rows, vocab_range)
from .parallel import (TENSOR_PARALLEL_PLAN, allreduce_sequence_parallel_grads, apply_tensor_parallel,
                       check_tensor_parallel_config)
from .random import get_rng_tracker, model_parallel_manual_seed

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelCrossEntropy",
           "vocab_parallel_cross_entropy", "shard_rows", "shard_cols", "pad_vocab_size", "vocab_range",
           "set_tensor_model_parallel_attributes", "get_rng_tracker", "model_parallel_manual_seed",
           "TENSOR_PARALLEL_PLAN", "allreduce_sequence_parallel_grads", "apply_tensor_parallel",
           "check_tensor_parallel_config"]
