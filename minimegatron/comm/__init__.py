"""Communication: every collective of the book, explicit and counted in a ledger.

Read in this order: ledger.py (what is recorded), collectives.py (the plain wrappers),
regions.py (the autograd-aware operators tensor, sequence and expert parallelism use).

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


from .collectives import (P2POp, all_gather, all_gather_into_tensor, all_gather_object, all_reduce, all_to_all,
                          all_to_all_single, barrier, batch_isend_irecv, broadcast, compile_barriers, irecv,
                          isend, recv, reduce_scatter, reduce_scatter_tensor, send)
from .ledger import (ALONE, CommRecord, Ledger, group_rank, group_ranks, group_size,
                     record_communication, retagged, ring_traffic)
from .regions import (all_to_all_region, all_to_all_uneven_region, gather_uneven_region, reduce_scatter_uneven_region,
                      copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                      gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
                      reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
                      scatter_to_tensor_model_parallel_region)


__all__ = ["ALONE", "CommRecord", "Ledger", "record_communication", "retagged", "ring_traffic",
           "group_ranks", "group_size", "group_rank",
           "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
           "reduce_scatter_tensor", "broadcast", "send", "recv", "isend", "irecv", "P2POp",
           "batch_isend_irecv", "all_to_all_single", "all_to_all", "barrier", "compile_barriers",
           "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
           "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
           "reduce_scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
           "scatter_to_sequence_parallel_region", "all_to_all_region", "all_to_all_uneven_region",
           "gather_uneven_region", "reduce_scatter_uneven_region"]
