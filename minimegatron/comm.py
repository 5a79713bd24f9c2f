"""The communication ledger: every collective of the book, explicit and counted.

Every byte that crosses between ranks in minimegatron goes through a function of this module.
The process group is always an argument, so the reader sees at each call site *who* talks,
and each call is written into every active :class:`Ledger`, so a chapter can put the
measured traffic next to its formula::

    with record_communication() as ledger:
        loss = model(batch); loss.backward()
    print(ledger.table())

What a record counts (``CommRecord.nbytes``): the bytes this rank hands to the collective,
``numel * element_size`` of its input tensor:

    ==================  ==================================================================
    all_reduce          the tensor (every rank hands its full copy)
    all_gather          this rank's shard (its input, not the gathered output); padded
                        size for uneven gathers, because that is what is sent
    reduce_scatter      the full input (all n chunks), not the chunk received
    broadcast           the tensor, on every rank (source or not)
    all_to_all          the full input (all n chunks, including the one kept locally)
    send / recv         the tensor sent / the buffer received into
    barrier             0
    ==================  ==================================================================

This is a count of *what was asked*, not of what an algorithm puts on the wire. The second
is a property of the algorithm; :func:`ring_traffic` gives it for the textbook ring
algorithms (e.g. a ring all-reduce sends ``2 (n-1)/n * nbytes`` per rank).

Conventions:
  * Records are local to the rank (each process has its own ledgers).
  * A group with a single member (or no process group initialised at all, as in the
    single-device baseline) short-circuits: nothing is communicated and **nothing is
    recorded**, so a ledger only ever shows real traffic.
  * Groups: ``None`` means the whole world (prefer passing the group from parallel_state).
    Ranks named in ``src``/``dst``/``peer`` are *global* ranks, as in torch.distributed.
  * float8 tensors travel as ``t.view(torch.uint8)`` (gloo has no fp8; exact). They cannot
    be reduced: upcast first.
  * Recording happens when a call is issued, also for ``async_op=True``.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

# torch 2.13 renamed the "tensor" flavours of these two collectives; older torch lacks the new names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_FP8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                    "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n)}
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG,
               "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

# ======================================================================================
# The ledger
# ======================================================================================


@dataclass(frozen=True)
class CommRecord:
    """One collective call as seen by this rank (see the module docstring for ``nbytes``)."""
    op: str                       # "all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                  # "all_to_all", "send", "recv", "barrier"
    group_ranks: tuple[int, ...]  # global ranks of the group, in group order
    nbytes: int
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    tag: str | None = None        # a label for reading the ledger ("fwd", "bwd", "grads", ...)

    @property
    def group_size(self) -> int:
        return len(self.group_ranks)


def ring_traffic(record: CommRecord) -> float:
    """Bytes one rank sends when ``record``'s op runs as a textbook ring over n ranks.

    all_reduce 2(n-1)/n * nbytes (reduce-scatter then all-gather); all_gather (n-1) * nbytes
    (nbytes is the shard); reduce_scatter and all_to_all (n-1)/n * nbytes (nbytes is the
    full input); broadcast (n-1)/n * nbytes (a pipelined chain: n-1 of the n ranks forward
    the tensor, averaged over ranks); send nbytes; recv and barrier 0.
    """
    n, b = record.group_size, record.nbytes
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1,
              "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n,
              "broadcast": (n - 1) / n, "send": 1, "recv": 0, "barrier": 0}
    return factor[record.op] * b


class OpSummary(NamedTuple):
    count: int
    nbytes: int
    ring_bytes: float


class Ledger:
    """The records of one ``record_communication()`` block, in call order, with summaries.

    Filters: ``op`` (a name), ``group`` (a ProcessGroup or a sequence of global ranks;
    ``None`` = any group) and ``tag``.
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self):
        return iter(list(self.records))

    def select(self, op=None, group=None, tag=None) -> list[CommRecord]:
        ranks = None if group is None else (
            tuple(group) if isinstance(group, Sequence) else group_ranks(group))
        return [r for r in self.records
                if (op is None or r.op == op) and (ranks is None or r.group_ranks == ranks)
                and (tag is None or r.tag == tag)]

    def total_bytes(self, op=None, group=None, tag=None) -> int:
        return sum(r.nbytes for r in self.select(op, group, tag))

    def count(self, op=None, group=None, tag=None) -> int:
        return len(self.select(op, group, tag))

    def ring_bytes(self, op=None, group=None, tag=None) -> float:
        return sum(ring_traffic(r) for r in self.select(op, group, tag))

    def by_op(self) -> dict[str, OpSummary]:
        """``{op: OpSummary(count, nbytes, ring_bytes)}`` in order of first use."""
        out: dict[str, OpSummary] = {}
        for r in self.records:
            c, b, rb = out.get(r.op, (0, 0, 0.0))
            out[r.op] = OpSummary(c + 1, b + r.nbytes, rb + ring_traffic(r))
        return out

    def table(self) -> str:
        """One row per (op, group, tag): calls, bytes handed in, ring bytes sent per rank."""
        rows: dict[tuple, list] = defaultdict(lambda: [0, 0, 0.0])
        for r in self.records:
            row = rows[(r.op, r.group_ranks, r.tag or "")]
            row[0] += 1
            row[1] += r.nbytes
            row[2] += ring_traffic(r)
        head = f"{'op':<15}{'group':<18}{'tag':<8}{'calls':>6}{'bytes':>14}{'ring bytes':>14}"
        lines = [head, "-" * len(head)]
        for (op, ranks, tag), (c, b, rb) in rows.items():
            group = str(list(ranks)) if len(ranks) <= 6 else f"[{ranks[0]}..{ranks[-1]}]({len(ranks)})"
            lines.append(f"{op:<15}{group:<18}{tag:<8}{c:>6}{b:>14,}{rb:>14,.0f}")
        lines.append("-" * len(head))
        lines.append(f"{'total':<41}{len(self):>6}{self.total_bytes():>14,}"
                     f"{self.ring_bytes():>14,.0f}")
        return "\n".join(lines)

    __str__ = table


_active: list[Ledger] = []
_lock = threading.Lock()  # async work and hooks may record from other threads


@contextmanager
def record_communication():
    """``with record_communication() as ledger:`` records every call issued in the block.

    Blocks nest: a call is recorded in every ledger that is open at that moment.
    """
    ledger = Ledger()
    with _lock:
        _active.append(ledger)
    try:
        yield ledger
    finally:
        with _lock:
            _active.remove(ledger)


def _record(op: str, group, t: torch.Tensor | None, tag: str | None, nbytes=None) -> None:
    if not _active:
        return
    rec = CommRecord(op, group_ranks(group),
                     nbytes if nbytes is not None else t.numel() * t.element_size(),
                     None if t is None else t.dtype, () if t is None else tuple(t.shape), tag)
    with _lock:
        for ledger in _active:
            ledger.records.append(rec)


# ======================================================================================
# Groups and small helpers
# ======================================================================================

def group_ranks(group) -> tuple[int, ...]:
    """Global ranks of ``group`` (None = world), in group order; (0,) without a process group."""
    if not dist.is_initialized():
        return (0,)
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group) -> int:
    """This rank's index inside ``group`` (what decides which shard it keeps)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


class _Done:
    """What an ``async_op=True`` call returns when there was nothing to communicate."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _wire(t: torch.Tensor) -> torch.Tensor:
    """The tensor gloo actually moves: fp8 reinterpreted as bytes (same storage)."""
    return t.view(torch.uint8) if t.dtype in _FP8 else t


def _reduce_op(op: str, t: torch.Tensor):
    if t.dtype in _FP8:
        raise TypeError(f"cannot reduce a {t.dtype} tensor (gloo has no fp8 arithmetic): "
                        "upcast it first, e.g. t.float()")
    if op not in _REDUCE_OPS:
        raise ValueError(f"op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
    return _REDUCE_OPS[op]


def _check_buffer(t: torch.Tensor, what: str) -> None:
    # results are written into this tensor's memory: a non-contiguous view cannot take them
    if not t.is_contiguous():
        raise ValueError(f"{what}: the tensor written into must be contiguous; "
                         "call .contiguous() and copy the result back")


# ======================================================================================
# Plain collectives
# ======================================================================================

def all_reduce(t, group, op="sum", tag=None, async_op=False):
    """In place: ``t`` becomes the reduction (sum, avg, max or min) of every member's ``t``.

    Same shape on every member. Records "all_reduce", nbytes = t. Returns ``t``, or a work
    handle to ``wait()`` on when ``async_op``.
    """
    _check_buffer(t, "all_reduce")
    reduce_op = _reduce_op(op, t)
    if group_size(group) == 1:
        return _Done() if async_op else t
    _record("all_reduce", group, t, tag)
    work = dist.all_reduce(t, op=reduce_op, group=group, async_op=async_op)
    return work if async_op else t


def all_gather_into_tensor(out, t, group, tag=None, async_op=False):
    """``out`` (n * t.shape[0], *t.shape[1:]) receives every member's ``t``, in group order.

    Records "all_gather", nbytes = t (the local shard). Returns ``out`` (or a work handle).
    """
    _check_buffer(out, "all_gather_into_tensor")
    n = group_size(group)
    if out.numel() != n * t.numel():
        raise ValueError(f"all_gather_into_tensor: out has {out.numel()} elements, expected "
                         f"{n} x {t.numel()} (group size x input)")
    if n == 1:
        out.copy_(t.reshape(out.shape))
        return _Done() if async_op else out
    _record("all_gather", group, t, tag)
    work = _all_gather_single(_wire(out), _wire(t.contiguous()), group=group, async_op=async_op)
    return work if async_op else out


def all_gather(t, group, dim=0, sizes=None, tag=None):
    """Concatenate every member's ``t`` along ``dim``, in group order: a new tensor.

    ``sizes``: each member's ``t.shape[dim]`` when they differ (gloo gathers equal sizes
    only, so each shard is padded to the largest, gathered, and the padding cut off; the
    record counts the padded shard). Find the sizes with an explicit, counted call:
    ``sizes = all_gather(torch.tensor([t.shape[dim]]), group).tolist()``.
    With one member, returns ``t`` itself.
    """
    n = group_size(group)
    if n == 1:
        return t
    shard = t.movedim(dim, 0)  # gather along dim 0, where every shard is one contiguous block
    if sizes is None or len(set(sizes)) == 1:
        shard = shard.contiguous()
        out = shard.new_empty((n * shard.shape[0], *shard.shape[1:]))
        all_gather_into_tensor(out, shard, group, tag)
        return out.movedim(0, dim).contiguous()
    sizes = [int(s) for s in sizes]
    if len(sizes) != n or sizes[group_rank(group)] != shard.shape[0]:
        raise ValueError(f"all_gather: sizes={sizes} must list the {n} members' sizes along "
                         f"dim {dim}; this member has {shard.shape[0]}")
    largest = max(sizes)
    padded = shard.new_zeros((largest, *shard.shape[1:]))
    padded[: shard.shape[0]] = shard
    out = padded.new_empty((n * largest, *shard.shape[1:]))
    all_gather_into_tensor(out, padded, group, tag)
    pieces = [out[i * largest: i * largest + s] for i, s in enumerate(sizes)]
    return torch.cat(pieces).movedim(0, dim).contiguous()


def reduce_scatter_tensor(out, t, group, op="sum", tag=None, async_op=False):
    """Reduce ``t`` (n * out.shape[0], ...) over the group; ``out`` gets chunk ``group_rank``.

    Records "reduce_scatter", nbytes = t (the full input). Returns ``out`` (or a work handle).
    """
    _check_buffer(out, "reduce_scatter_tensor")
    reduce_op = _reduce_op(op, t)
    n = group_size(group)
    if t.numel() != n * out.numel():
        raise ValueError(f"reduce_scatter_tensor: input has {t.numel()} elements, expected "
                         f"{n} x {out.numel()} (group size x out)")
    if n == 1:
        out.copy_(t.reshape(out.shape))
        return _Done() if async_op else out
    _record("reduce_scatter", group, t, tag)
    work = _reduce_scatter_single(out, t.contiguous(), op=reduce_op, group=group,
                                  async_op=async_op)
    return work if async_op else out


def reduce_scatter(t, group, dim=0, op="sum", tag=None):
    """Reduce ``t`` over the group and return this member's chunk along ``dim`` (a new tensor).

    ``t.shape[dim]`` must be divisible by the group size. With one member, returns ``t``.
    """
    n = group_size(group)
    if n == 1:
        return t
    if t.shape[dim] % n:
        raise ValueError(f"reduce_scatter: size {t.shape[dim]} along dim {dim} is not "
                         f"divisible by the group size {n}")
    full = t.movedim(dim, 0).contiguous()
    out = full.new_empty((full.shape[0] // n, *full.shape[1:]))
    reduce_scatter_tensor(out, full, group, op, tag)
    return out.movedim(0, dim).contiguous()


def broadcast(t, src, group, tag=None, async_op=False):
    """In place: every member's ``t`` becomes global rank ``src``'s ``t``. Records "broadcast"."""
    _check_buffer(t, "broadcast")
    ranks = group_ranks(group)
    if src not in ranks:
        raise ValueError(f"broadcast: src={src} is a global rank and must be in the group {ranks}")
    if len(ranks) == 1:
        return _Done() if async_op else t
    _record("broadcast", group, t, tag)
    work = dist.broadcast(_wire(t), src=src, group=group, async_op=async_op)
    return work if async_op else t


def send(t, dst, group=None, tag=None):
    """Send ``t`` to global rank ``dst`` (blocks until handed off). Records "send"."""
    _record("send", group, t, tag)
    dist.send(_wire(t.contiguous()), dst=dst, group=group)


def recv(t, src, group=None, tag=None):
    """Receive into ``t`` from global rank ``src``. Records "recv". Returns ``t``."""
    _check_buffer(t, "recv")
    _record("recv", group, t, tag)
    dist.recv(_wire(t), src=src, group=group)
    return t


def isend(t, dst, group=None, tag=None):
    """Start sending ``t`` to ``dst``; returns a work handle. Do not modify ``t`` until waited."""
    _record("send", group, t, tag)
    return dist.isend(_wire(t.contiguous()), dst=dst, group=group)


def irecv(t, src, group=None, tag=None):
    """Start receiving into ``t`` from ``src``; returns a work handle (``t`` valid after wait)."""
    _check_buffer(t, "irecv")
    _record("recv", group, t, tag)
    return dist.irecv(_wire(t), src=src, group=group)


@dataclass
class P2POp:
    """One send or receive of a ``batch_isend_irecv`` batch (``peer`` is a global rank)."""
    kind: str                  # "send" or "recv"
    tensor: torch.Tensor
    peer: int
    group: object = None


def batch_isend_irecv(ops, tag=None):
    """Start all sends and receives of ``ops`` together; returns their work handles.

    Posting them as one batch is what lets two pipeline stages exchange activations and
    gradients in both directions without deadlocking. ``ops`` are :class:`P2POp` or
    ``torch.distributed.P2POp`` (with ``dist.isend``/``dist.irecv``). One record per op.
    """
    torch_ops = []
    for op in ops:
        if isinstance(op, dist.P2POp):
            kind = "send" if op.op in (dist.isend, dist.send) else "recv"
            op = P2POp(kind, op.tensor, op.peer, op.group)
        if op.kind not in ("send", "recv"):
            raise ValueError(f"P2POp.kind must be 'send' or 'recv', got {op.kind!r}")
        if op.kind == "recv":
            _check_buffer(op.tensor, "batch_isend_irecv (recv)")
        tensor = op.tensor.contiguous() if op.kind == "send" else op.tensor
        _record(op.kind, op.group, op.tensor, tag)
        fn = dist.isend if op.kind == "send" else dist.irecv
        torch_ops.append(dist.P2POp(fn, _wire(tensor), op.peer, op.group))
    return dist.batch_isend_irecv(torch_ops) if torch_ops else []


def all_to_all_single(out, t, group, in_splits=None, out_splits=None, tag=None, async_op=False):
    """Member i sends block j of ``t`` (dim 0) to member j, which stores it as its block i.

    Blocks are equal unless ``in_splits`` (sizes of the blocks of ``t``) and ``out_splits``
    (sizes of the blocks of ``out``) are given. Records "all_to_all", nbytes = t.
    """
    _check_buffer(out, "all_to_all_single")
    if group_size(group) == 1:
        out.copy_(t)
        return _Done() if async_op else out
    _record("all_to_all", group, t, tag)
    work = dist.all_to_all_single(_wire(out), _wire(t.contiguous()), output_split_sizes=out_splits,
                                  input_split_sizes=in_splits, group=group, async_op=async_op)
    return work if async_op else out


def all_to_all(t, group, scatter_dim, gather_dim, tag=None):
    """Cut ``t`` into n chunks along ``scatter_dim``, send chunk j to member j, and
    concatenate the chunks received, in group order, along ``gather_dim`` (a new tensor)."""
    n = group_size(group)
    if n == 1:
        return t
    if t.shape[scatter_dim] % n:
        raise ValueError(f"all_to_all: size {t.shape[scatter_dim]} along dim {scatter_dim} is "
                         f"not divisible by the group size {n}")
    outgoing = torch.stack(t.chunk(n, dim=scatter_dim))  # (n, *chunk): row j goes to member j
    incoming = torch.empty_like(outgoing)
    all_to_all_single(incoming, outgoing, group, tag=tag)
    return torch.cat(incoming.unbind(0), dim=gather_dim)


def barrier(group, tag=None):
    """Wait until every member arrives. Records "barrier" with 0 bytes."""
    if group_size(group) == 1:
        return
    _record("barrier", group, None, tag, nbytes=0)
    dist.barrier(group=group)


# ======================================================================================
# Autograd-aware regions (Megatron's tensor-parallel "mappings")
# ======================================================================================
# Each operator runs a collective forward and its adjoint backward: if the forward computes
# y = A x across the group, the backward computes dx = A^T dy. Hence the pairs
#
#     operator                   forward          backward
#     copy_to_region             identity         all-reduce (sum)
#     reduce_from_region         all-reduce       identity
#     scatter_to_region          split            all-gather
#     gather_from_region         all-gather       split
#     reduce_scatter_to_region   reduce-scatter   all-gather
#     gather_to_region           all-gather       reduce-scatter
#     all_to_all_region          all-to-all       the inverse all-to-all
#
# Forward calls are recorded with tag "fwd", backward calls with tag "bwd".

def _identity(x, group, tag):
    return x


def _sum(x, group, tag):
    # all_reduce works in place: never overwrite a tensor that autograd or the caller holds
    return all_reduce(x.clone(memory_format=torch.contiguous_format), group, tag=tag)


def _split(x, group, dim, tag):
    """This member's chunk of ``x`` along ``dim`` (no communication)."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"cannot split size {x.shape[dim]} along dim {dim} into {n} equal parts")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def _gather(x, group, dim, tag):
    return all_gather(x, group, dim, tag=tag)


def _reduce_scatter(x, group, dim, tag):
    return reduce_scatter(x, group, dim, tag=tag)


def _all_to_all(x, group, scatter_dim, gather_dim, tag):
    return all_to_all(x, group, scatter_dim, gather_dim, tag=tag)


def _inverse_all_to_all(x, group, scatter_dim, gather_dim, tag):
    return all_to_all(x, group, gather_dim, scatter_dim, tag=tag)


def _region(name, forward, backward):
    """An autograd Function computing ``forward(x, group, *dims)``; its backward computes
    ``backward(grad, group, *dims)``."""

    def fwd(ctx, x, group, *dims):
        ctx.group, ctx.dims = group, dims
        return forward(x, group, *dims, tag="fwd")

    def bwd(ctx, grad):
        # one gradient per forward input: x, then None for the group and for each dim
        return (backward(grad, ctx.group, *ctx.dims, tag="bwd"), None) + (None,) * len(ctx.dims)

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_CopyToRegion = _region("_CopyToRegion", _identity, _sum)
_ReduceFromRegion = _region("_ReduceFromRegion", _sum, _identity)
_ScatterToRegion = _region("_ScatterToRegion", _split, _gather)
_GatherFromRegion = _region("_GatherFromRegion", _gather, _split)
_ReduceScatterToRegion = _region("_ReduceScatterToRegion", _reduce_scatter, _gather)
_GatherToRegion = _region("_GatherToRegion", _gather, _reduce_scatter)
_AllToAllRegion = _region("_AllToAllRegion", _all_to_all, _inverse_all_to_all)


def copy_to_region(x, group):
    """Megatron's f: forward identity; backward all-reduce (sum) of the gradient.

    Enters a region where each member uses the same ``x`` for a different part of the work
    (a column-parallel linear): ``x``'s gradient is the sum of every member's contribution.
    """
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x, group):
    """Megatron's g: forward all-reduce (sum) of the members' partial results; backward
    identity. Leaves a region whose members each hold a partial sum (a row-parallel linear)."""
    return _ReduceFromRegion.apply(x, group)


def scatter_to_region(x, group, dim=-1):
    """Forward: keep this member's chunk of ``x`` along ``dim`` (no communication);
    backward: all-gather the chunks' gradients along ``dim``."""
    return _ScatterToRegion.apply(x, group, dim)


def gather_from_region(x, group, dim=-1):
    """Forward: all-gather along ``dim``; backward: keep this member's chunk of the gradient.
    For an output every member then uses identically (each holds the full gradient)."""
    return _GatherFromRegion.apply(x, group, dim)


def reduce_scatter_to_region(x, group, dim=0):
    """Sequence parallelism, leaving a tensor-parallel region: forward reduce-scatter
    along ``dim`` (the sequence); backward all-gather of the gradient along ``dim``."""
    return _ReduceScatterToRegion.apply(x, group, dim)


def gather_to_region(x, group, dim=0):
    """Sequence parallelism, entering a tensor-parallel region: forward all-gather along
    ``dim``; backward reduce-scatter, because each member's gradient for the full tensor
    is only a partial sum (each member computed with its own shard of the weights)."""
    return _GatherToRegion.apply(x, group, dim)


def all_to_all_region(x, group, scatter_dim, gather_dim):
    """Forward :func:`all_to_all` (scatter ``scatter_dim``, gather ``gather_dim``); backward
    the inverse all-to-all (scatter ``gather_dim``, gather ``scatter_dim``). Ulysses swaps
    sequence shards for head shards this way; MoE sends tokens to their experts."""
    return _AllToAllRegion.apply(x, group, scatter_dim, gather_dim)
