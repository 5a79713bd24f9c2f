"""Point-to-point communication between pipeline stages: activations forward, gradients back.

Between consecutive virtual stages travel only a micro-batch's hidden states [b, s, h]
(forward) and their gradient (backward), shape and dtype agreed in advance (no shape sent).
Sends are asynchronous (comm.isend, waited in `wait_sends` at the step's end); receives block,
so any schedule whose dependencies can be met runs without deadlock. With overlap_p2p_comm
(chapter 07) `post_recv_ahead` posts the next op's receive before the current op computes:
same messages, earlier posting. Each (direction, micro-batch, receiving virtual stage) has
its own p2p tag, so messages between the same two ranks never mix.

Ledger: every send and receive, tag "pp-fwd" (activations) or "pp-bwd" (gradients),
b * s * h * e bytes each.
Megatron-LM: megatron/core/pipeline_parallel/p2p_communication.py."""

from __future__ import annotations

import torch

from .. import comm
from .stages import virtual_stage

__all__ = ["PipelineComm"]


class PipelineComm:
    """The p2p endpoints of one pipeline rank. ranks: the pipeline group's global ranks in stage
    order; pp_rank: this stage; num_chunks: v; shape, dtype: every message's ([b, s, h], the
    model's dtype); device: of the received buffers; overlap_p2p_comm: post receives one op ahead."""

    def __init__(self, ranks: list[int], pp_rank: int, num_chunks: int, shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device | str = "cpu", overlap_p2p_comm: bool = False):
        self.ranks, self.pp_rank, self.num_chunks = list(ranks), pp_rank, num_chunks
        self.overlap_p2p_comm = overlap_p2p_comm
        self.pp_size = len(ranks)
        self.shape, self.dtype, self.device = tuple(shape), dtype, torch.device(device)
        self.last_stage = self.pp_size * num_chunks - 1
        self._pending: list = []          # (handle, tensor) of sends not yet waited for
        self._posted: dict = {}           # (direction, micro-batch, chunk) -> (handle, buffer) of early receives

    # ---- who is next -------------------------------------------------------------------
    def stage(self, chunk: int) -> int:
        return virtual_stage(self.pp_size, self.pp_rank, chunk)

    def is_first(self, chunk: int) -> bool:
        return self.stage(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.stage(chunk) == self.last_stage

    def _rank_of(self, stage: int) -> int:
        return self.ranks[stage % self.pp_size]

    def _tag(self, direction: int, microbatch: int, to_stage: int) -> int:
        # unique per (direction, micro-batch, receiving virtual stage)
        return (microbatch * (self.last_stage + 1) + to_stage) * 2 + direction

    # ---- forward: activations ----------------------------------------------------------
    def send_forward(self, hidden: torch.Tensor, microbatch: int, chunk: int) -> None:
        """Send chunk `chunk`'s output [b, s, h] for `microbatch` to the next virtual stage."""
        to = self.stage(chunk) + 1
        t = hidden.detach().contiguous()
        self._pending.append((comm.isend(t, self._rank_of(to), tag="pp-fwd", p2p_tag=self._tag(0, microbatch, to)), t))

    def recv_forward(self, microbatch: int, chunk: int) -> torch.Tensor:
        """The previous virtual stage's output for `microbatch`: [b, s, h], requires grad."""
        return self._received(0, microbatch, chunk).requires_grad_()

    # ---- backward: gradients -----------------------------------------------------------
    def send_backward(self, grad: torch.Tensor, microbatch: int, chunk: int) -> None:
        """Send the gradient of this chunk's input [b, s, h] to the previous virtual stage."""
        to = self.stage(chunk) - 1
        t = grad.contiguous()
        self._pending.append((comm.isend(t, self._rank_of(to), tag="pp-bwd", p2p_tag=self._tag(1, microbatch, to)), t))

    def recv_backward(self, microbatch: int, chunk: int) -> torch.Tensor:
        """The gradient of this chunk's output for `microbatch`, from the next virtual stage."""
        return self._received(1, microbatch, chunk)

    # ---- receives, posted when needed or one op ahead (chapter 07) -----------------------
    def _post(self, direction: int, microbatch: int, chunk: int) -> None:
        """Post the receive of (direction 0: activations from the previous virtual stage, 1:
        gradients from the next; microbatch; chunk) without waiting for it."""
        me = self.stage(chunk)
        t = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        handle = comm.irecv(t, self._rank_of(me - 1 if direction == 0 else me + 1),
                            tag=("pp-fwd", "pp-bwd")[direction], p2p_tag=self._tag(direction, microbatch, me))
        self._posted[(direction, microbatch, chunk)] = (handle, t)

    def _received(self, direction: int, microbatch: int, chunk: int) -> torch.Tensor:
        """The tensor of that receive, posted now unless it already was, once it has arrived."""
        if (direction, microbatch, chunk) not in self._posted:
            self._post(direction, microbatch, chunk)
        handle, t = self._posted.pop((direction, microbatch, chunk))
        handle.wait()
        return t

    def post_recv_ahead(self, op: tuple[str, int, int]) -> None:
        """Post the receive that schedule op ("F" or "B", micro-batch, chunk) will wait for, if any."""
        kind, microbatch, chunk = op
        if kind == "F" and not self.is_first(chunk):
            self._post(0, microbatch, chunk)
        elif kind == "B" and not self.is_last(chunk):
            self._post(1, microbatch, chunk)

    def wait_sends(self) -> None:
        """Block until every send of this step has been handed over; release the buffers."""
        if self._posted:
            raise RuntimeError(f"receives posted but never used: {sorted(self._posted)}")
        for handle, _ in self._pending:
            handle.wait()
        self._pending.clear()
