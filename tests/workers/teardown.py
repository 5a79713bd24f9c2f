"""Rank functions for tests/test_teardown.py (launch.finish_torchrun, issue 11).

Each sets up what a torchrun entry leaves behind at its end: the model-parallel groups in
parallel_state's table, a process group held only by a reference cycle (as a DDP wrapper
is, through its autograd hooks), and an asynchronous all-reduce with a Python completion
callback (dp/timeline.py's Future.then), then reports how many gloo threads are alive.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minimegatron import parallel_state
from minimegatron.launch import finish_torchrun, gloo_threads

_HELD = []          # a module-level reference, as a script's global would be


class _Cycle:
    """An object that references itself, like a module wrapper whose hooks capture it: only
    the garbage collector frees it (and the process group it holds)."""

    def __init__(self, group):
        self.group = group
        self.me = self


def _leave_groups_behind(world: int) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    _Cycle(dist.new_group(list(range(world))))
    t = torch.ones(8)
    work = dist.all_reduce(t, group=parallel_state.get_tensor_model_parallel_group(), async_op=True)
    work.get_future().then(lambda fut: fut.value()).wait()


def destroy_only() -> dict:
    """What the entries did before the fix: destroy_process_group() alone."""
    _leave_groups_behind(dist.get_world_size())
    before = gloo_threads()
    dist.barrier()
    dist.destroy_process_group()
    return {"before": before, "after": gloo_threads()}


def finish(status: int) -> dict:
    """finish_torchrun with the groups only parallel_state and a reference cycle hold."""
    _leave_groups_behind(dist.get_world_size())
    before = gloo_threads()
    returned = finish_torchrun(status)
    return {"before": before, "after": gloo_threads(), "returned": returned,
            "initialized": dist.is_initialized(),
            "model_parallel": parallel_state.model_parallel_is_initialized()}


def finish_while_held(status: int) -> None:
    """finish_torchrun while a module-level list still holds a group: it must end the process
    itself, with `status` (spawn then reports a death with that exit code)."""
    _HELD.append(dist.new_group(list(range(dist.get_world_size()))))
    finish_torchrun(status)
    raise AssertionError("finish_torchrun returned although a process group was still alive")


# ---------------------------------------------------------------------------------------
# Run under torchrun (tests/test_teardown.py starts it): the abort of issue 11, on demand
# ---------------------------------------------------------------------------------------

def pending_callback_at_exit(mode: str) -> int:
    """Rank 0 leaves an all-reduce on the TP group (held by parallel_state's table, as in
    every entry) pending, with a Python completion callback; rank 1 joins it 2 s later, while
    rank 0 is already on its way out. The callback then completes in gloo's worker thread,
    which needs the GIL to run and release it.

    mode "destroy": end as the entries did before the fix (destroy_process_group(), then
    Python's own shutdown, which frees the group: its destructor waits for the pending
    work with the GIL released): the thread takes the GIL while the interpreter finalizes,
    CPython ends it with pthread_exit, the unwinding meets a C++ destructor and rank 0
    aborts ("terminate called without an active exception", exit code -6).
    mode "finish": end with launch.finish_torchrun: rank 0 exits 0 after the callback ran."""
    import time

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)   # module-level state
    group = parallel_state.get_tensor_model_parallel_group()
    t = torch.ones(4)
    if rank == 0:
        work = dist.all_reduce(t, group=group, async_op=True)
        work.get_future().then(lambda fut: print("rank 0: callback ran", flush=True))
    else:
        time.sleep(2.0)
        dist.all_reduce(t, group=group)
    if mode == "finish":
        return finish_torchrun(0)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(pending_callback_at_exit(sys.argv[1]))
