"""Rank functions for the tests of ``minimegatron.launch`` (tests/test_launch.py).

``spawn`` can only run functions that a new process can import by name, so the small
functions the launcher's tests run on every rank live in a module, not in the test file:
here, imported as ``from workers import launch_workers`` (pytest puts tests/ on sys.path,
and the spawned processes inherit it).
"""

import builtins
import os
import time

import torch
import torch.distributed as dist


def report_identity(offset):
    """Return who this rank is, what its environment says, and a world all-reduce result."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + offset)])
    dist.all_reduce(total)  # sum over ranks of (rank + offset)
    doubled = torch.full((2,), float(rank), requires_grad=True) * 2  # a non-leaf with grad
    env = {k: os.environ.get(k) for k in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
            "OMP_NUM_THREADS", "MINIMEGATRON_TEST_VAR")}
    return {"rank": rank, "world_size": world, "sum": total, "doubled": doubled,
            "env": env, "threads": torch.get_num_threads(), "pid": os.getpid()}


def raise_on_rank(bad_rank, exc_name, message):
    """``bad_rank`` raises builtins.<exc_name>(message); every other rank waits in an
    all-reduce that can never complete, as a real failure leaves its peers."""
    if dist.get_rank() == bad_rank:
        raise getattr(builtins, exc_name)(message)  # the failing line
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def exit_on_rank(bad_rank, code):
    """``bad_rank`` ends its process without a Python exception; the others wait."""
    if dist.get_rank() == bad_rank:
        os._exit(code)
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def sleep_on_rank(slow_rank, seconds):
    """``slow_rank`` sleeps; the others return at once."""
    if dist.get_rank() == slow_rank:
        time.sleep(seconds)
    return dist.get_rank()
