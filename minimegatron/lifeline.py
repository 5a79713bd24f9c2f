"""A torchrun rank dies with its launcher from its first line on, not only once torch is loaded.

Importing `minimegatron` calls `hold_on_to_launcher()` before anything else (before torch: its
import takes seconds on a busy laptop). Under torchrun it

  1. arms the kernel's parent-death signal (Linux prctl(PR_SET_PDEATHSIG, SIGKILL):
     die_with_parent), so a torchrun killed from now on takes this rank with it;
  2. checks that the launcher is still there (launcher_gone), and exits at once, saying so,
     when it is not: torchrun was killed before this rank could arm the signal, and the rank
     would otherwise import torch, then wait in the rendezvous for a store that is gone (1 to
     3 minutes, an orphan whose parent is pid 1).

Standard library only: this module runs before torch is imported.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys

__all__ = ["die_with_parent", "launcher_gone", "hold_on_to_launcher", "is_torchrun_rank"]

_PR_SET_PDEATHSIG = 1         # from <linux/prctl.h>


def is_torchrun_rank() -> bool:
    """Was this process started by torchrun (torch.distributed.run sets TORCHELASTIC_RUN_ID for
    every worker it starts)?"""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def die_with_parent() -> bool:
    """Have the kernel SIGKILL this process when its parent process dies (Linux); returns
    whether that is armed.

    SIGKILL, not SIGTERM: a rank blocked in a collective must die at once, and a checkpoint
    it was writing is safe (checkpoint.py writes to a temporary name and renames). The kernel
    sends it when the parent *thread* that started us exits; torchrun and launch.spawn start
    their ranks from their main thread. A parent that dies while the signal is being armed is
    seen (the parent pid changes) and the process ends at once; one that died before is what
    launcher_gone looks for."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:                  # orphaned while the signal was being armed
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def launcher_gone(timeout: float = 2.0) -> str | None:
    """Why this torchrun rank's launcher is known to be gone, or None (alive, or unknown).

    torchrun's agent hosts the job's store (TORCHELASTIC_USE_AGENT_STORE=True) at
    MASTER_ADDR:MASTER_PORT from before it starts any rank until it exits: a refused connection
    there means the agent is gone (on a second node too: the job's store is gone). Anything
    else (a timeout, no such variables, another launcher) is not taken as proof.
    (A rank's parent pid cannot tell: torchrun may itself be pid 1 in a container, and an
    orphan is adopted by a subreaper as often as by pid 1.)"""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not host or not port:
        return None
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except ConnectionRefusedError:
        return f"nothing listens at MASTER_ADDR:MASTER_PORT = {host}:{port}, where torchrun kept the job's store"
    except (OSError, ValueError):
        return None
    return None


def hold_on_to_launcher() -> None:
    """Under torchrun: die_with_parent, then exit (status 1, one line on stderr) if the launcher
    is already gone. Elsewhere (a plain python, a notebook, pytest, launch.spawn's ranks, which
    arm the signal themselves) nothing."""
    if not is_torchrun_rank():
        return
    die_with_parent()
    why = launcher_gone()
    if why is not None:
        print(f"rank {os.environ.get('RANK')} (pid {os.getpid()}): its launcher is gone ({why}): torchrun was "
              f"stopped while this rank started; exiting", file=sys.stderr, flush=True)
        os._exit(1)
