"""Running a pipeline schedule on real ranks: forwards, backwards, p2p, and the gradient syncs.

Shape legend as in model/gpt.py. `run_pipeline_step` executes one rank's op list (from
schedules.schedule) for one global batch of M micro-batches:

  F(mb, c)  input: the micro-batch's tokens (virtual stage 0) or the previous stage's hidden
            states [b, s, h] (p2p.recv_forward); run chunk c; on the last virtual stage the
            loss of the micro-batch, losses.mean() / M (the scaling of
            train.forward_backward_no_pipelining), else send the output [b, s, h] on (p2p.send_forward). Keep what the backward needs.
  B(mb, c)  the output's gradient: from the loss (last stage) or received (p2p.recv_backward);
            backpropagate through chunk c; send the input's gradient back (unless stage 0).

Gradients accumulate in p.grad over the micro-batches. With data parallelism each chunk is
wrapped in a chapter-01 wrapper and every backward but the chunk's LAST one runs inside
no_sync(): the data-parallel all-reduce happens once per step, during (bucketed DDP) or after
(finish_grad_sync) the last backward, as Megatron does. Then finalize_model_grads
(model/finalize.py) makes the tied embedding's two copies agree (stages.py's
allreduce_tied_embedding_grads, the "tied-embedding" gradient hook build_stage registers): the first stage's word
embedding and the last stage's output layer are one parameter of the single-device model, so their gradients are all-reduced over
the embedding group (first and last stage of the pipeline; Megatron's
_allreduce_word_embedding_grads in megatron/core/distributed/finalize_model_grads.py).

Measured on the way (for the chapter's figures and checks), by timeline.StepRecord, which the
loop calls around each op (the clock and the saved-tensor hooks live there): the intervals of
every op and of every wait for a receive, and the activation bytes each forward saves for
its backward, from which the peak number and bytes of micro-batches held at once follow.
"""

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


def run_pipeline_step(engines: list[nn.Module], ops: list[tuple[str, int, int]], microbatches: list[dict],
                      p2p: PipelineComm, rank: int = 0, loss_scale: float = 1.0) -> StepRecord:
    """Run `ops` (this rank's schedule) over `microbatches` (M dicts {"tokens", "labels"}, the
    same on every stage of the pipeline). engines[c] is chunk c: a GPTModel stage or a
    data-parallel wrapper of one (then its gradient sync runs with the last backward of the
    chunk; call model.finalize_model_grads after). The last stage's backward starts from its
    loss times `loss_scale` (the optimizer's loss scaler; 1 without one). With
    p2p.overlap_p2p_comm (chapter 07) the receive of op i+1 is posted before op i computes, so it
    travels meanwhile; each receive is still waited for just before its op. Returns the
    StepRecord; gradients are left accumulated in the parameters (DP-synced where wrapped)."""
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
                    # every stage: the positions (RoPE under SP / CP) and packed documents' ids
                    extra = dict(position_ids=data.get("position_ids"), document_ids=data.get("document_ids"))
                    out = (engine(data["tokens"], labels=labels, **extra) if x is None
                           else engine(hidden_states=x, labels=labels, **extra))
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
    """One step's forwards and backwards on this rank's model chunks (chunks[c] = chunk c,
    each a GPTModel stage or a data-parallel wrapper of one), in the order of
    schedules.schedule(kind, ...) over the M micro-batches; then waits for its sends.
    Returns (the mean loss of this pipeline's micro-batches, the same on every stage: the
    last stage's, all-reduced over `pp_group`, tag "loss"; the StepRecord). Gradients are
    left accumulated, DP-synced where wrapped; the tied embedding's are finished by
    model.finalize_model_grads."""
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
        extra = dict(position_ids=microbatch.get("position_ids"), document_ids=microbatch.get("document_ids"))
        if p2p.is_first(c):
            out = chunk(microbatch["tokens"], labels=labels, **extra)
        else:
            out = chunk(hidden_states=p2p.recv_forward(index, c), labels=labels, **extra)
        if p2p.is_last(c):
            loss = mean_loss(out, microbatch.get("loss_mask"), microbatch.get("loss_tokens")).item()
        else:
            p2p.send_forward(out, index, c)
        chunk.train()
    p2p.wait_sends()
    total = torch.tensor([loss], dtype=torch.float64, device=p2p.device)
    comm.all_reduce(total, pp_group, op="sum", tag="loss")
    return total.item()
