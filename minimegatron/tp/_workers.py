"""Rank functions for the graders of chapter 02 (tensor parallelism).

`launch.spawn` runs functions that a new process imports by name, so what the ranks run lives
here, in the package. Each function runs on every rank of a world whose WHOLE world is one
tensor-parallel group (tp = world size), except the training runs, which build their own grid
(`demos.ch02.train_run`). They return plain data (tensors, ledger calls); the graders compare
it in the parent with an independent oracle: the same computation done on full tensors with
torch's autograd on one device. Nothing here is part of the book's API.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..demos.ch02 import train_run
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, pad_vocab_size
from .model import tensor_parallel_grad_norm_squared

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
    of demos.ch02 TPRun, trained with train_run. Returns {"column": {bias: {...}}, "row": {...},
    "runs": [train_run records]}: outputs, input and parameter gradients and the ledger of
    the forward and of the backward, each as (op, shape, tag)."""
    group, full = dist.group.WORLD, layer_inputs()
    tp, rank = dist.get_world_size(), dist.get_rank()
    out = {"column": {}, "runs": []}
    for bias in (True, False):
        layer = ColumnParallelLinear(IN, OUT, group, bias=bias).double()
        layer.load_full(full["w_col"], full["b_col"] if bias else None)
        x = full["x"].clone().requires_grad_()
        with comm.record_communication() as fwd:
            y = layer(x)                                                  # [B, S, OUT/tp]
        with comm.record_communication() as bwd:
            y.backward(full["dy_col"].chunk(tp, dim=-1)[rank])
        out["column"][bias] = {"y": y.detach(), "dx": x.grad, "dw": layer.weight.grad,
                               "db": None if layer.bias is None else layer.bias.grad,
                               "fwd": _calls(fwd), "bwd": _calls(bwd)}
    layer = RowParallelLinear(OUT, IN, group, bias=True).double()
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


def grad_norm_inputs(rank: int) -> list[tuple[str, torch.Tensor]]:
    """Hand-made gradients of a rank: a replicated "norm.weight" [3., 4.] (the same on every
    rank: squares 25) and this rank's shard of a split "w": [rank + 1, 2 (rank + 1)]."""
    k = float(rank + 1)
    return [("norm.weight", torch.tensor([3.0, 4.0], dtype=torch.float64)),
            ("w", torch.tensor([k, 2 * k], dtype=torch.float64))]


def grade_grad_norm(runs=()) -> dict:
    """On every rank (tp = world): tensor_parallel_grad_norm_squared of grad_norm_inputs(rank)
    with "norm.weight" replicated, and its ledger; then `runs` (train_run)."""
    rank = dist.get_rank()
    with comm.record_communication() as ledger:
        squares = tensor_parallel_grad_norm_squared(grad_norm_inputs(rank), {"norm.weight"}, dist.group.WORLD)
    return {"squares": squares.clone(), "ledger": _calls(ledger), "runs": [train_run(run) for run in runs]}
