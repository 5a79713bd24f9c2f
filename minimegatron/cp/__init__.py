"""Chapter 04: context parallelism, Megatron-LM style (every sequence cut over the "cp" group).

Read in this order:

  layout.py     which tokens a rank holds: the contiguous cut and the zig-zag cut
                (zigzag_positions), the batch of a cp rank, the causal work per rank
  blocks.py     attention one block at a time with its log-sum-exp, merged exactly
                (merge_attention); the backward from the final out and lse; naive and sdpa
  ring.py       ring attention (cp_comm_type "p2p"): K/V around the ring, forward and backward
  attention.py  the four cp_comm_types (p2p, all_gather, a2a, a2a+p2p) and
                apply_context_parallel

Sequence parallelism, the other half of chapter 04, is part of tensor parallelism
(tp.apply_tensor_parallel(..., sequence_parallel=True)), as in Megatron-LM.
"""

from .attention import CP_COMM_TYPES, ContextParallelAttention, apply_context_parallel, check_context_parallel_config
from .blocks import attention_block_backward, attention_block_forward, merge_attention
from .layout import (causal_work_per_rank, check_context_parallel_seq_length, contiguous_positions, cp_chunk_ids,
                     get_batch_on_this_cp_rank, positions_on_rank, zigzag_positions)
from .ring import block_pairs, ring_attention

__all__ = ["CP_COMM_TYPES", "ContextParallelAttention", "apply_context_parallel", "check_context_parallel_config",
           "attention_block_forward", "attention_block_backward", "merge_attention",
           "zigzag_positions", "contiguous_positions", "positions_on_rank", "cp_chunk_ids", "get_batch_on_this_cp_rank",
           "causal_work_per_rank", "check_context_parallel_seq_length", "ring_attention", "block_pairs"]
