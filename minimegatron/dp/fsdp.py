"""ZeRO-3 / FSDP: the parameters themselves are sharded, and gathered one unit at a time.

The model is cut into units (`gpt_unit_plan`): embedding, each decoder.layers.i, head (final norm +
untied output layer). A unit's parameters are flattened (matrices first, then vectors), padded
to dp * S and cut like a ZeRO-1 bucket: rank r keeps only `unit.shard` [S]; the model's own
parameters are deleted, so between forwards no rank holds a full weight.

  forward    a unit's forward pre-hook all-gathers it (gather_unit_parameters, tag "fwd") and
             sets each module attribute to a view of the gathered buffer; its forward hook
             deletes them (_free_for). Tied embeddings: the head gathers the
             embedding unit again (a second use, with its own gather and reduce-scatter).
  backward   saved_tensors_hooks around the forward replace every saved tensor that lives in
             a gathered buffer by a token; unpacking a use's first token gathers the unit again
             (tag "bwd"). An embedding's backward reads no weight: never gathered in backward.
  gradients  each use is one autograd node (_GatherUnit) whose backward packs its gradients
             flat and reduce-scatters (avg, tag "grads") this rank's slice into unit.main_grad
             [S]; under no_sync it adds them to unit.pending [dp*S] instead.

Collectives per micro-batch over the dp group (one per use of a unit: L + 2 uses, +1 with tied
embeddings; S_u the shard, e bytes per element): all_gather "fwd" S_u * e; all_gather "bwd" S_u
* e (all but the embedding's); reduce_scatter "grads" dp * S_u * e on micro-batches that sync.
Per step the norm's all_reduce ("grad-norm"); no all-gather after the step. Memory at rest:
params and grads sum_u S_u * e each, AdamW 2 * real * e; in a step + the gathered units.
With TP a unit flattens this rank's TP shards; not with SP or PP (parallelize.validate_layout).

Megatron: megatron/core/distributed/fsdp/ (Megatron-FSDP).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..comm import all_gather_into_tensor, group_rank, group_size, reduce_scatter_tensor
from ..optim import Segment
from ..placement import Placement
from .buffer import Bucket, make_bucket
from .naive import DataParallel


@dataclass
class Unit(Bucket):
    """One sharded unit: a buffer.Bucket laid out like ZeRO's whose parameters the model no longer
    holds (`params` is empty). name: the plan's name. slots: (module, attribute) where each
    parameter is read. decay_numel: the first decay_numel elements take weight decay.
    shard [shard_numel]: nn.Parameter, this rank's slice (padding 0). pending [padded_numel] or
    None: local unreduced gradients accumulated under no_sync."""
    name: str = ""
    slots: list[tuple[nn.Module, str]] = field(default_factory=list)
    decay_numel: int = 0
    shard: nn.Parameter | None = None
    pending: torch.Tensor | None = None


@dataclass(frozen=True)
class UnitPlan:
    """How to cut a model: a unit's name, the parameter-name prefixes it owns, the module whose
    forward gathers it, whether it is freed when the wrapper's forward returns (instead of after
    that module's forward), and the other units its forward also reads (tied weights)."""
    name: str
    prefixes: tuple[str, ...]
    trigger: nn.Module
    free_at_end: bool = False
    borrows: tuple[str, ...] = ()


def gpt_unit_plan(model: nn.Module) -> list[UnitPlan]:
    """The units of a GPTModel (or pipeline stage): embedding, each layer, head."""
    plan = []
    if model.embedding is not None:
        plan.append(UnitPlan("embedding", ("embedding.",), model.embedding))
    for i, layer in model.decoder.layers.items():
        plan.append(UnitPlan(f"decoder.layers.{i}", (f"decoder.layers.{i}.",), layer))
    if model.decoder.final_layernorm is not None:
        tied = model.output_layer.weight is None
        plan.append(UnitPlan("head", ("decoder.final_layernorm.", "output_layer."), model.decoder.final_layernorm,
                             free_at_end=True, borrows=("embedding",) if tied else ()))
    return plan


def _build_unit(name: str, members: list[tuple[str, nn.Parameter]], model: nn.Module, group,
                grad_dtype: torch.dtype | None) -> Unit:
    """Flatten `members` (matrices first), keep this rank's slice, delete the model's parameters."""
    members = [m for m in members if m[1].dim() >= 2] + [m for m in members if m[1].dim() < 2]
    bucket = make_bucket(0, [p for _, p in members], group, group_size(group), group_rank(group),
                         grad_dtype=grad_dtype, hold_grads=False)
    flat = bucket.main_grad.new_zeros(bucket.padded_numel, dtype=members[0][1].dtype)
    slots = []
    for i, (pname, p) in enumerate(members):
        bucket.view(flat, i).copy_(p.detach())
        module_name, _, attr = pname.rpartition(".")
        module = model.get_submodule(module_name)
        del module._parameters[attr]               # the model keeps no full weight
        slots.append((module, attr))
    decay_numel = sum(p.numel() for _, p in members if p.dim() >= 2)
    return Unit(**{**vars(bucket), "params": []}, name=name, slots=slots, decay_numel=decay_numel,
                shard=nn.Parameter(flat[bucket.start:bucket.end].clone()))


def gather_unit_parameters(unit: Unit, group, tag: str = "fwd") -> list[torch.Tensor]:
    """All-gather one unit's full parameters from the shards of every rank of `group`.

    unit.shard [S] is this rank's slice of the unit's flat, zero-padded parameters [dp*S]
    (rank r holds elements [r S, (r+1) S); unit.padded_numel = dp * S).
    Returns one tensor per parameter of the unit, in unit order: parameter i is the elements
    [unit.offsets[i], unit.offsets[i] + unit.numels[i]) of the flat buffer, shaped unit.shapes[i].
    Communication: exactly one comm.all_gather_into_tensor of unit.shard over `group`, with
    `tag` (ledger: S * e bytes). Memory: the tensors are views of ONE new buffer of
    padded_numel elements, and nothing else keeps a reference to it: the buffer is freed as
    soon as the caller drops the views (that is the "free" of ZeRO-3).
    FullyShardedDataParallel calls it in each unit's forward pre-hook (tag "fwd") and when
    backward first needs the unit's weights again (tag "bwd").
    """
    # BEGIN EXERCISE 1.4: the ZeRO-3 gather of a unit | hint: how large must the one buffer be for every rank's shard to fit, and must the returned tensors be copies or views for dropping them to free it? (Megatron-FSDP: AllGatherPipeline)
    full = unit.shard.new_empty(unit.padded_numel)
    all_gather_into_tensor(full, unit.shard.detach(), group, tag=tag)
    return [full[o:o + n].view(shape) for o, n, shape in zip(unit.offsets, unit.numels, unit.shapes)]
    # END EXERCISE


@dataclass(eq=False)
class _UnitUse:
    """One gathering of a unit in one forward, alive until that use's backward has run."""
    unit: Unit
    fwd: list[torch.Tensor] | None = None   # the forward's gathered views
    bwd: list[torch.Tensor] | None = None   # gathered again for backward (on demand)


@dataclass(frozen=True)
class _Token:
    """What autograd saves instead of a gathered weight: which use, which tensor, what view."""
    use: _UnitUse
    index: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class _GatherUnit(torch.autograd.Function):
    """forward: gather a unit (its parameters as outputs); backward: reduce-scatter their grads."""

    @staticmethod
    def forward(ctx, shard, use, fsdp):
        ctx.use, ctx.fsdp = use, fsdp
        return tuple(gather_unit_parameters(use.unit, fsdp.group, "fwd"))

    @staticmethod
    def backward(ctx, *grads):
        ctx.fsdp._use_backward_done(ctx.use, grads)
        return None, None, None       # the gradient went to unit.main_grad, not to .grad


@dataclass
class MemoryEvent:
    """One point of FullyShardedDataParallel.memory_profile (chapter 01's make_figures.plot_memory_profile draws them)."""
    label: str          # e.g. "fwd gather decoder.layers.0"
    sharded: int        # bytes of this rank's parameter shards
    gathered: int       # bytes of gathered unit buffers alive at this moment


# Saved-tensor hooks nest: inside a FullyShardedDataParallel forward its own hooks (_pack) take
# the place of any outer ones, such as pp.timeline.StepRecord's, which counts the activations.
# An observer registered here sees every tensor the wrapper saves as it is (not the gathered
# weights it turns into tokens), as that outer hook would have.
_SAVED_OBSERVERS: list[Callable[[torch.Tensor], object]] = []


@contextmanager
def observe_saved_tensors(observer: Callable[[torch.Tensor], object]):
    """Inside, `observer(t)` sees each tensor a FullyShardedDataParallel forward saves for its
    backward and keeps (the activations; not the gathered weights it replaces by tokens)."""
    _SAVED_OBSERVERS.append(observer)
    try:
        yield
    finally:
        _SAVED_OBSERVERS.remove(observer)


class FullyShardedDataParallel(DataParallel):
    """ZeRO-3: parameters, gradients and optimizer state sharded over `group`.

    Same use as zero.ZeroDataParallel (forward, no_sync, finish_grad_sync) with an
    optim.Optimizer over its shards. gpt_unit_plan cuts the model; grad_dtype:
    the gradient shards' dtype (default the parameters', see buffer.py). After wrapping,
    the model's own parameters are gone: `wrapper.parameters()` are the shards, and
    `state_dict()` is this rank's shards; `local_tensors()` gathers the full weights.
    """

    def __init__(self, module: nn.Module, group, grad_dtype: torch.dtype | None = None):
        super().__init__(module, group)
        named = list(module.named_parameters())
        self.units: dict[str, Unit] = {}
        for p in gpt_unit_plan(module):
            members = [(n, q) for n, q in named if n.startswith(p.prefixes)]
            if members:
                self.units[p.name] = _build_unit(p.name, members, module, group, grad_dtype)
                p.trigger.register_forward_pre_hook(lambda m, a, p=p: self._gather_for(p))
                if not p.free_at_end:
                    p.trigger.register_forward_hook(lambda m, a, o, p=p: self._free_for(p.name))
        missing = sorted({n for n, _ in named} - {n for u in self.units.values() for n in u.names})
        if missing:
            raise ValueError(f"FullyShardedDataParallel: parameters in no unit: {missing[:5]}")
        self.shards = nn.ParameterList([u.shard for u in self.units.values()])
        self._open: dict[str, list[_UnitUse]] = {}       # plan name -> uses gathered for it
        self._live: dict[int, tuple[_UnitUse, int]] = {}  # storage address -> (use, output index)
        self._gathered: list[weakref.ref] = []           # gathered buffers, for the profile
        self._in_backward: list[_UnitUse] = []           # uses gathered again for backward
        self.profile: list[MemoryEvent] | None = None   # recording (memory_profile)
        self._settle = None

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return self.module(*args, **kwargs)
        finally:
            for name in list(self._open):          # the head, and anything an error left open
                self._free_for(name)

    def _gather_for(self, p: UnitPlan) -> None:
        uses = self._open.setdefault(p.name, [])
        for name in (p.name, *p.borrows):
            use = _UnitUse(self.units[name])
            use.fwd = list(_GatherUnit.apply(use.unit.shard, use, self))
            uses.append(use)
            for (module, attr), t in zip(use.unit.slots, use.fwd):
                setattr(module, attr, t)                # the model reads the gathered views
            for i, t in enumerate(use.fwd):
                self._live[t.untyped_storage().data_ptr()] = (use, i)
            self._track(use.fwd)
            self._event(f"fwd gather {name}")

    def _free_for(self, plan_name: str) -> None:
        uses = self._open.get(plan_name, [])
        while uses:
            use = uses.pop(0)
            for module, attr in use.unit.slots:       # using them now raises AttributeError
                module.__dict__.pop(attr, None)
            # (a comprehension: a loop variable would keep the last view, and the buffer, alive)
            for address in {t.untyped_storage().data_ptr() for t in use.fwd}:
                self._live.pop(address, None)
            use.fwd = None
            self._event(f"fwd free {use.unit.name}")
        self._open.pop(plan_name, None)

    # ---- what autograd saves: tokens instead of gathered weights ---------------------------
    def _pack(self, t: torch.Tensor):
        hit = self._live.get(t.untyped_storage().data_ptr())
        if hit is None:
            for observe in _SAVED_OBSERVERS:         # what an outer hook would have seen (it is shadowed)
                observe(t)
            return t
        return _Token(hit[0], hit[1], t.size(), t.stride(), t.storage_offset())

    def _unpack(self, saved):
        if not isinstance(saved, _Token):
            return saved
        use = saved.use
        if use.bwd is None:                          # first weight this use's backward needs
            use.bwd = gather_unit_parameters(use.unit, self.group, "bwd")
            self._in_backward.append(use)
            self._track(use.bwd)
            self._event(f"bwd gather {use.unit.name}")
        return use.bwd[saved.index].as_strided(saved.size, saved.stride, saved.offset)

    def _use_backward_done(self, use: _UnitUse, grads) -> None:
        """All of this use's weights have their gradients: free, then reduce-scatter."""
        if use.bwd is not None:
            use.bwd = None
            self._in_backward.remove(use)
            self._event(f"bwd free {use.unit.name}")
        unit = use.unit
        flat = unit.main_grad.new_zeros(unit.padded_numel)
        for g, off, n in zip(grads, unit.offsets, unit.numels):
            if g is not None:
                flat[off:off + n] = g.reshape(-1)
        if not self.syncing:
            unit.pending = flat if unit.pending is None else unit.pending.add_(flat)
            return
        self._reduce(unit, flat)

    def _reduce(self, unit: Unit, flat: torch.Tensor) -> None:
        if unit.pending is not None:
            flat += unit.pending
            unit.pending = None
        mine = flat[unit.start:unit.end]
        reduce_scatter_tensor(mine, flat, self.group, op="avg", tag="grads")
        unit.main_grad.add_(mine)

    def finish_grad_sync(self) -> None:
        """Gradients were reduce-scattered during backward; reduce what no_sync left pending."""
        self.check_can_sync()
        for unit in self.units.values():
            if unit.pending is not None:
                self._reduce(unit, torch.zeros_like(unit.pending))

    # ---- what the optimizer asks of a wrapper ----------------------------------------------
    def optimizer_segments(self) -> list[Segment]:
        """This rank's shard of each unit, cut at the decay / no-decay boundary, padding excluded."""
        segments = []
        for u in self.units.values():
            for lo, hi, decay in ((0, u.decay_numel, True), (u.decay_numel, u.numel, False)):
                a, b = max(lo, u.start) - u.start, min(hi, u.end) - u.start
                if a < b:
                    segments.append(Segment(u.shard.detach()[a:b], lambda u=u, a=a, b=b: u.main_grad[a:b], decay,
                                            u.shard_owners(a, b), u.shard_locations(a, b)))
        return segments

    def zero_grad(self, set_to_none: bool = True) -> None:
        for u in self.units.values():
            u.main_grad.zero_()
            u.pending = None

    # ---- inspection (tests, demos, export): collective, tag "inspect" ----------------------
    def local_tensors(self, grads: bool = False) -> dict[str, tuple[Placement, torch.Tensor]]:
        """The parameters (or averaged gradients) by single-device name, each unit gathered from
        every rank's shard (one all-gather per unit, tag "inspect")."""
        out = {}
        for u in self.units.values():
            out.update(u.gathered(u.main_grad if grads else u.shard, self.group))
        return out

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        gathered = [r() for r in self._gathered if r() is not None]
        return {"params": [u.shard for u in self.units.values()] + gathered,
                "grads": [u.main_grad for u in self.units.values()]
                + [u.pending for u in self.units.values() if u.pending is not None]}

    # ---- the memory profile: a record at every gather and free ------------------------------
    @contextmanager
    def memory_profile(self, settle: Callable[[Callable[[], bool]], object] | None = None):
        """`with wrapper.memory_profile() as events:` records a MemoryEvent at every gather and free;
        gathered bytes are the buffers still referenced anywhere. gloo lets go of a finished
        collective's tensors a moment after wait(), so `settle(released)`, if given, is called before
        each measurement and may wait for `released()` (e.g. testing.wait_until: a real leak survives)."""
        self.profile, self._settle = [], settle
        try:
            yield self.profile
        finally:
            self.profile, self._settle = None, None

    def _track(self, tensors) -> None:
        self._gathered = [r for r in self._gathered if r() is not None]
        self._gathered += [weakref.ref(t._base if t._base is not None else t) for t in tensors]

    def _held(self) -> set[int]:
        """Storage addresses of the gathered buffers this wrapper still uses."""
        views = [t for uses in self._open.values() for u in uses for t in u.fwd]
        views += [t for u in self._in_backward for t in u.bwd]
        return {t.untyped_storage().data_ptr() for t in views}

    def _alive(self) -> dict[int, int]:
        """Storage address -> bytes of every gathered buffer still referenced anywhere."""
        storages = [t.untyped_storage() for t in (r() for r in self._gathered) if t is not None]
        return {s.data_ptr(): s.nbytes() for s in storages}

    def released(self) -> bool:
        """True when every gathered buffer still alive is one this wrapper still uses."""
        return set(self._alive()) <= self._held()

    def _event(self, label: str) -> None:
        if self.profile is None:
            return
        if self._settle is not None:
            self._settle(self.released)
        sharded = sum(u.shard.untyped_storage().nbytes() for u in self.units.values())
        self.profile.append(MemoryEvent(label, sharded, sum(self._alive().values())))


__all__ = ["Unit", "gpt_unit_plan", "gather_unit_parameters", "FullyShardedDataParallel", "MemoryEvent",
           "observe_saved_tensors"]
