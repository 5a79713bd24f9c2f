"""Tests for minimegatron.launch: spawning gloo ranks, and how their failures come back.

Each spawned world costs a few seconds (every rank imports torch), so each test starts at
most one or two small worlds. Elapsed-time bounds are hang detectors, not speed tests.
"""

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from minimegatron.launch import RankError, _rebuild_exception, init_from_torchrun, spawn
from workers import launch_workers as w  # tests/workers/launch_workers.py


def child_pids() -> set[int]:
    """Every process whose parent is this one, reaped or not (zombies included), except
    multiprocessing's resource tracker, a helper that lives as long as this process."""
    pids = set()
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            with open(f"/proc/{os.getpid()}/task/{tid}/children") as f:
                pids.update(int(p) for p in f.read().split())
        except FileNotFoundError:        # a thread that ended between the listing and the read
            continue
    def is_tracker(pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return b"resource_tracker" in f.read()
        except OSError:
            return False
    return {pid for pid in pids if not is_tracker(pid)}


@pytest.fixture
def no_leftover_processes():
    before = child_pids()
    yield
    assert child_pids() - before == set(), "spawn left child processes (or zombies) behind"


def test_two_spawns_in_a_row_return_results_in_rank_order(no_leftover_processes):
    ports = []
    for world_size in (2, 3):
        results = spawn(w.report_identity, world_size, 10, env={"MINIMEGATRON_TEST_VAR": "hi"})
        assert [r["rank"] for r in results] == list(range(world_size))
        # sum over ranks of (rank + 10), computed here independently
        expected_sum = sum(r + 10 for r in range(world_size))
        for rank, r in enumerate(results):
            assert r["world_size"] == world_size
            assert r["sum"].tolist() == [float(expected_sum)]
            assert r["threads"] == 1
            env = r["env"]
            assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
            assert env["WORLD_SIZE"] == str(world_size)
            assert env["MASTER_ADDR"] == "127.0.0.1"
            assert env["OMP_NUM_THREADS"] == "1"
            assert env["MINIMEGATRON_TEST_VAR"] == "hi"
            # tensors come back as plain values, cut from the rank's autograd graph
            assert type(r["doubled"]) is torch.Tensor and not r["doubled"].requires_grad
            assert r["doubled"].tolist() == [2.0 * rank, 2.0 * rank]
        assert len({r["env"]["MASTER_PORT"] for r in results}) == 1
        assert len({r["pid"] for r in results}) == world_size
        ports.append(int(results[0]["env"]["MASTER_PORT"]))
    assert all(p > 0 for p in ports)


def test_value_error_comes_back_fast_with_rank_and_traceback(no_leftover_processes):
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        # ranks 0 and 2 wait in an all-reduce that rank 1 never joins; their own collective
        # timeout (60 s) is far beyond the bound below, so only spawn can end them in time
        spawn(w.raise_on_rank, 3, 1, "ValueError", "bad shard 7", collective_timeout=60.0)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert message.startswith("rank 1 of 3 failed: ValueError: bad shard 7")
    assert "raise getattr(builtins, exc_name)(message)  # the failing line" in message
    assert "workers/launch_workers.py" in message
    assert elapsed < 30, f"the failure took {elapsed:.1f} s to come back"


def test_not_implemented_error_keeps_its_class(no_leftover_processes):
    with pytest.raises(NotImplementedError, match=r"^rank 0 of 2 failed: NotImplementedError: "
                                                   r"no fp8 here"):
        spawn(w.raise_on_rank, 2, 0, "NotImplementedError", "no fp8 here")


def test_rank_that_exits_without_exception_is_reported_with_exit_code(no_leftover_processes):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn(w.exit_on_rank, 2, 1, 3, collective_timeout=60.0)
    assert re.search(r"rank 1 of 2 died .*exit code 3\b", str(info.value)), str(info.value)
    assert time.monotonic() - start < 30


def test_timeout_names_the_ranks_that_did_not_finish(no_leftover_processes):
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        spawn(w.sleep_on_rank, 2, 1, 1000.0, timeout=6.0)
    elapsed = time.monotonic() - start
    found = re.search(r"rank\(s\) \[([\d, ]*)\] of 2 had not finished", str(info.value))
    assert found, str(info.value)
    missing = [int(x) for x in found.group(1).split(",")]
    # rank 1 sleeps far past the timeout; rank 0 normally finished (unless the machine
    # was too busy to even start it in 6 s, which is why 0 is allowed in the list)
    assert 1 in missing and set(missing) <= {0, 1}
    assert 6.0 <= elapsed < 30


def _local_function():
    pass


def test_unimportable_functions_are_refused_before_any_process_starts(no_leftover_processes):
    def nested():
        pass

    for fn in (lambda: None, nested):
        start = time.monotonic()
        with pytest.raises(TypeError, match="top level of an importable module"):
            spawn(fn, 2)
        assert time.monotonic() - start < 1.0  # no process was started: that takes seconds


def test_rebuilt_exception_class():
    # a builtin with one message argument keeps its class...
    exc = _rebuild_exception(2, 4, "AssertionError", "builtins", "x != y", "Traceback ...")
    assert type(exc) is AssertionError
    assert str(exc).startswith("rank 2 of 4 failed: AssertionError: x != y")
    assert "Traceback ..." in str(exc)
    # ...a builtin that needs more arguments, or a class of another module, cannot
    for name, module in (("UnicodeDecodeError", "builtins"), ("MyError", "mymodule"),
                         ("KeyboardInterrupt", "builtins")):
        exc = _rebuild_exception(0, 2, name, module, "boom", "tb")
        assert type(exc) is RankError and isinstance(exc, RuntimeError)
        assert str(exc).startswith(f"rank 0 of 2 failed: {name}: boom")


def test_init_from_torchrun_without_torchrun_is_a_world_of_one(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()
    try:
        assert init_from_torchrun(timeout=10.0) == (0, 1)
        assert init_from_torchrun() == (0, 1)  # a second call is harmless
        t = torch.tensor([3.0])
        dist.all_reduce(t)
        assert t.item() == 3.0
    finally:
        dist.destroy_process_group()
