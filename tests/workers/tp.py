"""Rank functions for the graders of chapter 02 (tensor parallelism), tests/graders/test_ch02_tp.py.

`launch.spawn` runs functions that a new process imports by name (spawned ranks inherit
sys.path, so `from workers import tp` works in them too). Each function runs on every rank of
a world whose WHOLE world is one tensor-parallel group (tp = world size), except the training
runs, which build their own tp x dp grid (`train_run` of chapters/02_tp/demo.py). They return
plain data (tensors, ledger calls); the graders compare it in the parent with an independent
oracle: the same computation done on full tensors with torch's autograd on one device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minimegatron import comm
from minimegatron.config import TrainConfig
from minimegatron.optim import NormGroup, Optimizer, clip_grad_norm
from minimegatron.placement import set_placement
from booktools.demo import import_chapter
from minimegatron.tp import (ColumnParallelLinear, RowParallelLinear, pad_vocab_size,
                             set_tensor_model_parallel_attributes, vocab_parallel_cross_entropy)

train_run = import_chapter("02").train_run

B, S, IN, OUT = 2, 3, 8, 12           # tiny layer shapes; tp 2, 3, 4 divide OUT (and 2, 4 IN)


def layer_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Full float64 tensors every rank (and the grader) builds alike: x [B, S, IN], the weights
    of a column layer [OUT, IN] and a row layer [IN, OUT] with biases, and output gradients."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return {"x": r(B, S, IN), "w_col": r(OUT, IN), "b_col": r(OUT), "dy_col": r(B, S, OUT),
            "w_row": r(IN, OUT), "b_row": r(IN), "dy_row": r(B, S, IN)}


def row_input() -> torch.Tensor:
    """The full [B, S, OUT] input whose slices grade_linear_layers feeds the row layer."""
    return torch.randn(B, S, OUT, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _calls(ledger) -> list[tuple[str, tuple[int, ...], str]]:
    return [(r.op, r.shape, r.tag) for r in ledger]


def grade_linear_layers(runs=()) -> dict:
    """On every rank (tp = world): a ColumnParallelLinear (with and without bias) and a
    RowParallelLinear (input already split), loaded with this rank's shards of layer_inputs(),
    forward and backward with this rank's slice of the output gradient; then `runs`, a list
    of the demo's TPRun, trained with train_run. Returns {"column": {bias: {...}}, "row": {...},
    "runs": [train_run records]}: outputs, input and parameter gradients and the ledger of
    the forward and of the backward, each as (op, shape, tag)."""
    group, full = dist.group.WORLD, layer_inputs()
    tp, rank = dist.get_world_size(), dist.get_rank()
    out = {"column": {}, "runs": []}
    for bias in (True, False):
        layer = ColumnParallelLinear(IN, OUT, group, bias=bias, params_dtype=torch.float64)
        layer.load_full(full["w_col"], full["b_col"] if bias else None)
        x = full["x"].clone().requires_grad_()
        with comm.record_communication() as fwd:
            y = layer(x)                                                  # [B, S, OUT/tp]
        with comm.record_communication() as bwd:
            y.backward(full["dy_col"].chunk(tp, dim=-1)[rank])
        out["column"][bias] = {"y": y.detach(), "dx": x.grad, "dw": layer.weight.grad,
                               "db": None if layer.bias is None else layer.bias.grad,
                               "fwd": _calls(fwd), "bwd": _calls(bwd)}
    layer = RowParallelLinear(OUT, IN, group, bias=True, params_dtype=torch.float64)
    layer.load_full(full["w_row"], full["b_row"])
    x_shard = row_input().chunk(tp, dim=-1)[rank].clone().requires_grad_()    # [B, S, OUT/tp]
    with comm.record_communication() as fwd:
        y = layer(x_shard)                                                # [B, S, IN]
    with comm.record_communication() as bwd:
        y.backward(full["dy_row"])
    out["row"] = {"y": y.detach(), "dx": x_shard.grad, "dw": layer.weight.grad, "db": layer.bias.grad,
                  "fwd": _calls(fwd), "bwd": _calls(bwd)}
    out["runs"] = [train_run(run) for run in runs]
    return out


VOCAB = 257                            # divisible by neither 2 nor 4: padded


def loss_inputs() -> dict[str, torch.Tensor]:
    """Full logits [2, 5, VOCAB] spread wide (values up to ~40: a naive exp would overflow in
    float32, not in float64), labels covering the first id, the last real id, and ids on every
    rank's shard, and an output gradient."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, VOCAB, generator=g, dtype=torch.float64) * 12
    labels = torch.randint(0, VOCAB, (2, 5), generator=g)
    labels[0, 0], labels[0, 1], labels[1, 0] = 0, VOCAB - 1, VOCAB // 2
    return {"logits": logits, "labels": labels, "dloss": torch.rand(2, 5, generator=g, dtype=torch.float64)}


def grade_vocab_parallel_loss(runs=()) -> dict:
    """On every rank (tp = world): vocab_parallel_cross_entropy on this rank's columns of
    loss_inputs()'s logits padded to pad_vocab_size(VOCAB, tp), with the padding columns set to
    large values (they must not count), forward and backward; then `runs` (train_run). Returns
    the losses, the gradient of this rank's columns, the forward and backward ledgers, and the
    run records."""
    group, full = dist.group.WORLD, loss_inputs()
    tp, rank = dist.get_world_size(), dist.get_rank()
    padded = pad_vocab_size(VOCAB, tp)
    logits = torch.cat([full["logits"], torch.full((2, 5, padded - VOCAB), 50.0, dtype=torch.float64)], dim=-1)
    shard = logits.chunk(tp, dim=-1)[rank].clone().requires_grad_()
    with comm.record_communication() as fwd:
        loss = vocab_parallel_cross_entropy(shard, full["labels"], group, vocab_size=VOCAB)
    with comm.record_communication() as bwd:
        loss.backward(full["dloss"])
    return {"loss": loss.detach(), "grad": shard.grad, "padded": padded, "fwd": _calls(fwd),
            "bwd": _calls(bwd), "runs": [train_run(run) for run in runs]}


def grad_norm_parameters(rank: int) -> list[nn.Parameter]:
    """Hand-made parameters of a rank, their gradients set, as a TP model would hold them:
      norm.weight   replicated (no TP attributes), grad [3., 4.] on every rank: squares 25;
      w             split (tensor_model_parallel in its record), this rank's shard of the gradient:
                    [k, 2k], k = rank + 1: squares 5 k^2;
      output copy   a pipeline's last-stage copy of a tied embedding (`shared`), split too,
                    grad [10., 10.] on every rank: the embedding's gradient again, so it
                    must not count at all."""
    k = float(rank + 1)
    norm, w, copy = (nn.Parameter(torch.zeros(2, dtype=torch.float64)) for _ in range(3))
    for p in (w, copy):
        set_tensor_model_parallel_attributes(p, 0, dist.group.WORLD)
    set_placement(copy, copy_of="embedding.word_embeddings.weight")
    for p, grad in ((norm, [3.0, 4.0]), (w, [k, 2 * k]), (copy, [10.0, 10.0])):
        p.grad = torch.tensor(grad, dtype=torch.float64)
    return [norm, w, copy]


def grade_grad_norm(runs=()) -> dict:
    """On every rank (tp = world): the global gradient norm of grad_norm_parameters(rank),
    through the library's path: optim.Optimizer over them (tp_rank = this rank, statistics
    over the TP group) and optim.clip_grad_norm (clipping off), whose filter is
    optim.grads_for_norm (exercise 2.4): its square and the ledger of the call; then `runs`
    (train_run)."""
    rank = dist.get_rank()
    params = grad_norm_parameters(rank)
    optimizer = Optimizer([nn.ParameterList(params)], TrainConfig(), [NormGroup(groups=(dist.group.WORLD,), tp_rank=rank)])
    with comm.record_communication() as ledger:
        norm = clip_grad_norm(optimizer, 0.0)
    return {"squares": norm ** 2, "ledger": _calls(ledger), "runs": [train_run(run) for run in runs]}
