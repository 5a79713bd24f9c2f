"""A torchrun rank dies with its launcher from its first line on, not only once torch is loaded.

Importing `minimegatron` calls `hold_on_to_launcher()` first (torch's import takes seconds).
Under torchrun it arms the kernel's parent-death signal (die_with_parent), then exits at once,
saying so, if the launcher is already gone (launcher_gone) rather than wait minutes in the
rendezvous as an orphan. Standard library only: it runs before torch is imported.
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
    """Have the kernel SIGKILL this process when its parent thread exits (Linux prctl
    PR_SET_PDEATHSIG); returns whether that is armed. SIGKILL: a rank blocked in a collective must
    die at once (checkpoints are written by rename, so they stay safe). A parent that dies while
    arming is seen (the parent pid changes) and the process ends at once."""
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
    """Why this torchrun rank's launcher is known to be gone, or None (alive, or unknown). torchrun's
    agent hosts the job's store at MASTER_ADDR:MASTER_PORT while it lives, so a refused connection
    there is proof; a timeout or missing variables are not (nor is the parent pid: torchrun may be
    pid 1 in a container)."""
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
