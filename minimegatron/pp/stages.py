"""Cutting the model into pipeline stages: which layers each rank (and each of its chunks) holds.

A pipeline of pp ranks with v model chunks per rank has pp * v "virtual stages", in the order a
micro-batch visits them: virtual stage k = chunk * pp + rank (chunk 0 of every rank, then chunk
1 of every rank, ...). The L transformer layers are cut into pp * v contiguous ranges, one per
virtual stage, in that order. The first virtual stage also holds the embedding (pre_process),
the last one the final norm, the output layer and the loss (post_process):

    L = 8, pp = 4, v = 1:   rank 0 [0, 1]  rank 1 [2, 3]  rank 2 [4, 5]  rank 3 [6, 7]
    L = 8, pp = 2, v = 2:   rank 0 chunk 0 [0, 1], chunk 1 [4, 5]; rank 1 chunk 0 [2, 3], chunk 1 [6, 7]

Even split: L divisible by pp * v, each virtual stage L / (pp v) layers (Megatron's
get_transformer_layer_offset). Uneven: `layers_per_stage`, one count per virtual stage in
visiting order, summing to L (the first and last stages often get fewer layers, because they
also hold the embedding and the output layer and loss; Megatron's options for this are
decoder_first_pipeline_num_layers / decoder_last_pipeline_num_layers). A stage may hold no
layer at all (only the embedding, or only the head), as in Megatron.

Each chunk is a `model.GPTModel(config, pre_process, post_process, layer_numbers)`: the
layers keep their global names and initial values (`decoder.layers.{i}`), so a stage is
exactly a piece of the single-device model.
"""

from __future__ import annotations

from torch import nn

from ..config import ConfigError, ModelConfig
from ..model import GPTModel

__all__ = ["stage_layers", "build_stage_chunks", "virtual_stage"]


def virtual_stage(pp_size: int, pp_rank: int, chunk: int) -> int:
    """The position of (pp_rank, chunk) in a micro-batch's path: chunk * pp + rank."""
    return chunk * pp_size + pp_rank


def stage_layers(num_layers: int, pp_size: int, pp_rank: int, num_chunks: int = 1, chunk: int = 0,
                 layers_per_stage: list[int] | None = None) -> list[int]:
    """The global layer numbers that chunk `chunk` of rank `pp_rank` runs, in order.

    Even split (layers_per_stage None): ConfigError unless num_layers is divisible by
    pp_size * num_chunks. Uneven: layers_per_stage[k] layers for virtual stage k (see the module
    docstring); ConfigError unless it has pp_size * num_chunks non-negative entries summing to
    num_layers. Every layer belongs to exactly one (rank, chunk); the ranges are contiguous and
    increase with the virtual stage.
    """
    stages = pp_size * num_chunks
    if not 0 <= pp_rank < pp_size or not 0 <= chunk < num_chunks:
        raise ValueError(f"pp_rank={pp_rank}, chunk={chunk} outside pp_size={pp_size}, num_chunks={num_chunks}")
    # BEGIN EXERCISE 3.2: the stage partition | hint: k = chunk * pp + rank; even: n = L // (pp v), layers [k n, (k+1) n); uneven: start = sum of the counts before k
    if layers_per_stage is None:
        if num_layers % stages:
            raise ConfigError(f"num_layers={num_layers} is not divisible by pipeline_model_parallel_size="
                              f"{pp_size} x num_chunks={num_chunks} = {stages} virtual stages")
        layers_per_stage = [num_layers // stages] * stages
    if len(layers_per_stage) != stages or min(layers_per_stage) < 0 or sum(layers_per_stage) != num_layers:
        raise ConfigError(f"layers_per_stage={list(layers_per_stage)} must have pp_size x num_chunks = {stages} "
                          f"non-negative entries summing to num_layers={num_layers}")
    k = virtual_stage(pp_size, pp_rank, chunk)
    start = sum(layers_per_stage[:k])
    return list(range(start, start + layers_per_stage[k]))
    # END EXERCISE


def build_stage_chunks(config: ModelConfig, pp_size: int, pp_rank: int, num_chunks: int = 1,
                       layers_per_stage: list[int] | None = None, tp_group=None) -> list[nn.Module]:
    """The num_chunks GPTModel pieces rank `pp_rank` holds, chunk 0 first. Chunk c holds
    stage_layers(..., chunk=c); the embedding if it is virtual stage 0, the head (final norm,
    output layer, loss) if it is the last virtual stage. With tied embeddings the last stage
    gets its own output_layer initialised to the embedding's initial value (GPTModel does that
    when post_process and not pre_process); the two copies are kept equal by all-reducing their
    gradients over the embedding group (executor.finish_pipeline_grads). With `tp_group` (3D
    parallelism) each chunk is a tp.TensorParallelGPTModel stage split over that group."""
    last = pp_size * num_chunks - 1
    chunks = []
    for c in range(num_chunks):
        k = virtual_stage(pp_size, pp_rank, c)
        layers = stage_layers(config.num_layers, pp_size, pp_rank, num_chunks, c, layers_per_stage)
        if tp_group is None:
            chunks.append(GPTModel(config, pre_process=k == 0, post_process=k == last, layer_numbers=layers))
        else:
            from ..tp import TensorParallelGPTModel
            chunks.append(TensorParallelGPTModel(config, tp_group, pre_process=k == 0, post_process=k == last,
                                                 layer_numbers=layers))
    return chunks
