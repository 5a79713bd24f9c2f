"""The training loop's view of a pipeline stage: one step, evaluation, the optimizer's norm.

`train.py` runs one loop for every layout. Under pipeline parallelism a rank holds only some
stages, and a step is a schedule, not a forward and a backward; so the loop hands the step to
a `PipelineEngine` (as it hands gradient syncing to chapter 01's wrappers):

    engine = PipelineEngine(chunks, "1f1b", M, p2p, pp_group, embedding_group, dp_group, tp_group)
    optimizer = PipelineOptimizer(build_optimizer(engine.module, cfg), engine)
    loss = engine.pipeline_step(microbatches)     # the schedule, DP sync, tied embedding grads
    optimizer.clip_grad_norm(clip); optimizer.step(); optimizer.zero_grad()
    val = engine.pipeline_evaluate(microbatch)    # forward only, through every stage

Every rank of the pipeline returns the same loss (the last stage's, all-reduced over the
pipeline group): the progress bar, the checkpoint and resume see one number.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import comm
from .executor import finish_pipeline_grads, pipeline_grad_norm_squared, run_pipeline_step
from .p2p import PipelineComm
from .schedules import schedule

__all__ = ["PipelineEngine", "PipelineOptimizer"]


class PipelineEngine:
    """This rank's model chunks (chunks[c] = chunk c, a GPTModel or TensorParallelGPTModel
    stage), the schedule `kind` over `num_microbatches`, and the groups: `pp_group` (this
    pipeline), `embedding_group` (its first and last stage; None when pp = 1 or untied
    embeddings need no sync), `dp_group` (each chunk wrapped in bucketed DDP when given),
    `tp_group` (3D: the chunks are tensor-parallel). `module` is an nn.ModuleList of the
    chunks: its state_dict is this rank's part of the model."""

    def __init__(self, chunks: list[nn.Module], kind: str, num_microbatches: int, p2p: PipelineComm,
                 pp_group, embedding_group=None, dp_group=None, tp_group=None, bucket_size_bytes: int | None = None):
        from ..dp import DistributedDataParallel
        self.chunks, self.module = chunks, nn.ModuleList(chunks)
        self.p2p, self.pp_group, self.embedding_group, self.tp_group = p2p, pp_group, embedding_group, tp_group
        self.engines = (chunks if dp_group is None else
                        [DistributedDataParallel(c, dp_group, bucket_size_bytes=bucket_size_bytes) for c in chunks])
        self.ops = schedule(kind, p2p.pp_size, p2p.pp_rank, num_microbatches, len(chunks))
        self.last_record = None

    def _broadcast_loss(self, loss: float | None) -> float:
        t = torch.tensor([loss or 0.0], dtype=torch.float64)     # only the last stage has it
        comm.all_reduce(t, self.pp_group, op="sum", tag="loss")
        return t.item()

    def pipeline_step(self, microbatches: list[dict[str, torch.Tensor]]) -> float:
        """One step's forwards and backwards (the schedule), the data-parallel gradient sync
        and the tied embedding's gradients. Returns the mean loss of this pipeline's
        micro-batches, the same on every stage."""
        if len(microbatches) * len(self.chunks) != sum(op == "F" for op, _, _ in self.ops):
            raise ValueError(f"{len(microbatches)} micro-batches, the schedule was built for "
                             f"{sum(op == 'F' for op, _, _ in self.ops) // len(self.chunks)}")
        rec = run_pipeline_step(self.engines, self.ops, microbatches, self.p2p, self.p2p.pp_rank)
        finish_pipeline_grads(self.engines, self.chunks, self.p2p, self.embedding_group)
        self.last_record = rec
        return self._broadcast_loss(sum(rec.losses.values()) if rec.losses else None)

    @torch.no_grad()
    def pipeline_evaluate(self, microbatch: dict[str, torch.Tensor], index: int = 0) -> float:
        """The mean token loss of one micro-batch, forward only through every virtual stage
        in order; the same on every stage."""
        loss = None
        for c, chunk in enumerate(self.chunks):
            chunk.eval()
            x = None if self.p2p.is_first(c) else self.p2p.recv_forward(index, c)
            labels = microbatch["labels"] if self.p2p.is_last(c) else None
            out = chunk(microbatch["tokens"], labels=labels) if x is None else chunk(hidden_states=x, labels=labels)
            if self.p2p.is_last(c):
                loss = out.mean().item()
            else:
                self.p2p.send_forward(out, index, c)
            chunk.train()
        self.p2p.wait_sends()
        return self._broadcast_loss(loss)

    def grad_norm_squared(self) -> torch.Tensor:
        return pipeline_grad_norm_squared(self.chunks, self.p2p, self.pp_group, self.tp_group)

    # ---- the single-device view ----------------------------------------------------------
    def stage_tensors(self, what: str = "params") -> dict[str, torch.Tensor]:
        """This rank's stages' parameters (or gradients, what="grads") under single-device
        names and full shapes, without the last stage's copy of a tied embedding. A
        tensor-parallel chunk's shards are gathered: a collective over its TP group."""
        from ..tp import TensorParallelGPTModel, full_gradients, full_parameters
        out = {}
        for chunk in self.chunks:
            if isinstance(chunk, TensorParallelGPTModel):
                full = full_gradients(chunk) if what == "grads" else full_parameters(chunk)
            else:
                full = {n: (p.grad if what == "grads" else p).detach().clone()
                        for n, p in chunk.named_parameters() if (p.grad if what == "grads" else p) is not None}
            tied = not chunk.config.untie_embeddings_and_output_weights
            out.update({n: t for n, t in full.items() if not (tied and n == "output_layer.weight")})
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The single-device model's state dict on global rank 0 (every stage's part, gathered
        with torch.distributed.gather_object over the world: checkpoint plumbing, not counted
        in the ledger); None on the other ranks. Collective: every rank must call it."""
        import torch.distributed as dist
        mine = self.stage_tensors("params")
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if parts is None:
            return None
        state = {}
        for part in parts:                   # the DP replicas and TP ranks hold equal copies
            state.update(part)
        return state


class PipelineOptimizer:
    """torch AdamW over this rank's chunks, with the global gradient norm of the whole model
    (summed over the pipeline and tensor-parallel groups, see executor.pipeline_grad_norm_squared);
    the interface train.optimizer_step uses (as dp.ReplicatedOptimizer)."""

    def __init__(self, inner: torch.optim.Optimizer, engine: PipelineEngine):
        self.inner, self.engine = inner, engine

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def clip_grad_norm(self, max_norm: float) -> float:
        norm = self.engine.grad_norm_squared().sqrt()[0]
        if max_norm > 0:                          # torch.nn.utils.clip_grad_norm_'s rule
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in self.engine.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return float(norm)

    def step(self) -> None:
        self.inner.step()

    def zero_grad(self) -> None:
        self.inner.zero_grad(set_to_none=True)
        for e in self.engine.engines:
            if hasattr(e, "zero_grad_buffer"):
                e.zero_grad_buffer()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
