"""Rank functions for notebooks/04_sp_cp.ipynb (chapter 04: sequence and context parallelism).

`launch.spawn` runs functions that a new process imports by name, so the notebook's two
experiments below the model level live here, not in the notebook. Each runs on every rank of
a world that is ONE group (the tensor-parallel group for SP, the context-parallel group for
CP) and returns plain data (tensors, ledger rows); the notebook puts them back together and
compares them in the parent with the same computation done on full tensors on one device.
The training runs of the notebook are the chapter demo's (`train_run`, chapters/04_sp_cp/demo.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minimegatron import comm, parallel_state
from minimegatron.cp import ContextParallelAttention, cp_chunk_ids, positions_on_rank
from minimegatron.model.linear import RMSNorm
from minimegatron.tp import ColumnParallelLinear, allreduce_sequence_parallel_grads

SEQ = 1                                   # activations [b, s, h]: SP cuts dim 1


def _rows(ledger) -> list[tuple[str, str, int]]:
    return [(r.op, r.tag, r.nbytes) for r in ledger]


def sp_norm_and_column_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor, dy: torch.Tensor) -> dict:
    """The start of a sequence-parallel block on tp = world ranks: RMSNorm on this rank's
    tokens, then a ColumnParallelLinear(sequence_parallel=True).

    x [b, s, in] (full; rank r takes tokens [r s/tp, (r+1) s/tp)), norm_weight [in],
    weight [out, in] and bias [out] (full; the layer keeps rows r), dy [b, s, out] (the full
    output gradient; rank r's slice is its columns). Returns {"y" [b, s, out/tp], "dx"
    [b, s/tp, in], "dweight" [out/tp, in], "dbias" [out/tp], "dnorm_local" (the norm weight's
    gradient from this rank's tokens), "dnorm" (after allreduce_sequence_parallel_grads),
    "ledger" [(op, tag, bytes)] of the forward and backward, "ledger_grads" of the
    all-reduce}."""
    group, tp, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    s_r = x.shape[SEQ] // tp
    norm = RMSNorm(x.shape[-1], eps=1e-5).to(x.dtype)
    with torch.no_grad():
        norm.weight.copy_(norm_weight)
    norm.weight.sequence_parallel = True                   # what apply_tensor_parallel marks
    linear = ColumnParallelLinear(x.shape[-1], weight.shape[0], group, sequence_parallel=True,
                                  params_dtype=x.dtype)
    linear.load_full(weight, bias)
    x_r = x[:, r * s_r:(r + 1) * s_r].clone().requires_grad_()               # [b, s/tp, in]
    out_tp = weight.shape[0] // tp
    with comm.record_communication() as ledger:
        y = linear(norm(x_r))                                                # [b, s, out/tp]
        y.backward(dy[..., r * out_tp:(r + 1) * out_tp])
    local = norm.weight.grad.clone()
    with comm.record_communication() as grads_ledger:
        allreduce_sequence_parallel_grads([norm], group)
    return {"y": y.detach(), "dx": x_r.grad, "dweight": linear.weight.grad, "dbias": linear.bias.grad,
            "dnorm_local": local, "dnorm": norm.weight.grad, "ledger": _rows(ledger),
            "ledger_grads": _rows(grads_ledger)}


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                 comm_types: list[str], backend: str = "sdpa", load_balance: bool = True) -> dict:
    """Causal attention with every cp_comm_type of `comm_types` on cp = world ranks.

    q [b, a, s, d], k and v [b, g, s, d], dout [b, a, s, d]: full tensors; rank r takes the
    positions of its chunks (zig-zag when `load_balance`, cp/layout.positions_on_rank) along
    dim 2. "a2a+p2p" uses all-to-all groups of 2 (hierarchical sizes [2, world/2]). Returns
    {"positions": this rank's positions, comm_type: {"out", "dq", "dk", "dv" (this rank's
    rows, [b, heads, s/cp, d]), "ledger" [(op, tag, bytes)] of the forward and backward}}."""
    cp, r = dist.get_world_size(), dist.get_rank()
    positions = torch.tensor(positions_on_rank(q.shape[2], cp, r, load_balance))
    ids = [cp_chunk_ids(cp, j, load_balance) for j in range(cp)]
    result = {"positions": positions}
    for comm_type in comm_types:
        sizes = (2, cp // 2) if comm_type == "a2a+p2p" else None
        parallel_state.initialize_model_parallel(context_parallel_size=cp, hierarchical_context_parallel_sizes=sizes)
        try:
            groups = ((parallel_state.get_group("hcp-a2a"), parallel_state.get_group("hcp-p2p"))
                      if sizes else (None, None))
            attention = ContextParallelAttention(parallel_state.get_context_parallel_group(), comm_type, ids,
                                                 backend, *groups)
            q_r, k_r, v_r = (t.index_select(2, positions).requires_grad_() for t in (q, k, v))
            with comm.record_communication() as ledger:
                out = attention(q_r, k_r, v_r)                                   # [b, a, s/cp, d]
                out.backward(dout.index_select(2, positions))
            result[comm_type] = {"out": out.detach(), "dq": q_r.grad, "dk": k_r.grad, "dv": v_r.grad,
                                 "ledger": _rows(ledger)}
        finally:
            parallel_state.destroy_model_parallel()
    return result
