"""Rank functions for the graders of chapter 04 (sequence and context parallelism),
tests/graders/test_ch04_sp_cp.py.

One spawned world of 4 ranks grades the four exercises (a rank costs seconds to start;
booktools/exercises/world.py: only the exercises being graded, each failure charged to its own
exercise): the rank runs each exercise's checks with that exercise's function plugged in (`plug(id)`: the
learner's, the reference or the bare stub, from MINIMEGATRON_IMPL) and records, per exercise,
either the plain data the checks produced or the traceback that stopped them. The graders
compare the data in the parent against independent oracles (torch's autograd on full
tensors on one device, testing.single_device_run); a traceback fails only that exercise's
graders (and names "NotImplementedError: exercise 4.x" when it came from an unfilled stub).

Groups: the whole world (4 ranks) and the pairs [0, 1], [2, 3]: every check that runs on "2
and 4 ranks" runs on both, in the same world.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from booktools.exercises import implementation
from minimegatron import comm
from minimegatron.cp import cp_chunk_ids
from minimegatron.cp.ring import ring_attention
from booktools.demo import import_chapter
from minimegatron.tp import ColumnParallelLinear
from booktools.exercises.world import run_checks

ch04 = import_chapter("04")              # chapters/04_sp_cp/demo.py

# attention: batch, query heads, key/value groups, head size, sequence (divisible by 2 x 4)
B, A, G, D, S = 2, 4, 2, 8, 16
# the sequence-parallel column linear: x [LB, LS, IN] -> [LB, LS, OUT]; LS and OUT divisible by 4
LB, LS, IN, OUT = 2, 8, 6, 12


def attention_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Full float64 q [B, A, S, D], k and v [B, G, S, D] and dout [B, A, S, D]; every rank and
    the grader build them alike. The scale 3 makes the softmax peaked (scores of tens)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return {"q": 3 * r(B, A, S, D), "k": 3 * r(B, G, S, D), "v": r(B, G, S, D), "dout": r(B, A, S, D)}


def linear_inputs(seed: int = 1) -> dict[str, torch.Tensor]:
    """Full float64 x [LB, LS, IN], W [OUT, IN], b [OUT], dy [LB, LS, OUT]."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return {"x": r(LB, LS, IN), "w": r(OUT, IN), "b": r(OUT), "dy": r(LB, LS, OUT)}


def positions(cp: int, rank: int, load_balance: bool) -> list[int]:
    """The positions a rank of a ring of `cp` holds: its two chunks of S / (2 cp), written out
    here from the layouts' definition (zig-zag: chunks r and 2 cp - 1 - r; contiguous: 2r, 2r+1)."""
    c = S // (2 * cp)
    chunks = [rank, 2 * cp - 1 - rank] if load_balance else [2 * rank, 2 * rank + 1]
    return [i * c + j for i in chunks for j in range(c)]


def _groups():
    """(size, group, rank in it) for the world and this rank's pair. Every rank creates every
    group in the same order (a rule of new_group)."""
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return [(4, dist.group.WORLD, rank), (2, pairs[rank // 2], rank % 2)]


# ---------------------------------------------------------------------- 4.1
def ring_attention_results(groups) -> list[dict]:
    """Ring attention (merge_attention inside) over each group, zig-zag and contiguous, both
    backends: this rank's out, dq, dk, dv and the positions they belong to."""
    full, results = attention_inputs(), []
    for size, group, me in groups:
        for load_balance in (True, False):
            for backend in ("naive", "sdpa"):
                pos = torch.tensor(positions(size, me, load_balance))
                q, k, v = (full[n].index_select(2, pos).clone().requires_grad_() for n in ("q", "k", "v"))
                kv_ids = [cp_chunk_ids(size, r, load_balance) for r in range(size)]
                out = ring_attention(q, k, v, group, kv_ids[me], kv_ids, backend)
                out.backward(full["dout"].index_select(2, pos))
                results.append({"cp": size, "load_balance": load_balance, "backend": backend, "positions": pos,
                                "out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad})
    return results


# ---------------------------------------------------------------------- 4.2
def _batch_from_your_positions(batch, cp_size, cp_rank, load_balance=True):
    """get_batch_on_this_cp_rank with the positions from zigzag_positions (the graded one)."""
    if not load_balance:
        raise ValueError("the 4.2 grader runs zig-zag (load_balance=True) only")
    s = batch["tokens"].shape[1]
    pos = torch.tensor(implementation("4.2")(s, cp_size, cp_rank), dtype=torch.long)
    out = {key: value.index_select(1, pos) if key in ("tokens", "labels") else value for key, value in batch.items()}
    out["position_ids"] = pos
    return out


def zigzag_training(runs) -> list[dict]:
    """The demo's train_run for each run, with every rank's tokens cut by zigzag_positions."""
    original = ch04.get_batch_on_this_cp_rank
    ch04.get_batch_on_this_cp_rank = _batch_from_your_positions
    try:
        return [ch04.train_run(run) for run in runs]
    finally:
        ch04.get_batch_on_this_cp_rank = original


# ---------------------------------------------------------------------- 4.3
def sequence_parallel_linear_results(groups) -> list[dict]:
    """ColumnParallelLinear(sequence_parallel=True) over each group, with and without bias:
    forward with this rank's tokens of x, backward with this rank's columns of dy; returns
    dx, dW, db and the backward's ledger (op, tag, bytes, group size)."""
    full, results = linear_inputs(), []
    for size, group, me in groups:
        for bias in (True, False):
            layer = ColumnParallelLinear(IN, OUT, group, bias=bias, params_dtype=torch.float64,
                                         sequence_parallel=True)
            layer.load_full(full["w"], full["b"] if bias else None)
            x = full["x"].chunk(size, dim=1)[me].clone().requires_grad_()          # [LB, LS/tp, IN]
            y = layer(x)                                                             # [LB, LS, OUT/tp]
            with comm.record_communication() as bwd:
                y.backward(full["dy"].chunk(size, dim=-1)[me])
            results.append({"tp": size, "rank": me, "bias": bias, "dx": x.grad, "dw": layer.weight.grad,
                            "db": None if layer.bias is None else layer.bias.grad,
                            "bwd": [(r.op, r.tag, r.nbytes, r.group_size) for r in bwd]})
    return results


# ---------------------------------------------------------------------- the world
def grade_world(runs_42, runs_44, plan) -> dict[str, dict]:
    """On each of 4 ranks: the checks of the exercises of `plan` (booktools.exercises.world.Plan),
    each with its function plugged in. Returns run_checks' {id: {"error": ..., "data": ...}}."""
    groups = _groups()
    # 4.1 last: a merge that raises stops the ring with its sends and receives still in flight,
    # which could disturb the collectives of a check after it
    checks = {"4.3": lambda: sequence_parallel_linear_results(groups),
              "4.2": lambda: zigzag_training(runs_42),
              "4.4": lambda: [ch04.train_run(run) for run in runs_44],
              "4.1": lambda: ring_attention_results(groups)}
    return run_checks(checks, plan)
