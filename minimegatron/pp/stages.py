"""Cutting the model into pipeline stages: which layers each rank (and each of its chunks) holds.

pp ranks with v chunks each make pp v virtual stages, in the order a micro-batch visits them:
k = chunk * pp + rank. The L layers are cut into pp v contiguous ranges in that order; the
first virtual stage also holds the embedding (pre_process), the last the final norm, output
layer and loss (post_process):

    L = 8, pp = 4, v = 1:   rank 0 [0, 1]  rank 1 [2, 3]  rank 2 [4, 5]  rank 3 [6, 7]
    L = 8, pp = 2, v = 2:   rank 0 chunk 0 [0, 1], chunk 1 [4, 5]; rank 1 chunk 0 [2, 3], chunk 1 [6, 7]

Even split: L / (pp v) layers each (Megatron's get_transformer_layer_offset); uneven:
`layers_per_stage`, one count per virtual stage (zero allowed). Each chunk is a
`GPTModel(config, pre_process, post_process, layer_numbers)` with global layer names."""

from __future__ import annotations

import torch
from torch import nn

from .. import comm
from ..config import ConfigError, ModelConfig
from ..dp import grad_of, unwrap
from ..model import GPTModel, register_grad_finalizer

__all__ = ["stage_layers", "virtual_stage", "build_stage", "allreduce_tied_embedding_grads"]


def virtual_stage(pp_size: int, pp_rank: int, chunk: int) -> int:
    """The position of (pp_rank, chunk) in a micro-batch's path: chunk * pp + rank."""
    return chunk * pp_size + pp_rank


def stage_layers(num_layers: int, pp_size: int, pp_rank: int, num_chunks: int = 1, chunk: int = 0,
                 layers_per_stage: list[int] | None = None) -> list[int]:
    """The global layer numbers that chunk `chunk` of rank `pp_rank` runs, in order.

    Virtual stage k = chunk * pp_size + pp_rank (`virtual_stage`): the k-th stage a micro-batch
    visits. The L = num_layers layers are cut into pp_size * num_chunks contiguous ranges, one
    per virtual stage, in order of k:

      Even split (layers_per_stage None): each virtual stage gets n = L / (pp_size num_chunks)
      layers, stage k the layers [k n, (k + 1) n). ConfigError unless L is divisible by
      pp_size * num_chunks; the message starts "num_layers={L} is not divisible by" and names
      pp_size, num_chunks and their product.
      Uneven: layers_per_stage[k] layers for virtual stage k, starting after the layers of the
      stages before it. ConfigError unless it has pp_size * num_chunks non-negative entries
      summing to L; the message names "layers_per_stage={the list}" and the numbers.

    Examples: stage_layers(8, 2, 1, 2, 1) == [6, 7] (k = 1 * 2 + 1 = 3, n = 2);
    stage_layers(5, 3, 1, layers_per_stage=[1, 3, 1]) == [1, 2, 3].
    Every layer belongs to exactly one (rank, chunk); the ranges increase with k.
    """
    stages = pp_size * num_chunks
    if not 0 <= pp_rank < pp_size or not 0 <= chunk < num_chunks:
        raise ValueError(f"pp_rank={pp_rank}, chunk={chunk} outside pp_size={pp_size}, num_chunks={num_chunks}")
    # BEGIN EXERCISE 3.2: the stage partition | hint: number the virtual stages in the order a micro-batch visits them; where does stage k's first layer sit, given the layers of the stages before it? Refuse a bad split first (Megatron: get_transformer_layer_offset)
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


def build_stage(config: ModelConfig, layout, chunk: int = 0, num_chunks: int = 1,
                layers_per_stage: list[int] | None = None, device: torch.device | str = "cpu") -> GPTModel:
    """Chunk `chunk` (of num_chunks) of this rank's stage (layout.pp, layout.pp_rank): the GPTModel
    of stage_layers, embedding on virtual stage 0, head on the last; with several stages it
    registers the "tied-embedding" gradient hook over layout.embedding_group (model/finalize.py)."""
    stage, last = virtual_stage(layout.pp, layout.pp_rank, chunk), layout.pp * num_chunks - 1
    layers = stage_layers(config.num_layers, layout.pp, layout.pp_rank, num_chunks, chunk, layers_per_stage)
    model = GPTModel(config, pre_process=stage == 0, post_process=stage == last, layer_numbers=layers).to(device)
    if layout.pp > 1:
        register_grad_finalizer(model, "tied-embedding",     # (looked up when called: a grader may swap it)
                                lambda chunks: allreduce_tied_embedding_grads(chunks, layout.embedding_group))
    return model


def allreduce_tied_embedding_grads(chunks: list[nn.Module], embedding_group) -> None:
    """Make the two copies of a tied embedding get the single-device gradient.

    With tied embeddings the single-device model has ONE matrix E [V, h] used twice: by the
    embedding lookup (first virtual stage) and by the output layer (logits = x E^T, last
    virtual stage). Under pipeline parallelism each of the two stages holds a copy, and after
    the backward each copy holds only the gradient of ITS use: the first stage's
    chunk.embedding.word_embeddings.weight.grad = dE_lookup, the last stage's
    chunk.output_layer.weight.grad = dE_logits. The single-device gradient is their sum.

    chunks: this rank's model chunks: GPTModel stages, bare or in their data-parallel wrapper
    (dp.unwrap(chunk) is the GPTModel; dp.grad_of(chunk, p) is where p's gradient is: p.grad
    of a bare model, a bucket's view under DDP and ZeRO-1, the parameter's own shard under
    ZeRO-2, which gives each copy a bucket of its own sharded alike on both stages). A
    GPTModel's pre_process says it is the first virtual stage, its post_process the last.

    The spec. On the chunk that is the first virtual stage (and not the last) and on the chunk
    that is the last virtual stage (and not the first), exactly one comm.all_reduce (sum) of
    that copy's gradient (grad_of) over `embedding_group` (the two ranks), tag "embedding-grads";
    both copies then hold dE_lookup + dE_logits (in their tensor-parallel shards, under 3D).
    Nothing for untied embeddings, when one chunk is both first and last, or on the other chunks.

    Spot the bug (exercise 3.4): a first version of this body, and what it did when checked
    against the single-device run, are in chapters/03_pp/exercises/spot_the_bug.md.
    """
    # BEGIN EXERCISE 3.4: spot the bug in the tied-embedding gradient sync | hint: each copy holds the gradient of one use; the single-device gradient is the sum of the two. Which chunks hold a copy, and which hold both uses?
    for chunk in chunks:
        model = unwrap(chunk)
        if model.config.untie_embeddings_and_output_weights or model.pre_process == model.post_process:
            continue                        # untied, a middle chunk, or one chunk with both uses
        copy = model.embedding.word_embeddings.weight if model.pre_process else model.output_layer.weight
        comm.all_reduce(grad_of(chunk, copy), embedding_group, op="sum", tag="embedding-grads")
    # END EXERCISE
