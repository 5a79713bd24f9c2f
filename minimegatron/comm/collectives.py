"""The plain collectives: thin, counted wrappers over torch.distributed (see comm/__init__.py)."""

from __future__ import annotations

import functools
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .ledger import CommRecord, append_record, group_rank, group_ranks, group_size

# torch 2.13 renamed the "tensor" flavours of these two collectives; older torch lacks the new names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_FP8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                    "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n)}
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG,
               "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


# ======================================================================================
# Groups and small helpers
# ======================================================================================

class _Done:
    """What an ``async_op=True`` call returns when there was nothing to communicate."""

    def wait(self, timeout=None) -> bool:
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


def _size_checked(group, what: str, whole: torch.Tensor, whole_name: str, part: torch.Tensor, part_name: str) -> int:
    """The group size n, after refusing unless whole holds n x part's elements."""
    n = group_size(group)
    if whole.numel() != n * part.numel():
        raise ValueError(f"{what}: {whole_name} has {whole.numel()} elements, expected "
                         f"{n} x {part.numel()} (group size x {part_name})")
    return n


def _check_divisible(what: str, t: torch.Tensor, dim: int, n: int) -> None:
    if t.shape[dim] % n:
        raise ValueError(f"{what}: size {t.shape[dim]} along dim {dim} is not divisible by the group size {n}")


def _check_buffer(t: torch.Tensor, what: str) -> None:
    # results are written into this tensor's memory: a non-contiguous view cannot take them
    if not t.is_contiguous():
        raise ValueError(f"{what}: the tensor written into must be contiguous; "
                         "call .contiguous() and copy the result back")


_COLLECTIVES: dict[str, object] = {}      # name -> the plain function, for compile_barriers
_OUTSIDE_GRAPHS: dict[str, object] = {}   # name -> its compiler-disabled version (compile_barriers)


def _eager(collective):
    """Run a collective eagerly also inside a torch.compile region: traced, the call goes to the
    compiler-disabled version compile_barriers() made (a graph break), so the ledger records it in
    Python. Eagerly one flag test; importing comm does not import torch._dynamo."""
    name = collective.__name__
    _COLLECTIVES[name] = collective

    @functools.wraps(collective)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            if name not in _OUTSIDE_GRAPHS:
                raise RuntimeError(f"comm.{name} traced by torch.compile: call comm.compile_barriers() before "
                                   f"compiling code that communicates (kernels.apply_kernels does)")
            return _OUTSIDE_GRAPHS[name](*args, **kwargs)
        return collective(*args, **kwargs)
    return call


def compile_barriers() -> None:
    """Make every collective a graph break for torch.compile (see _eager): call it before
    compiling code that communicates. Imports torch._dynamo; idempotent."""
    for name, collective in _COLLECTIVES.items():
        if name not in _OUTSIDE_GRAPHS:
            _OUTSIDE_GRAPHS[name] = torch.compiler.disable(collective)


def _record(op: str, group, t: torch.Tensor | None, tag: str | None, nbytes=None) -> None:
    append_record(CommRecord(op, group_ranks(group), t.nbytes if nbytes is None else nbytes,
                             None if t is None else t.dtype, () if t is None else tuple(t.shape), tag))


# ======================================================================================
# Plain collectives
# ======================================================================================

@_eager
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


@_eager
def all_gather_into_tensor(out, t, group, tag=None, async_op=False):
    """``out`` (n * t.shape[0], *t.shape[1:]) receives every member's ``t``, in group order.

    Records "all_gather", nbytes = t (the local shard). Returns ``out`` (or a work handle).
    """
    _check_buffer(out, "all_gather_into_tensor")
    n = _size_checked(group, "all_gather_into_tensor", out, "out", t, "input")
    if n == 1:
        out.copy_(t.reshape(out.shape))
        return _Done() if async_op else out
    _record("all_gather", group, t, tag)
    work = _all_gather_single(_wire(out), _wire(t.contiguous()), group=group, async_op=async_op)
    return work if async_op else out


@_eager
def all_gather(t, group, dim=0, sizes=None, tag=None):
    """Concatenate every member's ``t`` along ``dim``, in group order: a new tensor (``t`` itself
    with one member). ``sizes``: each member's ``t.shape[dim]`` when they differ (padded to the
    largest for gloo, padding cut off; the record counts the padded shard), e.g. from
    ``all_gather(torch.tensor([t.shape[dim]]), group).tolist()``."""
    n = group_size(group)
    if n == 1:
        return t
    shard = t.movedim(dim, 0).contiguous()  # gather along dim 0, where every shard is one contiguous block
    sizes = [shard.shape[0]] * n if sizes is None else [int(s) for s in sizes]
    if len(sizes) != n or sizes[group_rank(group)] != shard.shape[0]:
        raise ValueError(f"all_gather: sizes={sizes} must list the {n} members' sizes along "
                         f"dim {dim}; this member has {shard.shape[0]}")
    largest = max(sizes)
    if shard.shape[0] < largest:                                 # gloo gathers equal shards: pad with zeros
        shard = torch.cat([shard, shard.new_zeros((largest - shard.shape[0], *shard.shape[1:]))])
    out = shard.new_empty((n * largest, *shard.shape[1:]))
    all_gather_into_tensor(out, shard, group, tag)
    if len(set(sizes)) > 1:                                      # cut the padding off
        out = torch.cat([out[i * largest: i * largest + s] for i, s in enumerate(sizes)])
    return out.movedim(0, dim).contiguous()


@_eager
def reduce_scatter_tensor(out, t, group, op="sum", tag=None, async_op=False):
    """Reduce ``t`` (n * out.shape[0], ...) over the group; ``out`` gets chunk ``group_rank``.

    Records "reduce_scatter", nbytes = t (the full input). Returns ``out`` (or a work handle).
    """
    _check_buffer(out, "reduce_scatter_tensor")
    reduce_op = _reduce_op(op, t)
    n = _size_checked(group, "reduce_scatter_tensor", t, "input", out, "out")
    if n == 1:
        out.copy_(t.reshape(out.shape))
        return _Done() if async_op else out
    _record("reduce_scatter", group, t, tag)
    work = _reduce_scatter_single(out, t.contiguous(), op=reduce_op, group=group, async_op=async_op)
    return work if async_op else out


@_eager
def reduce_scatter(t, group, dim=0, op="sum", tag=None):
    """Reduce ``t`` over the group and return this member's chunk along ``dim`` (a new tensor).

    ``t.shape[dim]`` must be divisible by the group size. With one member, returns ``t``.
    """
    n = group_size(group)
    if n == 1:
        return t
    _check_divisible("reduce_scatter", t, dim, n)
    full = t.movedim(dim, 0).contiguous()
    out = full.new_empty((full.shape[0] // n, *full.shape[1:]))
    reduce_scatter_tensor(out, full, group, op, tag)
    return out.movedim(0, dim).contiguous()


@_eager
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


@_eager
def send(t, dst, group=None, tag=None, p2p_tag=0):
    """Send ``t`` to global rank ``dst`` (blocks until handed off). Records "send".
    ``tag`` labels the ledger record; ``p2p_tag`` is the message tag the receiver must name
    (messages between two ranks match by tag, in order within one tag)."""
    _record("send", group, t, tag)
    dist.send(_wire(t.contiguous()), dst=dst, group=group, tag=p2p_tag)


@_eager
def recv(t, src, group=None, tag=None, p2p_tag=0):
    """Receive into ``t`` from global rank ``src`` the message tagged ``p2p_tag``. Records
    "recv". Returns ``t``."""
    _check_buffer(t, "recv")
    _record("recv", group, t, tag)
    dist.recv(_wire(t), src=src, group=group, tag=p2p_tag)
    return t


@_eager
def isend(t, dst, group=None, tag=None, p2p_tag=0):
    """Start sending ``t`` to ``dst``; returns a work handle. Do not modify ``t`` until waited."""
    _record("send", group, t, tag)
    return dist.isend(_wire(t.contiguous()), dst=dst, group=group, tag=p2p_tag)


@_eager
def irecv(t, src, group=None, tag=None, p2p_tag=0):
    """Start receiving into ``t`` from ``src``; returns a work handle (``t`` valid after wait)."""
    _check_buffer(t, "irecv")
    _record("recv", group, t, tag)
    return dist.irecv(_wire(t), src=src, group=group, tag=p2p_tag)


@dataclass
class P2POp:
    """One send or receive of a ``batch_isend_irecv`` batch (``peer`` is a global rank)."""
    kind: str                  # "send" or "recv"
    tensor: torch.Tensor
    peer: int
    group: object = None


@_eager
def batch_isend_irecv(ops, tag=None):
    """Start all sends and receives of ``ops`` (:class:`P2POp` or ``dist.P2POp``) as one batch, so
    two stages can exchange both ways without deadlock; returns their work handles. One record per op."""
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


@_eager
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


@_eager
def all_to_all(t, group, scatter_dim, gather_dim, tag=None):
    """Cut ``t`` into n chunks along ``scatter_dim``, send chunk j to member j, and
    concatenate the chunks received, in group order, along ``gather_dim`` (a new tensor)."""
    n = group_size(group)
    if n == 1:
        return t
    _check_divisible("all_to_all", t, scatter_dim, n)
    outgoing = torch.stack(t.chunk(n, dim=scatter_dim))  # (n, *chunk): row j goes to member j
    incoming = torch.empty_like(outgoing)
    all_to_all_single(incoming, outgoing, group, tag=tag)
    return torch.cat(incoming.unbind(0), dim=gather_dim)


def all_gather_object(obj, group, tag=None) -> list:
    """Every member's picklable ``obj``, in group order ([obj] with one member); metadata only, never
    tensors a step computes with. Records "all_gather_object", nbytes = the pickled size."""
    n = group_size(group)
    if n == 1:
        return [obj]
    _record("all_gather_object", group, None, tag, nbytes=len(pickle.dumps(obj)))
    out = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out


@_eager
def barrier(group, tag=None):
    """Wait until every member arrives. Records "barrier" with 0 bytes."""
    if group_size(group) == 1:
        return
    _record("barrier", group, None, tag, nbytes=0)
    dist.barrier(group=group)
