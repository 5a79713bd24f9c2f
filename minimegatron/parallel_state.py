"""Who talks to whom: the 5D rank layout, and the process groups built from it.

    tp  tensor parallel     ranks that each hold a slice of every weight matrix
    cp  context parallel    ranks that each hold a slice of the sequence
    ep  expert parallel     ranks that each hold some of the MoE experts
    dp  data parallel       ranks that hold the same weights and see different batches
    pp  pipeline parallel   ranks that each hold some of the layers (a "stage")

The order string (Megatron's default "tp-cp-ep-dp-pp") reads leftmost fastest: with 16 ranks,
tp=2, pp=4, dp=2, rank = tp_rank + 2 * dp_rank + 4 * pp_rank, so tp groups are neighbours
[0,1] [2,3] ..., dp partners two apart [0,2] ..., a pipeline [0,4,8,12] .... A group "tp-pp"
holds the ranks that differ only in tp and pp. Experts get a second grid over the same ranks,
same order string, cp folded away, etp in tp's slot, expert_dp = world / (etp * ep * pp); only
the pipeline stage must agree between the two grids.

  rank_groups / rank_coordinates   pure functions: the whole layout, no processes
  initialize_model_parallel, get_*  real torch process groups, Megatron's getters
  Layout                           where this process sits: sizes, ranks, groups of one step

Megatron: megatron/core/parallel_state.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .comm.ledger import ALONE

DIMS = ("tp", "cp", "ep", "dp", "pp")

# key -> the dimensions a group may differ in, on the dense grid (ep = 1) ...
DENSE_KEYS = {
    "tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",),
    "dp-cp": ("dp", "cp"),             # dense gradients are averaged here
    "tp-cp": ("tp", "cp"),
    "tp-pp": ("tp", "pp"),             # the model-parallel group: one full model copy
    "tp-dp-cp": ("tp", "dp", "cp"),
}
# ... and on the expert grid, where the "tp" slot holds etp and the "dp" slot expert_dp.
EXPERT_KEYS = {"ep": ("ep",), "etp": ("tp",), "expert-dp": ("dp",), "etp-ep": ("tp", "ep")}
KEYS = (*DENSE_KEYS, "embedding", *EXPERT_KEYS)


# ------------------------------------------------------------------- 1. the layout

def _parse_order(order: str) -> list[str]:
    if not isinstance(order, str):
        raise ValueError(f"order={order!r} must be a string like 'tp-cp-ep-dp-pp'")
    dims = order.split("-")
    if sorted(dims) != sorted(DIMS):
        missing = [d for d in DIMS if d not in dims]
        extra = [d for d in dims if d not in DIMS or dims.count(d) > 1]
        raise ValueError(f"order={order!r} must name each of {'-'.join(DIMS)} exactly once"
                         f" (missing: {missing}, unknown or repeated: {sorted(set(extra))})")
    return dims


def _grids(world_size, tp, pp, cp, ep, etp, order):
    """Validate a layout; return (order as a list, dense sizes, expert sizes)."""
    etp = tp if etp is None else etp
    for name, value in dict(world_size=world_size, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp).items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    dims = _parse_order(order)
    if world_size % (tp * pp * cp):
        raise ValueError(f"world_size={world_size} is not divisible by "
                         f"tp*pp*cp={tp}*{pp}*{cp}={tp * pp * cp}")
    if world_size % (etp * ep * pp):
        raise ValueError(f"world_size={world_size} is not divisible by "
                         f"etp*ep*pp={etp}*{ep}*{pp}={etp * ep * pp}")
    dense = dict(tp=tp, cp=cp, ep=1, dp=world_size // (tp * pp * cp), pp=pp)
    expert = dict(tp=etp, cp=1, ep=ep, dp=world_size // (etp * ep * pp), pp=pp)
    # A rank runs the dense and the expert layers of one pipeline stage, so both grids
    # must agree on pp. pp groups are fixed by pp's stride (the product of the sizes to
    # its left); with pp last that is world/pp in both grids, otherwise it may differ.
    strides = [math.prod(g[d] for d in dims[:dims.index("pp")]) for g in (dense, expert)]
    if pp > 1 and strides[0] != strides[1]:
        raise ValueError(
            f"order={order!r}: the pipeline groups of the dense grid (tp={tp}, cp={cp}, "
            f"dp={dense['dp']}) and of the expert grid (etp={etp}, ep={ep}, "
            f"expert_dp={expert['dp']}) differ: pp steps by {strides[0]} vs {strides[1]} "
            f"ranks. Put pp last in the order, or make dp == expert_dp.")
    return dims, dense, expert


def _coordinates(rank: int, sizes: dict[str, int], dims: list[str]) -> dict[str, int]:
    """Mixed-radix digits of `rank`, least significant (fastest) dimension first."""
    coords = {}
    for d in dims:
        rank, coords[d] = divmod(rank, sizes[d])
    return coords


def _groups(world_size, sizes, dims, members) -> list[list[int]]:
    """Partition the ranks: two ranks share a group iff they agree outside `members`. Ranks ascend
    inside a group (its index is the torch group rank); groups are listed by their other
    coordinates, slowest dimension first (Megatron's order)."""
    by_rest: dict[tuple, list[int]] = {}
    for rank in range(world_size):
        c = _coordinates(rank, sizes, dims)
        rest = tuple(c[d] for d in reversed(dims) if d not in members)
        by_rest.setdefault(rest, []).append(rank)
    return [by_rest[k] for k in sorted(by_rest)]


def rank_groups(world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                etp: int | None = None, order: str = "tp-cp-ep-dp-pp",
                ) -> dict[str, list[list[int]]]:
    """Every group of every kind, as lists of global ranks (Megatron-LM semantics). Keys: "tp", "cp",
    "dp" (without cp), "dp-cp" (where dense gradients are averaged), "pp" (index = stage), "tp-cp",
    "tp-pp" (model parallel), "tp-dp-cp", "embedding" ([first, last] stage of each pipeline), and
    on the expert grid "ep", "etp", "expert-dp", "etp-ep". Ranks ascend inside a group; groups in
    Megatron's creation order. ValueError, naming the numbers, for a layout that cannot exist.

    >>> rank_groups(8, tp=2, pp=2)["pp"]
    [[0, 4], [1, 5], [2, 6], [3, 7]]"""
    dims, dense, expert = _grids(world_size, tp, pp, cp, ep, etp, order)
    out = {key: _groups(world_size, dense, dims, m) for key, m in DENSE_KEYS.items()}
    # Tied input/output embeddings live on the first and the last stage; their
    # gradients are summed over this group (a single rank when there is one stage).
    out["embedding"] = [sorted({g[0], g[-1]}) for g in out["pp"]]
    out.update({key: _groups(world_size, expert, dims, m) for key, m in EXPERT_KEYS.items()})
    return out


def check_grids(world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int | None = None,
                order: str = "tp-cp-ep-dp-pp") -> None:
    """rank_groups' verdict without its lists: the same ValueError for a layout that cannot
    exist, nothing otherwise (validate_layout, and chapter 08's planner over thousands of
    layouts of thousands of ranks, ask only this)."""
    _grids(world_size, tp, pp, cp, ep, etp, order)


def rank_coordinates(rank: int, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1,
                     ep: int = 1, etp: int | None = None, order: str = "tp-cp-ep-dp-pp",
                     ) -> dict[str, int]:
    """Where `rank` sits: tp_rank, cp_rank, dp_rank, dp_cp_rank, pp_rank, and on the expert grid
    etp_rank, ep_rank, expert_dp_rank (its index in each of its groups)."""
    dims, dense, expert = _grids(world_size, tp, pp, cp, ep, etp, order)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside 0..{world_size - 1}")
    d, e = _coordinates(rank, dense, dims), _coordinates(rank, expert, dims)
    # Inside the dp-cp group the faster of the two dimensions counts first.
    fast, slow = sorted(("cp", "dp"), key=dims.index)
    return dict(tp_rank=d["tp"], cp_rank=d["cp"], dp_rank=d["dp"],
                dp_cp_rank=d[fast] + dense[fast] * d[slow], pp_rank=d["pp"],
                etp_rank=e["tp"], ep_rank=e["ep"], expert_dp_rank=e["dp"])


# ------------------------------------------------------------------- 2. the runtime

@dataclass
class _ParallelState:
    rank: int                                     # this process's global rank
    ranks: dict = field(default_factory=dict)     # key -> this rank's group (global ranks)
    groups: dict = field(default_factory=dict)    # key -> torch ProcessGroup (or None)


_STATE: _ParallelState | None = None


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1,
                              context_parallel_size: int = 1,
                              expert_model_parallel_size: int = 1,
                              expert_tensor_parallel_size: int | None = None,
                              order: str = "tp-cp-ep-dp-pp",
                              timeout: float | timedelta | None = None,
                              hierarchical_context_parallel_sizes: tuple[int, int] | None = None) -> None:
    """Create the process group of every key of `rank_groups` that contains this rank (Megatron's name).

    Call on every rank after torch.distributed.init_process_group. `timeout` (seconds or a
    timedelta) applies to collectives on the new groups; None gives them the world group's timeout
    (not torch's 30 minutes), so a hung rank ends the job with "timed out" on any group.
    hierarchical_context_parallel_sizes (A, P), A x P = cp (cp_comm_type "a2a+p2p"): each cp group
    is also cut into P "hcp-a2a" groups of A consecutive cp ranks (the all-to-all) and A "hcp-p2p"
    groups of the ranks with the same index in each (the rings; group rank j = sub-group j)."""
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed."
                           "init_process_group to have been called first")
    if _STATE is not None:
        raise RuntimeError("model parallel groups are already initialized; "
                           "call destroy_model_parallel() first")
    rank = dist.get_rank()
    layout = rank_groups(dist.get_world_size(), tp=tensor_model_parallel_size,
                         pp=pipeline_model_parallel_size, cp=context_parallel_size,
                         ep=expert_model_parallel_size, etp=expert_tensor_parallel_size,
                         order=order)
    if timeout is None:
        timeout = world_group_timeout()
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)

    state = _ParallelState(rank)
    # new_group is a collective over the whole world, even for ranks outside the new
    # group: torch names each group by a per-process counter and the members meet in
    # the shared store under that name. So every rank walks the same list in the same
    # order; if one rank skipped a group, its counter would drift and later groups
    # would pair up the wrong ranks or hang.
    # Keys with identical groups (dp and dp-cp when cp == 1, tp and etp when etp == tp)
    # share one ProcessGroup: the same members, so one communicator is enough.
    keyed = [(key, layout[key]) for key in KEYS]
    if hierarchical_context_parallel_sizes is not None:
        a2a, p2p = hierarchical_context_parallel_sizes
        if a2a * p2p != context_parallel_size:
            raise ValueError(f"hierarchical_context_parallel_sizes={[a2a, p2p]}: the product must be "
                             f"context_parallel_size={context_parallel_size}")
        for cp_ranks in layout["cp"]:
            keyed += [("hcp-a2a", [cp_ranks[j * a2a:(j + 1) * a2a] for j in range(p2p)]),
                      ("hcp-p2p", [[cp_ranks[j * a2a + i] for j in range(p2p)] for i in range(a2a)])]
    made: dict[tuple, object] = {}
    for key, groups in keyed:
        for ranks in groups:
            if tuple(ranks) not in made:
                made[tuple(ranks)] = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                state.ranks[key], state.groups[key] = ranks, made[tuple(ranks)]
    _STATE = state


def world_group_timeout() -> timedelta:
    """The timeout the world group was created with: the backend's `options._timeout` (no public
    getter in torch 2.x), else 60 s, the book's default."""
    try:
        group = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
        return group._get_backend(device).options._timeout
    except Exception:                                   # a torch without that attribute
        return timedelta(seconds=60)


def destroy_model_parallel() -> None:
    """Forget the groups (Megatron's name); safe when nothing is initialized. Dropping this module's
    references lets gloo free the groups and their threads while the interpreter is whole
    (launch.finish_torchrun calls it first)."""
    global _STATE
    _STATE = None


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def _state() -> _ParallelState:
    if _STATE is None:
        raise RuntimeError("model parallel groups are not initialized: call "
                           "minimegatron.parallel_state.initialize_model_parallel(...) on "
                           "every rank first")
    return _STATE


def get_group_ranks(name: str) -> list[int]:
    """This rank's group for a key of `rank_groups`, as global ranks ([] for "embedding" on a
    middle pipeline stage)."""
    if name not in KEYS and name not in ("hcp-a2a", "hcp-p2p"):
        raise KeyError(f"unknown group {name!r}; known: {', '.join(KEYS)}")
    return list(_state().ranks.get(name, []))


def get_group(name: str):
    """This rank's torch ProcessGroup for a key of `rank_groups` (None for "embedding"
    on a middle stage). The book's layers take their groups from here, explicitly."""
    get_group_ranks(name)  # checks the name and the initialization
    return _state().groups.get(name)


def _rank_in(key) -> int:
    state = _state()
    return state.ranks[key].index(state.rank)


def _size_of(key) -> int:
    return len(_state().ranks[key])


def _getters(key: str):
    """Megatron's three getters of one dimension: its group (key of rank_groups), this rank's
    index in it, its size."""
    return (lambda: get_group(key)), (lambda: _rank_in(key)), (lambda: _size_of(key))


# Megatron's getters: (group, rank, world size) of each dimension, and the key of rank_groups they read.
get_tensor_model_parallel_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size = _getters("tp")
get_pipeline_model_parallel_group, get_pipeline_model_parallel_rank, get_pipeline_model_parallel_world_size = _getters("pp")
get_context_parallel_group, get_context_parallel_rank, get_context_parallel_world_size = _getters("cp")
get_expert_model_parallel_group, get_expert_model_parallel_rank, get_expert_model_parallel_world_size = _getters("ep")
get_expert_tensor_parallel_group, get_expert_tensor_parallel_rank, get_expert_tensor_parallel_world_size = _getters("etp")
get_expert_data_parallel_group, get_expert_data_parallel_rank, get_expert_data_parallel_world_size = _getters("expert-dp")
def get_model_parallel_group(): return get_group("tp-pp")
def get_tensor_and_context_parallel_group(): return get_group("tp-cp")
def get_expert_tensor_and_model_parallel_group(): return get_group("etp-ep")


def get_data_parallel_group(with_context_parallel: bool = False):
    """The data-parallel group; with_context_parallel=True gives "dp-cp", the group
    over which dense gradients are averaged (cp ranks hold the same weights too)."""
    return get_group("dp-cp" if with_context_parallel else "dp")


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _rank_in("dp-cp" if with_context_parallel else "dp")


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return _size_of("dp-cp" if with_context_parallel else "dp")


def is_pipeline_first_stage() -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_embedding_group():
    """The first+last stage group that sums tied-embedding gradients; None on a
    middle stage (such a rank holds no embedding)."""
    return get_group("embedding")


@dataclass(frozen=True)
class Layout:
    """Where this process sits in the grid and the groups it talks in: the one object every part of a
    step reads (parallelize.build_model, train.train_step, the checkpoints). Layout() is one device.

    Sizes tp, pp, dp (dp = the "dp-cp" ranks that average dense gradients), this rank's index in
    each, and the groups (real torch groups even of size 1; None without torch.distributed).
    embedding_group: first and last pipeline stage (None on a middle one). pp_ranks: this
    pipeline's global ranks in stage order. cp, cp_rank, cp_group: a cp group takes the same
    sequences, so data is split over data_parallel_size = dp / cp replicas (data_parallel_rank);
    cp_a2a_group, cp_p2p_group for "a2a+p2p". Experts, on the expert grid: ep, etp, expert_dp,
    ep_rank, etp_rank and their groups, etp_ep_group; tp_cp_group, tp_dp_cp_group on the dense grid."""
    world: int = 1
    rank: int = 0
    tp: int = 1
    pp: int = 1
    dp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    tp_group: object = None
    pp_group: object = None
    dp_group: object = None
    embedding_group: object = None
    pp_ranks: tuple = (0,)
    cp: int = 1
    cp_rank: int = 0
    cp_group: object = None
    data_parallel_size: int | None = None      # default dp / cp (cp is the faster of the two)
    data_parallel_rank: int | None = None      # default dp_rank // cp
    cp_a2a_group: object = None
    cp_p2p_group: object = None
    tp_cp_group: object = None                 # the ranks whose tokens make one micro-batch (MoE's aux losses)
    tp_dp_cp_group: object = None              # every rank of this pipeline stage (the expert bias counts)
    ep: int = 1
    ep_rank: int = 0
    ep_group: object = None
    etp: int = 1
    etp_rank: int = 0
    etp_group: object = None
    etp_ep_group: object = None                # the allgather dispatcher's group
    expert_dp: int = 1
    expert_dp_group: object = None

    @classmethod
    def alone(cls) -> "Layout":
        """The single device inside a distributed run: every group comm.ALONE (this process
        alone), where Layout()'s None would mean the whole world once torch.distributed is up
        (a check against one device, run by one rank: run_report.py, testing.single_device_run)."""
        groups = [f.name for f in dataclasses.fields(cls) if f.name.endswith("_group")]
        return cls(**{name: ALONE for name in groups})

    @property
    def is_alone(self) -> bool:
        return self.tp_group is ALONE

    def __post_init__(self):
        if self.data_parallel_size is None:
            object.__setattr__(self, "data_parallel_size", self.dp // self.cp)
        if self.data_parallel_rank is None:
            object.__setattr__(self, "data_parallel_rank", self.dp_rank // self.cp)


def get_layout() -> Layout:
    """The Layout of this rank, from the groups initialize_model_parallel made."""
    state = _state()
    dims = {"tp": "tp", "pp": "pp", "dp": "dp-cp", "cp": "cp", "ep": "ep", "etp": "etp"}   # field -> key
    groups = {**dims, "embedding": "embedding", "tp_cp": "tp-cp", "tp_dp_cp": "tp-dp-cp", "etp_ep": "etp-ep",
              "expert_dp": "expert-dp", "cp_a2a": "hcp-a2a", "cp_p2p": "hcp-p2p"}
    return Layout(dist.get_world_size(), state.rank, pp_ranks=tuple(get_group_ranks("pp")),
                  data_parallel_size=_size_of("dp"), data_parallel_rank=_rank_in("dp"), expert_dp=_size_of("expert-dp"),
                  **{name: _size_of(key) for name, key in dims.items()},
                  **{f"{name}_rank": _rank_in(key) for name, key in dims.items()},
                  **{f"{name}_group": state.groups.get(key) for name, key in groups.items()})
