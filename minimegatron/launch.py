"""Start N gloo ranks on this machine, from a test, a notebook or a ``torchrun`` script.

``spawn(fn, world_size, *args, **kwargs)``
    ``world_size`` fresh processes in one gloo group run ``fn``; returns the results in rank
    order. The first rank to fail stops the others, and its error and traceback are raised here.
``init_from_torchrun()``
    the first line of a ``torchrun`` demo: join the job's gloo group (or a one-process world).
``finish_torchrun(status)``
    the last line of every ``torchrun`` entry: leave the job, exit with ``status``.
``print_once(message)``
    an error every rank found, printed once for the whole job.

Every rank started by either entry dies with its launcher and sends a heartbeat that names it
when it hangs (watchdog.py). Rendezvous: the parent hosts a ``TCPStore`` bound to port 0 (no
free-port race); each rank passes it to ``init_process_group``.
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import hashlib
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import torch
import torch.distributed as dist

from . import watchdog

__all__ = ["RankError", "spawn", "init_from_torchrun", "finish_torchrun", "print_once", "gloo_threads"]

LOOPBACK = "127.0.0.1"


class RankError(RuntimeError):
    """A rank failed with an exception that cannot be rebuilt in the parent as its own class."""


def _loopback_interface() -> str | None:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    names = {name for _, name in socket.if_nameindex()}
    return next((candidate for candidate in ("lo", "lo0") if candidate in names), None)


# --------------------------------------------------------------------------------------
# Inside a rank
# --------------------------------------------------------------------------------------

class _DetachingPickler(pickle.Pickler):
    """A pickler that sends every tensor as a plain, detached CPU tensor."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):      # a Parameter too: keep only the values
            return obj.detach().cpu().as_subclass(torch.Tensor).__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def _exit_now(status: int) -> None:
    """Flush what the user printed and leave at once, running no clean-up (a gloo peer or thread
    may be stuck in it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _rank_main(rank: int, world_size: int, store_port: int, payload: bytes, conn, collective_timeout: float) -> None:
    """What every spawned process runs. Sends exactly one message on ``conn``: ``("ok", time,
    pickled_result)`` or ``("error", time, type_name, module, message, tb)``; the wall-clock time
    lets the parent tell the first failure from those it caused."""
    torch.set_num_threads(1)  # first thing: 2 cores are shared by all ranks
    watchdog.die_with_parent()  # a killed test or notebook takes its ranks with it
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:   # it died while this rank imported torch
        print(f"rank {rank} (pid {os.getpid()}): the process that spawned it (pid {parent.pid}) is gone; exiting",
              file=sys.stderr, flush=True)
        os._exit(1)
    try:
        fn, args, kwargs = pickle.loads(payload)  # imports fn's module: may fail, reported
        timeout = timedelta(seconds=collective_timeout)
        store = dist.TCPStore(LOOPBACK, store_port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        watchdog.start_heartbeat()
        result = io.BytesIO()                                   # fn's result, pickled
        _DetachingPickler(result, protocol=pickle.HIGHEST_PROTOCOL).dump(fn(*args, **kwargs))
        conn.send(("ok", time.time(), result.getvalue()))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        message = ("error", time.time(), type(exc).__name__, type(exc).__module__, str(exc), traceback.format_exc())
        try:
            conn.send(message)
        finally:
            # The world is broken (a peer may wait forever for us): do not run the clean-up
            # below, which talks to the peers.
            _exit_now(1)
    # Success. Wait for the others before closing our sockets, so that no peer is still
    # reading from us when we go; then tear the process group down.
    try:
        watchdog.stop_heartbeat()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    finally:
        conn.close()


# --------------------------------------------------------------------------------------
# In the parent
# --------------------------------------------------------------------------------------

def _check_importable(fn: Callable) -> None:
    """TypeError before any process starts if a spawned rank could not import ``fn`` by name."""
    qualname = getattr(fn, "__qualname__", repr(fn))
    module = getattr(fn, "__module__", None)
    hint = ("spawn() starts fresh Python processes that import the function by name: define it at the top level "
            "of an importable module (e.g. a chapter's demo.py, imported with booktools.demo.import_chapter, a "
            "module under tests/workers/, or a .py file next to your notebook), not as a lambda or a nested function.")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise TypeError(f"cannot spawn {qualname!r} from module {module!r}: {hint}")
    main = sys.modules.get("__main__")
    if module == "__main__" and not getattr(main, "__file__", None):
        raise TypeError(f"cannot spawn {qualname!r}: it is defined in an interactive session "
                        f"(notebook or REPL), which the new processes cannot import. {hint}")
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(f"cannot spawn {qualname!r}: it cannot be pickled ({exc}). {hint}") from None


def _rebuild_exception(rank: int, world_size: int, type_name: str, module: str, message: str, tb: str) -> BaseException:
    """The exception the parent raises for a failed rank: its own class when possible."""
    text = f"rank {rank} of {world_size} failed: {type_name}: {message}\n\n--- traceback of rank {rank} ---\n{tb}"
    cls = getattr(builtins, type_name, None) if module == "builtins" else None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(text)
        except Exception:  # a builtin that needs more than a message (UnicodeDecodeError)
            pass
    return RankError(text)


def _stop(processes) -> None:
    """Stop every process that is still running and reap it (no zombies)."""
    for p in processes:
        if p.is_alive():
            p.terminate()  # SIGTERM ends a rank even inside a gloo collective
    deadline = time.monotonic() + 3.0
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def spawn(fn: Callable, world_size: int, *args, timeout: float = 120.0, collective_timeout: float = 60.0,
          env: dict[str, str] | None = None, **kwargs) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the results in rank order.

    Each rank is a new "spawn" process (OMP_NUM_THREADS=1, RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT, ``env``) in the default gloo group (``collective_timeout`` seconds a
    collective); results come back pickled, tensors detached on the CPU. ``fn`` must be importable
    by name (else TypeError at once). ``timeout`` bounds the whole run. The first failure stops the
    other ranks and is raised: the rank's builtin exception class or RankError ("rank R of W
    failed: ...", with its traceback), RankError with the exit code for a rank that died, or
    TimeoutError naming the unfinished ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    _check_importable(fn)
    try:
        payload = pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(f"spawn: the arguments for {fn.__qualname__} cannot be pickled: {exc}") from None

    # The rendezvous store, already bound to a free port (see the module docstring).
    store = dist.TCPStore(LOOPBACK, 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=collective_timeout))
    base_env = {"OMP_NUM_THREADS": "1", "WORLD_SIZE": str(world_size),
                "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(store.port)}
    lo = _loopback_interface()
    if lo is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        base_env["GLOO_SOCKET_IFNAME"] = lo  # gloo binds its connections to 127.0.0.1
    base_env.update(env or {})

    ctx = multiprocessing.get_context("spawn")
    processes, readers = [], []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, name=f"minimegatron-rank{rank}",
                            args=(rank, world_size, store.port, payload, writer, collective_timeout))
            # the child's environment (it must see OMP_NUM_THREADS before it imports torch), ours restored
            with mock.patch.dict(os.environ, {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}):
                p.start()
            writer.close()  # only the child writes; closed here so that we see EOF if it dies
            processes.append(p)
            readers.append(reader)
        results = _collect(processes, readers, world_size, timeout)
        for p in processes:  # every rank reported: let them pass the final barrier and exit
            p.join(10.0)
        return results
    finally:
        _stop(processes)
        for r in readers:
            r.close()
        del store


def _collect(processes, readers, world_size: int, timeout: float) -> list[Any]:
    """Wait for one message per rank; raise the first failure; return results in rank order."""
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    pending = {readers[r]: r for r in range(world_size)}
    while pending:
        ready = multiprocessing.connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"spawn: after {timeout:g} s, rank(s) {sorted(pending.values())} of {world_size} had "
                               f"not finished; all ranks were stopped")
        errors, deaths = [], []
        for reader in ready:
            rank = pending.pop(reader)
            try:
                message = reader.recv()
            except EOFError:  # the process ended without reporting
                processes[rank].join(1.0)
                deaths.append(rank)
                continue
            if message[0] == "ok":
                results[rank] = pickle.loads(message[2])
            else:
                errors.append((message[1], rank, message))
        # A rank that died without a word comes first: the errors the others report in the
        # same instant are what its death caused (their collectives lost a peer).
        if deaths:
            rank = deaths[0]
            code = processes[rank].exitcode
            raise RankError(f"rank {rank} of {world_size} died without a Python exception (exit code {code}"
                            + (f", signal {-code}" if code is not None and code < 0 else "")
                            + "); see its output above")
        if errors:
            _, rank, (_, _, type_name, module, msg, tb) = min(errors)
            raise _rebuild_exception(rank, world_size, type_name, module, msg, tb)
    return [results[r] for r in range(world_size)]


# --------------------------------------------------------------------------------------
# torchrun
# --------------------------------------------------------------------------------------

def init_from_torchrun(timeout: float = 60.0, device: str = "cpu") -> tuple[int, int]:
    """Join the process group of a ``torchrun`` job; return ``(rank, world_size)``.

    gloo on "cpu", NCCL on "cuda" (GPU LOCAL_RANK); env:// rendezvous with ``timeout`` seconds per
    collective. Under torchrun the rank dies with torchrun (watchdog.die_with_parent) and sends a
    heartbeat (watchdog.start_heartbeat). Without RANK in the environment: a one-process world.
    Idempotent once the group exists."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    td = timedelta(seconds=timeout)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ:
        lo = _loopback_interface()
        if os.environ.get("MASTER_ADDR") in (LOOPBACK, "localhost") and lo is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)  # one machine: stay on loopback
        watchdog.die_with_parent()
        dist.init_process_group(backend, init_method="env://", timeout=td)
        watchdog.start_heartbeat()
    else:
        # No launcher: a world of one, rendezvous in this process's memory (no port needed).
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=td)
    return dist.get_rank(), dist.get_world_size()


def gloo_threads() -> int:
    """How many threads of this process belong to gloo ("pt_gloo_runloop" workers, "gloo_tcp_loop"),
    from /proc/self/task's thread names; -1 where that cannot be read."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return -1
    names = []
    for task in tasks:
        with contextlib.suppress(OSError):              # the thread ended meanwhile
            names.append(Path(f"/proc/self/task/{task}/comm").read_text())
    return sum(name.startswith(("gloo", "pt_gloo")) for name in names)


def finish_torchrun(status: int = 0, *, world_broken: bool = False) -> int:
    """The end of a ``torchrun`` entry, on every rank: leave the job; return ``status``
    (``sys.exit(main())``). Safe without a process group.

    In order: stop the heartbeat; parallel_state.destroy_model_parallel(); a world barrier (if it
    fails, status 1 if it was 0); destroy_process_group(); gc.collect(), so freed groups join their
    gloo threads while the interpreter is whole. If gloo threads are still alive, flush and
    ``os._exit(status)``: a gloo thread that takes the GIL during interpreter shutdown is ended by
    pthread_exit through a C++ destructor (std::terminate, SIGABRT, a failed job after MATCH).
    ``world_broken=True`` (a collective failed or timed out): no barrier, flush, ``os._exit`` now."""
    from . import parallel_state                        # here: parallel_state does not need us

    watchdog.stop_heartbeat()                           # its thread too must end before shutdown
    if world_broken:
        _exit_now(status)
    parallel_state.destroy_model_parallel()
    had_group = dist.is_initialized()
    if had_group:
        try:
            if dist.get_world_size() > 1:
                dist.barrier()
        except Exception as exc:                         # noqa: BLE001 - report, then leave
            print(f"rank {dist.get_rank()}: the final barrier failed ({type(exc).__name__}: "
                  f"{exc}); leaving without tearing the job down", file=sys.stderr)
            status = status or 1
        else:
            dist.destroy_process_group()
    gc.collect()
    if had_group and gloo_threads() > 0:
        _exit_now(status)
    return status


def print_once(message: str, *, key: str | None = None, file=None) -> bool:
    """Print `message` once for the whole job, whichever rank gets there first; return whether this
    rank printed it. Every rank calls it, then exits with the same status. The first rank to add 1
    to the store key minimegatron/print-once/<key> (default: a digest of the message) prints (not
    rank 0 always: torchrun may stop rank 0 first); works before the group exists and after a
    failed collective. No launcher: it prints; no store reachable: rank 0 prints."""
    rank = os.environ.get("RANK")
    first = rank is None
    if not first:
        key = key or hashlib.sha1(message.encode()).hexdigest()
        try:
            first = watchdog.job_store().add(f"minimegatron/print-once/{key}", 1) == 1
        except Exception:                                # noqa: BLE001 - no store (None) or it failed
            first = rank == "0"
    if first:
        print(message, file=file or sys.stderr, flush=True)
    return first
