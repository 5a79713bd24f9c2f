"""Running a pipeline schedule on real ranks: forwards, backwards, p2p, and the gradient syncs.

`run_pipeline_step` executes one rank's op list (schedules.schedule) over M micro-batches:

  F(mb, c)  input: tokens (virtual stage 0) or the previous stage's [b, s, h] (recv_forward);
            run chunk c; last virtual stage: losses.mean() / M, else send_forward [b, s, h]
  B(mb, c)  output gradient from the loss (last stage) or recv_backward; backpropagate
            through chunk c; send_backward the input's gradient (unless stage 0)

Gradients accumulate over the micro-batches; a data-parallel wrapper syncs with the chunk's
LAST backward (the others under no_sync). timeline.StepRecord measures each op's interval and
the activation bytes each forward saves.
Megatron-LM: megatron/core/pipeline_parallel/schedules.py."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from .. import comm
from ..dp import no_sync
from ..model import mean_loss
from .p2p import PipelineComm
from .schedules import schedule
from .timeline import StepRecord

__all__ = ["run_pipeline_step", "forward_backward_pipelining", "evaluate_pipelining"]


def _forward(engine: nn.Module, data: dict, x: torch.Tensor | None, labels: torch.Tensor | None) -> torch.Tensor:
    """A chunk's forward: the tokens of `data` (x None: virtual stage 0) or the previous stage's x [b, s, h]."""
    # every stage: the positions (RoPE under SP / CP) and packed documents' ids
    extra = dict(position_ids=data.get("position_ids"), document_ids=data.get("document_ids"))
    if x is None:
        return engine(data["tokens"], labels=labels, **extra)
    return engine(hidden_states=x, labels=labels, **extra)


def run_pipeline_step(engines: list[nn.Module], ops: list[tuple[str, int, int]], microbatches: list[dict],
                      p2p: PipelineComm, rank: int = 0, loss_scale: float = 1.0) -> StepRecord:
    """Run `ops` over `microbatches` (M dicts {"tokens", "labels"}, the same on every stage).
    engines[c]: chunk c, a GPTModel stage or its data-parallel wrapper. The last stage's backward
    starts from loss x `loss_scale`. With overlap_p2p_comm each receive is posted one op ahead.
    Returns the StepRecord; gradients are left accumulated (DP-synced where wrapped)."""
    M = len(microbatches)
    rec = StepRecord(rank, params={p.untyped_storage().data_ptr() for e in engines for p in e.parameters()})
    last_backward = {c: max(i for i, (op, _, ch) in enumerate(ops) if op == "B" and ch == c)
                     for c in range(len(engines))}
    held: dict[tuple[int, int], tuple] = {}              # (mb, chunk) -> (input, output or loss)

    for i, (op, mb, c) in enumerate(ops):
        engine, data = engines[c], microbatches[mb]
        if op == "F":
            x = None
            if not p2p.is_first(c):
                with rec.span("recv wait", mb, c):
                    x = p2p.recv_forward(mb, c)                               # [b, s, h]
            if p2p.overlap_p2p_comm and i + 1 < len(ops):
                p2p.post_recv_ahead(ops[i + 1])                               # arrives while this op computes
            labels = data["labels"] if p2p.is_last(c) else None
            with rec.span("F", mb, c):
                with rec.saving(mb, c):
                    out = _forward(engine, data, x, labels)
                if p2p.is_last(c):
                    # the micro-batch's share of the step loss
                    out = mean_loss(out, data.get("loss_mask"), data.get("loss_tokens")) / M
                    rec.losses[mb] = out.item()
            if not p2p.is_last(c):
                with rec.span("send", mb, c):
                    p2p.send_forward(out, mb, c)                              # [b, s, h], asynchronous
            held[(mb, c)] = (x, out)
            rec.in_flight(held)
        else:
            x, out = held.pop((mb, c))
            grad = None
            if not p2p.is_last(c):
                with rec.span("recv wait", mb, c):
                    grad = p2p.recv_backward(mb, c)                           # [b, s, h]
            if p2p.overlap_p2p_comm and i + 1 < len(ops):
                p2p.post_recv_ahead(ops[i + 1])
            with rec.span("B", mb, c):
                with nullcontext() if i == last_backward[c] else no_sync(engine):   # DP: sync on the last
                    torch.autograd.backward(out * loss_scale if grad is None else out, grad)
            if x is not None:
                with rec.span("send", mb, c):
                    p2p.send_backward(x.grad, mb, c)                          # asynchronous
    if held:
        raise RuntimeError(f"the schedule left forwards without a backward: {sorted(held)}")
    return rec


def forward_backward_pipelining(chunks: list[nn.Module], microbatches: list[dict], p2p: PipelineComm,
                                kind: str, pp_group, loss_scale: float = 1.0) -> tuple[float, StepRecord]:
    """One step's forwards and backwards on this rank's chunks in schedules.schedule(kind, ...) order,
    then wait for the sends. Returns (the pipeline's mean micro-batch loss, all-reduced over
    `pp_group`, tag "loss", the same on every stage; the StepRecord). Gradients left accumulated;
    the tied embedding's are finished by model.finalize_model_grads."""
    ops = schedule(kind, p2p.pp_size, p2p.pp_rank, len(microbatches), len(chunks))
    rec = run_pipeline_step(chunks, ops, microbatches, p2p, p2p.pp_rank, loss_scale)
    p2p.wait_sends()
    loss = torch.tensor([sum(rec.losses.values()) if rec.losses else 0.0], dtype=torch.float64, device=p2p.device)
    comm.all_reduce(loss, pp_group, op="sum", tag="loss")             # only the last stage has it
    return loss.item(), rec


@torch.no_grad()
def evaluate_pipelining(chunks: list[nn.Module], microbatch: dict, p2p: PipelineComm, pp_group,
                        index: int = 0) -> float:
    """The mean token loss of one micro-batch, forward only through every virtual stage in
    order; the same on every stage (all-reduced over `pp_group`, tag "loss")."""
    loss = 0.0
    for c, chunk in enumerate(chunks):
        chunk.eval()
        labels = microbatch["labels"] if p2p.is_last(c) else None
        out = _forward(chunk, microbatch, None if p2p.is_first(c) else p2p.recv_forward(index, c), labels)
        if p2p.is_last(c):
            loss = mean_loss(out, microbatch.get("loss_mask"), microbatch.get("loss_tokens")).item()
        else:
            p2p.send_forward(out, index, c)
        chunk.train()
    p2p.wait_sends()
    total = torch.tensor([loss], dtype=torch.float64, device=p2p.device)
    comm.all_reduce(total, pp_group, op="sum", tag="loss")
    return total.item()
