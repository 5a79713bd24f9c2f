"""The runnable pieces of each chapter, shared by its notebook and its demo.

One module per chapter (``ch00.py``, ``ch01.py``, ...). What lives here is what a chapter
*shows* rather than what the library *is*: the experiments the notebook runs and the demo
prints (an equivalence check, a memory report, a worker for ``launch.spawn``). Two readers
need them, so they are written once, here:

  - ``notebooks/NN_*.ipynb`` imports them (a function typed into a notebook cannot be sent to
    the ranks that ``minimegatron.launch.spawn`` starts: those processes import it by name);
  - ``chapters/NN_*/demo.py`` imports them and prints the verdict.

The library code they use (``minimegatron.model``, ``.train``, ``.testing``, ``.analysis``)
stays the single source of truth; nothing here re-implements it, except where a chapter
writes a step out on purpose, and then the docstring says so.
"""


def verdict_under_torchrun(result, report) -> int:
    """The end of a chapter demo under torchrun, on every rank: gather every rank's `result`
    on rank 0 (torch.distributed.gather_object: plumbing for the report, in no ledger), call
    `report(per_rank)` there (it prints, and returns the exit status; a report that raises
    prints its traceback and counts as MISMATCH, 1), broadcast rank 0's status to every rank,
    destroy the process group, and return the status: every rank exits with rank 0's verdict."""
    import traceback

    import torch
    import torch.distributed as dist

    from .. import comm

    rank = dist.get_rank()
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    code = 0
    if rank == 0:
        try:
            code = report(gathered)
        except Exception:                               # still tell the other ranks
            traceback.print_exc()
            print("MISMATCH: the report failed (traceback above)")
            code = 1
    verdict = torch.tensor([code])
    comm.broadcast(verdict, 0, None, tag="verdict")
    dist.destroy_process_group()
    return int(verdict.item())
