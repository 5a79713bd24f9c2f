"""ZeRO-1 and ZeRO-2: shard the optimizer state (and the gradients) over the data-parallel group.

Plain data parallelism keeps on every one of the dp ranks a full copy of the parameters, the
gradients and the optimizer state. ZeRO (Rajbhandari et al. 2020) removes the copies:

    stage 1  (P_os)     each rank keeps the AdamW state of 1/dp of the parameters only
    stage 2  (P_os+g)   ... and only that 1/dp of the reduced gradient
    stage 3  (P_os+g+p) ... and only that 1/dp of the parameters (fsdp.py)

The layout (after Megatron's param-and-grad buffer; Megatron makes one buffer per (param dtype,
grad dtype, expert-parallel) and gives the shared embedding its own bucket, the book one per
weight-decay group, cut by ddp.assign_buckets). The parameters are packed, in reverse order
(backward produces gradients from the output back), into flat *buckets*: one per weight-decay
group (matrices decay; biases and norm weights do not, as optim.param_groups), or several
of about `bucket_size` elements. A bucket of n elements is padded with zeros to dp * S
elements, S = ceil(n / dp), and rank r owns the elements [r S, (r+1) S) (`shard_range`):

    bucket.param_data  [dp*S]  p0 | p1 | p2 ......... | pad     the model's parameters are views
    bucket.grad_data   [dp*S]  same layout (stage 1)              the model's .grad are views
                               rank 0 | rank 1 | ... | rank dp-1  (S elements each)

One step, per bucket (Megatron: DistributedDataParallel + DistributedOptimizer):

    backward              every rank accumulates its local gradient of the whole bucket
    reduce-scatter (avg)  rank r receives the average over ranks of its S elements -> main_grad
    clip                  global norm: sum of squares of every rank's main_grad, all-reduced
    AdamW                 on this rank's [r S, r S + real) elements only (padding never enters)
    all-gather            every rank receives every rank's updated S elements -> param_data

Stage 1 keeps grad_data (dp*S) for the whole step and reduce-scatters in place, into its own
slice, in `finish_grad_sync` (`reduce_scatter_gradients`, exercise 1.3). Stage 2 has no
persistent grad_data: autograd writes each parameter's .grad as usual; the moment the last
gradient of a bucket is accumulated (a post-accumulate-grad hook) the bucket is packed into a
temporary flat buffer, reduce-scattered into the bucket's own S-element main_grad and every
.grad of the bucket is freed. So a rank never holds the full gradient of more than the
buckets still being produced (measured: `ZeroDataParallel.grad_bytes_peak`). With gradient
accumulation (`no_sync`) the .grad of the earlier micro-batches stay full-size until the last
micro-batch's backward reduces them.

Communication per optimizer step (e = bytes per element, ledger bytes; one call per bucket):

    reduce_scatter   sum_b dp * S_b * e       the padded flat gradients     tag "grads"
    all_reduce       1 * e                    the squared gradient norm     tag "grad-norm"
    all_gather       sum_b S_b * e            this rank's padded shards     tag "params"

Memory per rank (measured by `measure_memory`, compared with analysis.memory.training_memory):

    params           sum_b dp * S_b * e                  (formula: N e; the difference is padding)
    grads            stage 1: sum_b dp * S_b * e;  stage 2: sum_b S_b * e     (N e; ceil(N/dp) e)
    optimizer state  2 * real_r * e, real_r = this rank's unpadded elements   (2 ceil(N/dp) e)

Where this lives in Megatron-LM: megatron/core/distributed/param_and_grad_buffer.py
(_ParamAndGradBuffer, _ParamAndGradBucketGroup.start_grad_sync / start_param_sync, shard_buffer)
and megatron/core/optimizer/distrib_optimizer.py (DistributedOptimizer: the shard ranges,
the main parameters, the param all-gather).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from ..comm import all_gather_into_tensor, group_rank, group_size, reduce_scatter_tensor
from ..config import TrainConfig
from ..optim import Optimizer, grads_for_norm, is_expert_parameter
from .ddp import assign_buckets
from .naive import DataParallel


def shard_range(numel: int, dp: int, rank: int) -> tuple[int, int]:
    """The elements [start, end) of a flat buffer of `numel` elements that `rank` of `dp` owns.

    The buffer is padded to dp * S elements, S = ceil(numel / dp), and every rank owns exactly
    S of them, so reduce-scatter and all-gather see equal sizes: start = rank * S, end = start + S.
    Elements at or beyond `numel` are padding (the last rank(s) may own only padding).
    A pure function: the ranges of ranks 0..dp-1 tile [0, dp * S).
    """
    if dp < 1 or not 0 <= rank < dp or numel < 0:
        raise ValueError(f"shard_range: need numel >= 0, dp >= 1 and 0 <= rank < dp, "
                         f"got numel={numel}, dp={dp}, rank={rank}")
    size = math.ceil(numel / dp)
    return rank * size, (rank + 1) * size


@dataclass
class Bucket:
    """One flat bucket of parameters (all of one weight-decay group) and its shard on this rank.

    params/names/offsets: the bucket's parameters in buffer order, where each one starts.
    numel: elements of real parameters; padded_numel = dp * shard_numel >= numel.
    param_data [padded_numel]: the full parameters; each model parameter's .data is a view.
    grad_data [padded_numel] or None: stage 1's full local gradients (each .grad is a view).
    main_grad [shard_numel]: this rank's shard of the AVERAGED gradient (stage 1: the view
        grad_data[start:end]; stage 2: its own tensor). Accumulates; zeroed by zero_grad.
    start, end: this rank's shard_range; real = how many of its elements are not padding.
    """
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    numel: int
    padded_numel: int
    shard_numel: int
    decay: bool
    start: int
    end: int
    param_data: torch.Tensor
    grad_data: torch.Tensor | None
    main_grad: torch.Tensor

    @property
    def real(self) -> int:
        return max(0, min(self.end, self.numel) - self.start)

    @property
    def shard_param(self) -> torch.Tensor:
        """[shard_numel]: this rank's slice of param_data (padding included): what it all-gathers."""
        return self.param_data[self.start:self.end]


def build_buckets(model: nn.Module, dp: int, rank: int, bucket_size: int | None = None,
                  grad_buffer: bool = True, experts: bool | None = None) -> list[Bucket]:
    """Pack `model`'s parameters into padded flat buckets; the parameters become views of them.

    Parameters are taken in reverse order (the order backward produces their gradients) and
    split by weight decay (dim >= 2: decay); each group is cut into buckets of at least
    `bucket_size` elements (None: one bucket per group). With `grad_buffer` each parameter's
    .grad becomes a view of a zeroed bucket.grad_data (stage 1). experts=True / False: only the
    parameters marked allreduce=False (a mixture's experts, chapter 05) / only the others.
    """
    named = list(model.named_parameters())[::-1]
    if experts is not None:
        named = [(n, p) for n, p in named if is_expert_parameter(p) == experts]
    if not named:
        return []
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) != 1:
        raise ValueError(f"build_buckets: one dtype per model expected, got {sorted(map(str, dtypes))}")
    buckets = []
    for decay in (True, False):
        members = [(n, p) for n, p in named if (p.dim() >= 2) == decay]
        for indices in assign_buckets([p.numel() for _, p in members], bucket_size):   # DDP's rule
            buckets.append(_make_bucket([members[i] for i in indices], decay, dp, rank, grad_buffer))
    return buckets


def _make_bucket(members, decay: bool, dp: int, rank: int, grad_buffer: bool) -> Bucket:
    offsets, numel = [], 0
    for _, p in members:
        offsets.append(numel)
        numel += p.numel()
    start, end = shard_range(numel, dp, rank)
    dtype = members[0][1].dtype
    param_data = torch.zeros(dp * (end - start), dtype=dtype, device=members[0][1].device)   # padding stays 0
    grad_data = torch.zeros_like(param_data) if grad_buffer else None
    with torch.no_grad():
        for (_, p), off in zip(members, offsets):
            view = param_data[off:off + p.numel()].view_as(p)
            view.copy_(p)
            p.data = view                          # the model now reads its weights from the bucket
            if grad_data is not None:
                p.grad = grad_data[off:off + p.numel()].view_as(p)
    main_grad = grad_data[start:end] if grad_data is not None else torch.zeros(end - start, dtype=dtype, device=param_data.device)
    return Bucket([p for _, p in members], [n for n, _ in members], offsets, numel, len(param_data),
                  end - start, decay, start, end, param_data, grad_data, main_grad)


def reduce_scatter_gradients(buckets: list[Bucket], group) -> None:
    """ZeRO-1's gradient sync (what ZeroDataParallel.finish_grad_sync runs at stage 1): from
    every rank's local gradients to this rank's shard of their average, bucket by bucket.

    For each bucket b of `buckets`, in list order (see `Bucket`; S = b.shard_numel, dp = the
    size of `group`, this rank owns the elements [b.start, b.end) of the bucket):
      before: b.grad_data [dp*S] holds this rank's local gradient of the whole bucket,
              accumulated by backward (the model's .grad are views of it; the padding is 0);
      after:  b.main_grad [S] holds the average over the ranks of `group` of their
              b.grad_data[b.start:b.end]: the gradient shard the DistributedOptimizer clips
              and steps with. main_grad IS the view b.grad_data[b.start:b.end], so the
              result lands in place, in the bucket's own buffer (as Megatron's distributed
              optimizer does); the rest of grad_data is not read again before zero_grad.
    Collectives: exactly one comm.reduce_scatter_tensor per bucket, over `group`, op "avg",
    tag "grads", in bucket order (every rank issues the same calls in the same order).
    Ledger: len(buckets) reduce_scatter records of dp*S*e bytes each (e bytes per element).
    An all-reduce of grad_data would leave the same numbers in main_grad, but it moves twice
    the bytes of a reduce-scatter (all-reduce = reduce-scatter + all-gather) to give every
    rank the parts of the average that only other ranks step with.
    """
    # BEGIN EXERCISE 1.3: ZeRO-1's gradient reduce-scatter | hint: one comm.reduce_scatter_tensor(out, t, group, op=..., tag=...) per bucket; its output is this rank's own slice of its input, and that slice is b.main_grad
    for b in buckets:
        # in place: the output is this rank's own slice of the input (as Megatron does)
        reduce_scatter_tensor(b.main_grad, b.grad_data, group, op="avg", tag="grads")
    # END EXERCISE


class ZeroDataParallel(DataParallel):
    """Data parallelism with ZeRO stage 1 (optimizer state sharded) or 2 (and gradients).

    Wraps `module` (replicated on every rank of `group`, same initial weights); step with a
    `DistributedOptimizer(wrapper, train_cfg)`:

        loss = wrapper(tokens, labels=labels).mean() / M      # forward = the module's
        with wrapper.no_sync(): loss.backward()               # micro-batches 0..M-2
        loss.backward(); wrapper.finish_grad_sync()           # the last one, then reduce
        optim.clip_grad_norm(optimizer, max_norm); optimizer.step(); optimizer.zero_grad()

    bucket_size: elements per bucket (None: one bucket per weight-decay group). Stage 2
    reduce-scatters each bucket during the backward of the last micro-batch, as soon as the
    bucket is complete, and frees its .grad; smaller buckets mean a smaller gradient peak.
    """

    def __init__(self, module: nn.Module, group, stage: int = 1, bucket_size: int | None = None,
                 expert_group=None):
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel: stage={stage} must be 1 or 2 (stage 3: FullyShardedDataParallel)")
        super().__init__(module, group)
        self.stage = stage
        self.dp, self.rank = group_size(group), group_rank(group)
        has_experts = any(is_expert_parameter(p) for p in module.parameters())
        if has_experts and (expert_group is None or stage != 1):
            raise ValueError("ZeroDataParallel with experts (parameters marked allreduce=False): stage 1 only, "
                             "with the expert-data-parallel group as expert_group")
        # a mixture's experts (chapter 05): buckets of their own, sharded over expert_group
        self.expert_group = expert_group
        self.expert_dp, self.expert_rank = (group_size(expert_group), group_rank(expert_group)) if has_experts \
            else (1, 0)
        self.expert_buckets = build_buckets(module, self.expert_dp, self.expert_rank, bucket_size, True,
                                            experts=True) if has_experts else []
        self.buckets = build_buckets(module, self.dp, self.rank, bucket_size, grad_buffer=stage == 1,
                                     experts=False if has_experts else None)
        self._reduced: set[int] = set()  # buckets reduced since the last finish_grad_sync
        self._ready: dict[int, set[int]] = {}
        self.grad_bytes_peak = 0         # stage 2: most full-gradient bytes held during backward
        if stage == 2:
            self._where = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
            for b in self.buckets:
                for p in b.params:
                    p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        if self.stage == 1:            # someone may have set .grad to None (model.zero_grad())
            for b in self.buckets + self.expert_buckets:
                for p, off in zip(b.params, b.offsets):
                    if p.grad is None:
                        p.grad = b.grad_data[off:off + p.numel()].view_as(p)
        return self.module(*args, **kwargs)

    # ---- stage 2: reduce a bucket as soon as its last gradient is accumulated ------------
    def _grad_ready(self, param: nn.Parameter) -> None:
        self.grad_bytes_peak = max(self.grad_bytes_peak, self._full_grad_bytes())
        if not self.syncing:
            return
        i = self._where[id(param)]
        ready = self._ready.setdefault(i, set())
        ready.add(id(param))
        if len(ready) == len(self.buckets[i].params):
            self._reduce_bucket(i)

    def _full_grad_bytes(self) -> int:
        return sum(p.grad.numel() * p.grad.element_size() for b in self.buckets
                   for p in b.params if p.grad is not None)

    def _reduce_bucket(self, i: int) -> None:
        """Stage 2: pack the bucket's .grad into a temporary flat buffer, free them, and
        reduce-scatter (avg) the buffer; this rank's slice is added to main_grad."""
        b = self.buckets[i]
        flat = b.param_data.new_zeros(b.padded_numel)
        for p, off in zip(b.params, b.offsets):
            if p.grad is not None:
                flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None                              # the full gradient is gone
        self.grad_bytes_peak = max(self.grad_bytes_peak, self._full_grad_bytes() + flat.numel() * flat.element_size())
        mine = flat[b.start:b.end]
        reduce_scatter_tensor(mine, flat, self.group, op="avg", tag="grads")
        b.main_grad.add_(mine)                           # add: a step may sync more than once
        self._reduced.add(i)
        self._ready.pop(i, None)

    def finish_grad_sync(self) -> None:
        """After the last micro-batch's backward: every bucket's main_grad holds this rank's
        shard of the gradient averaged over the group (stage 1: one in-place reduce-scatter
        per bucket now; stage 2: the buckets the backward did not complete are reduced now)."""
        self.check_can_sync()
        if self.stage == 1:
            reduce_scatter_gradients(self.buckets, self.group)     # exercise 1.3
            # experts: the SUM over expert_group divided by the dense dp (ddp.py's rule), as an
            # average over expert_group of the gradients scaled by expert_dp / dp (Megatron's
            # expert scaling with average_in_collective)
            for b in self.expert_buckets:
                b.grad_data.mul_(self.expert_dp / self.dp)
            reduce_scatter_gradients(self.expert_buckets, self.expert_group)
        else:
            for i in range(len(self.buckets)):
                if i not in self._reduced:
                    self._reduce_bucket(i)
        self._reduced.clear()
        self._ready.clear()

    # ---- what DistributedOptimizer asks of a wrapper --------------------------------------
    def optimizer_segments(self) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        """(parameter shard, its gradient, weight decay?) for this rank, padding excluded."""
        return [(b.param_data[b.start:b.start + b.real], b.main_grad[:b.real], b.decay)
                for b in self.buckets + self.expert_buckets if b.real > 0]

    def _bucket_groups(self):
        return [(self.buckets, self.group), (self.expert_buckets, self.expert_group)]

    def after_optimizer_step(self) -> None:
        """All-gather every bucket's updated shard: all ranks hold the full parameters again."""
        for buckets, group in self._bucket_groups():
            for b in buckets:
                all_gather_into_tensor(b.param_data, b.shard_param, group, tag="params")

    def zero_grad_buffers(self) -> None:
        for b in self.buckets + self.expert_buckets:
            if b.grad_data is not None:
                b.grad_data.zero_()
            else:
                b.main_grad.zero_()
                for p in b.params:
                    p.grad = None
        self.grad_bytes_peak = 0

    # ---- inspection (tests, demos): collective, tag "inspect" ----------------------------
    def gather_gradients(self) -> dict[str, torch.Tensor]:
        """The full averaged gradient of every parameter (after finish_grad_sync), by name."""
        out = {}
        for buckets, group in self._bucket_groups():
            for b in buckets:
                full = torch.empty_like(b.param_data)
                all_gather_into_tensor(full, b.main_grad, group, tag="inspect")
                for name, p, off in zip(b.names, b.params, b.offsets):
                    out[name] = full[off:off + p.numel()].view_as(p).clone()
        return out

    def grad_shard_pieces(self, experts: bool = False) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, the part of its averaged gradient in this rank's shard) for every
        parameter that overlaps the shard (views of main_grad; padding excluded): the norm
        reads the parameter's attributes to count each element once (optim.grads_for_norm).
        experts=True: the experts' buckets instead."""
        pieces = []
        for b in self.expert_buckets if experts else self.buckets:
            for p, off in zip(b.params, b.offsets):
                lo, hi = max(off, b.start), min(off + p.numel(), b.end)
                if lo < hi:
                    pieces.append((p, b.main_grad[lo - b.start:hi - b.start]))
        return pieces

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors that hold this rank's parameters and gradients (for measure_memory)."""
        buckets = self.buckets + self.expert_buckets
        grads = [b.grad_data if b.grad_data is not None else b.main_grad for b in buckets]
        grads += [p.grad for b in buckets for p in b.params if p.grad is not None]
        return {"params": [b.param_data for b in buckets], "grads": grads}


class DistributedOptimizer(Optimizer):
    """AdamW on this rank's shards, for every ZeRO stage (Megatron's DistributedOptimizer).

    `wrapper` (ZeroDataParallel or FullyShardedDataParallel) lists this rank's shards as
    (parameter view, gradient view, decay) segments; they become the tensors of optim.Optimizer
    (torch AdamW with the decay and no-decay groups). AdamW is elementwise, so stepping a shard
    does to each element exactly what the single-device AdamW does to it. After the step the
    wrapper restores full parameters where its stage keeps them (stages 1 and 2: all-gather;
    stage 3: nothing, the next forward gathers).

    The gradient norm (optim.clip_grad_norm) counts this rank's shard of the averaged
    gradient, filtered like any gradient by the attributes of the parameter each piece
    belongs to (tensor-parallel duplicates on TP rank 0 only), and sums over the model's
    groups and the data-parallel group: grad_stats_groups = model_groups + [dp group].
    """

    def __init__(self, wrapper: nn.Module, cfg: TrainConfig, tp_rank: int = 0, model_groups=(),
                 expert_model_groups=None, expert_tp_rank: int = 0):
        segments = wrapper.optimizer_segments()
        decay = {id(param) for param, _, d in segments if d}
        experts = getattr(wrapper, "expert_buckets", [])
        super().__init__([param for param, _, _ in segments], cfg, tp_rank,
                         [*model_groups, wrapper.group], decay=lambda p: id(p) in decay,
                         expert_grad_stats_groups=[*expert_model_groups, wrapper.expert_group]
                         if experts and expert_model_groups is not None else None, expert_tp_rank=expert_tp_rank)
        self.wrapper = wrapper
        for param, grad, _ in segments:
            param.grad = grad                    # a view of the wrapper's main_grad: set once
        self._layout = [(p.numel(), d) for p, _, d in segments]

    def grads_for_norm(self) -> list[torch.Tensor]:
        return grads_for_norm(self.wrapper.grad_shard_pieces(), self.tp_rank)

    def expert_grads_for_norm(self) -> list[torch.Tensor]:
        return grads_for_norm(self.wrapper.grad_shard_pieces(experts=True), self.expert_tp_rank)

    def step(self) -> None:
        super().step()
        self.wrapper.after_optimizer_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wrapper.zero_grad_buffers()

    def state_dict(self) -> dict:
        """THIS rank's shard of the optimizer state (a copy) and the layout it belongs to."""
        return {"dp": self.wrapper.dp, "rank": self.wrapper.rank, "segments": list(self._layout),
                "optimizer": copy.deepcopy(super().state_dict())}

    def load_state_dict(self, state: dict) -> None:
        mine = {"dp": self.wrapper.dp, "rank": self.wrapper.rank, "segments": list(self._layout)}
        theirs = {k: (list(map(tuple, state[k])) if k == "segments" else state[k]) for k in mine}
        if theirs != mine:
            raise ValueError(f"optimizer state of another layout: saved dp={theirs['dp']} rank={theirs['rank']} "
                             f"with {len(theirs['segments'])} segments, this is dp={mine['dp']} "
                             f"rank={mine['rank']} with {len(mine['segments'])}")
        super().load_state_dict(copy.deepcopy(state["optimizer"]))


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def measure_memory(wrapper: nn.Module, optimizer: DistributedOptimizer) -> dict:
    """Bytes this rank holds, measured on the real tensors (storage sizes):
    {"params", "grads", "exp_avg", "exp_avg_sq", "optimizer" (= exp_avg + exp_avg_sq),
     "step_counters" (AdamW's scalar step tensors, outside the ZeRO paper's accounting)}."""
    held = wrapper.memory_tensors()
    state = [optimizer.state[p] for g in optimizer.param_groups for p in g["params"] if p in optimizer.state]
    out = {"params": storage_bytes(held["params"]), "grads": storage_bytes(held["grads"]),
           "exp_avg": storage_bytes(s["exp_avg"] for s in state),
           "exp_avg_sq": storage_bytes(s["exp_avg_sq"] for s in state),
           "step_counters": sum(s["step"].numel() * s["step"].element_size() for s in state)}
    out["optimizer"] = out["exp_avg"] + out["exp_avg_sq"]
    return out


__all__ = ["shard_range", "Bucket", "build_buckets", "reduce_scatter_gradients", "ZeroDataParallel",
           "DistributedOptimizer", "storage_bytes", "measure_memory"]

