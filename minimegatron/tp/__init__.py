"""Chapter 02: tensor parallelism, Megatron-LM style (megatron/core/tensor_parallel/).

Read in this order:

  layers.py         cutting a weight matrix by columns (ColumnParallelLinear) and by rows
                    (RowParallelLinear), the vocabulary-split embedding, and the helpers
                    that cut a shard from the single-device initial value
  cross_entropy.py  the loss over a split vocabulary with three all-reduces of [b, s]
                    numbers instead of gathering the [b, s, V] logits
  model.py          the whole GPT split over a tensor-parallel group: attention by heads,
                    the MLP by its inner dimension, the vocabulary by rows; and the helpers
                    that reassemble full parameters and gradients under single-device names
  random.py         two random streams: one shared by the tensor-parallel group (dropout on
                    replicated activations), one per rank (dropout inside split regions)

The communication operators they use (Megatron's f and g, split and gather) live in
minimegatron/comm/regions.py, with every call recorded in the ledger.
"""

from .cross_entropy import vocab_parallel_cross_entropy
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, divide,
                     pad_vocab_size, shard_cols, shard_rows, vocab_range)
from .model import (ParallelMLP, ParallelSelfAttention, ParallelTransformerLayer, TensorParallelGPTModel,
                    check_tensor_parallel_config, clip_tensor_parallel_grad_norm, full_gradients,
                    full_parameters)
from .random import RNGStatesTracker, get_rng_tracker, model_parallel_manual_seed

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "shard_rows", "shard_cols", "divide",
           "pad_vocab_size", "vocab_range", "RNGStatesTracker", "get_rng_tracker",
           "model_parallel_manual_seed", "TensorParallelGPTModel", "ParallelSelfAttention", "ParallelMLP",
           "ParallelTransformerLayer", "check_tensor_parallel_config", "full_parameters", "full_gradients",
           "clip_tensor_parallel_grad_norm"]
