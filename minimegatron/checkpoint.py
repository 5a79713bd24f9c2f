"""Save and resume a training run, exactly (chapter 00's "Exact resume").

A checkpoint is `iter_{step:07d}.pt` in a directory plus a text file `latest` naming the newest
(Megatron's latest_checkpointed_iteration.txt). It holds the model and optimizer state, the
step (the data order and learning rate are functions of it), the RNG state, both configs (a
checkpoint of another model is refused by field) and the loss history. With data parallelism
over n > 1 ranks each rank also writes `iter_{step:07d}.rank{r}.pt` (its optimizer shard and
RNG state); all meet at a barrier before rank 0 writes the main file and moves `latest`, so
`latest` always names a complete checkpoint. Resuming needs the same number of ranks.

Safety rules:
  - written to a temporary name, then renamed (atomic); a killed save's `*.tmp` files are
    removed by the next save in that directory;
  - a directory without a checkpoint warns and trains from scratch (Megatron's --load); an
    empty `latest`, or one naming a missing file, is an error;
  - torch.load(weights_only=True): never code from a pickle;
  - a CRC-32 per tensor and one of all other values (`checksums`), checked at load: a changed
    file is refused, naming file and tensor;
  - an unwritable save_dir is a CheckpointError before training (check_save_dir);
  - one run at a time writes a directory (lock_save_dir names the owner);
  - every rank of a resume agrees on the load first (all_ranks_agree): one rank's bad file
    ends the job in seconds, named, not at the next collective's timeout.
"""

from __future__ import annotations

import json
import os
import socket
import zlib
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import comm

try:                                  # POSIX (Linux, macOS); elsewhere save directories are not locked
    import fcntl
except ImportError:                   # pragma: no cover
    fcntl = None

FORMAT = "minimegatron-checkpoint-v1"
LOCK_FILE = "minimegatron.lock"


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or from another model."""


def _unreadable(path: Path, exc: BaseException) -> CheckpointError:
    """The error for a checkpoint file torch.load could not read: its size and the reason
    (a 0-byte file makes torch raise with an empty message)."""
    size = path.stat().st_size if path.exists() else 0
    if size == 0:
        why = "the file is empty (0 bytes): its save was cut short, or the disk was full"
    else:
        why = f"{type(exc).__name__}: {str(exc).strip() or 'no message'} (the file has {size:,} bytes: truncated or not a checkpoint?)"
    return CheckpointError(f"cannot read checkpoint {path}: {why}")


def _atomic_write(path: Path, write) -> None:
    """`write(tmp)` to path.tmp, then rename it to `path`; CheckpointError naming the file when
    the filesystem refuses (full, read-only, gone)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        raise CheckpointError(f"cannot write {path}: {exc.strerror or exc}") from None


def check_save_dir(directory: str | os.PathLike) -> None:
    """CheckpointError naming `directory` and why when checkpoints cannot be written there (a file on
    the path, not writable, a read-only or refusing filesystem). Creates the directory and writes
    and removes a probe file: the one test that holds for every reason (root ignores os.access)."""
    directory = Path(directory)
    blocker = next((p for p in [directory, *directory.parents] if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise CheckpointError(f"save_dir {directory}: {blocker} is a file, not a directory (give --save a directory)")
    probe = directory / f".minimegatron-write-probe-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"save_dir {directory} cannot be written: {exc.strerror or exc} (errno "
                              f"{exc.errno}); give --save a writable directory") from None


# ---------------------------------------------------------------------------------------
# checksums
# ---------------------------------------------------------------------------------------
def _leaves(obj: Any, path: str = ""):
    """(path, value) for every leaf of nested dicts, lists and tuples; a path joins the keys
    and indices with "/"."""
    if not isinstance(obj, (dict, list, tuple)):
        yield path, obj
        return
    for key, value in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
        yield from _leaves(value, f"{path}/{key}" if path else str(key))


def tensor_crc(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's dtype, shape and bytes (in row-major order)."""
    crc = zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode())
    return zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy(), crc)


def checksums(state: dict[str, Any]) -> list[int]:
    """One CRC-32 per tensor in `state` (nested containers), in _leaves' order, then one of every
    other leaf (its path and repr): what load_checkpoint compares. CRC-32, not a cryptographic
    hash: the sums live in the file they check, so only accidental change can be detected, and
    CRC-32 catches every burst of <= 32 flipped bits, faster than sha256 (benchmarks/README.md)."""
    sums, rest = [], 0
    for path, value in _leaves(state):
        if isinstance(value, torch.Tensor):
            sums.append(tensor_crc(value))
        else:
            rest = zlib.crc32(f"{path}={value!r}\n".encode(), rest)
    return sums + [rest]


def with_checksums(state: dict[str, Any]) -> dict[str, Any]:
    """`state` plus its "checksums" (computed over everything else in it)."""
    body = {k: v for k, v in state.items() if k != "checksums"}
    return {**body, "checksums": checksums(body)}


def verify_checksums(state: dict[str, Any], path: str | os.PathLike) -> None:
    """CheckpointError naming the file `path` and its first damaged tensor (or its other values)
    when `state`, as loaded from it, differs from the checksums recorded when it was saved. A
    file without "checksums" (saved before they existed) is not checked."""
    recorded = state.get("checksums") if isinstance(state, dict) else None
    if recorded is None:
        return
    body = {k: v for k, v in state.items() if k != "checksums"}
    now = checksums(body)
    tensors = [p for p, v in _leaves(body) if isinstance(v, torch.Tensor)]
    if len(now) != len(recorded):
        bad = [f"its structure ({len(tensors)} tensors, {len(recorded) - 1} when saved)"]
    else:
        bad = [name for name, a, b in zip(tensors + ["its values other than tensors"], recorded, now) if a != b]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CheckpointError(f"checkpoint file {path} is damaged: {bad[0]}{more} differs from the CRC-32 recorded "
                              f"when it was saved; its bytes changed after the save (a disk or copy error, or an "
                              f"edit): restore the file, or resume from an earlier checkpoint")


def write_checked(path: Path, state: dict[str, Any]) -> None:
    """torch.save `state` with its checksums to `path`, atomically."""
    payload = with_checksums(state)
    _atomic_write(path, lambda tmp: torch.save(payload, tmp))


def read_checked(path: Path, expect: dict[str, Any], what: str, *, mmap: bool = False) -> dict[str, Any]:
    """The dict torch.load(weights_only=True) reads from checkpoint file `path`, its checksums checked,
    without them. FileNotFoundError when there is none (the caller says what that means);
    CheckpointError when it cannot be read, when its values differ from `expect`'s ("{path} is
    not {what}"), or when it is damaged (verify_checksums)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise
    except Exception as exc:  # a truncated or foreign file: say which, keep the cause
        raise _unreadable(path, exc) from exc
    if expect and (not isinstance(state, dict) or any(state.get(k) != v for k, v in expect.items())):
        raise CheckpointError(f"{path} is not {what}")
    verify_checksums(state, path)
    return {k: v for k, v in state.items() if k != "checksums"}


def check_same_model(stored: dict[str, Any], run: dict[str, Any], path, may_change: tuple[str, ...] = ()) -> None:
    """CheckpointError listing every field of the run's model config that differs from the
    checkpoint's ("hidden_size: checkpoint 64, run 128"), apart from those in `may_change`."""
    diffs = [f"{k}: checkpoint {stored.get(k)!r}, run {v!r}" for k, v in run.items()
             if stored.get(k) != v and k not in may_change]
    if diffs:
        raise CheckpointError(f"checkpoint {path} is from another model: " + "; ".join(diffs))


def remove_stale_temporaries(directory: str | os.PathLike) -> None:
    """Delete the `*.tmp` files that killed saves left in `directory`. Safe only while nothing
    else writes there (train saves on rank 0 after the barrier that follows every rank's file)."""
    for path in Path(directory).glob("*.tmp"):
        path.unlink(missing_ok=True)


def save_checkpoint(directory: str | os.PathLike, step: int, state: dict[str, Any]) -> Path:
    """Write `state` (plus the step and format tag) as iter_{step}.pt, point `latest` at it; first
    remove_stale_temporaries."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(directory)
    path = directory / f"iter_{step:07d}.pt"
    write_checked(path, {"format": FORMAT, "step": step, **state})
    _atomic_write(directory / "latest", lambda tmp: tmp.write_text(path.name + "\n"))
    return path


def latest_checkpoint(directory: str | os.PathLike, *, warn: bool = True) -> Path | None:
    """The file `latest` points at, or None when the directory holds no checkpoint (with `warn`, a
    UserWarning from rank 0 saying why, and that the run starts from scratch). CheckpointError
    when `latest` is empty or names a missing file."""
    directory = Path(directory)
    pointer = directory / "latest"
    if not pointer.is_file():
        if warn and (not dist.is_initialized() or dist.get_rank() == 0):
            why = ("does not exist" if not directory.exists() else
                   "is a file, not a checkpoint directory (give the directory that holds `latest`)"
                   if not directory.is_dir() else "holds no `latest` file")
            warnings.warn(f"load_dir {directory} {why}: no checkpoint loaded, training starts from scratch",
                          UserWarning, stacklevel=2)
        return None
    name = pointer.read_text().strip()
    if not name:
        raise CheckpointError(f"{pointer} is empty: it should name the newest checkpoint file of {directory} "
                              f"(e.g. iter_0000008.pt); a save was interrupted or the file was edited")
    path = directory / name
    if not path.exists():               # a file (ckpt-format torch) or a directory (torch_dist)
        raise CheckpointError(f"{pointer} names {name}, which does not exist in {directory}")
    return path


def load_checkpoint(path: str | os.PathLike, *, model_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load a checkpoint file (or a directory's latest) without running pickled code. With
    `model_config`, CheckpointError lists the fields that differ ("hidden_size: checkpoint 64, run 128")."""
    path = Path(path)
    if path.is_dir():
        found = latest_checkpoint(path, warn=False)
        if found is None:
            raise CheckpointError(f"no checkpoint in {path} (no 'latest' file)")
        path = found
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    state = read_checked(path, {"format": FORMAT}, f"a {FORMAT} file")
    if model_config is not None:
        check_same_model(state.get("model_config", {}), model_config, path)
    return state


def rank_path(directory: str | os.PathLike, step: int, rank: int) -> Path:
    """The file holding rank `rank`'s own state at `step`."""
    return Path(directory) / f"iter_{step:07d}.rank{rank}.pt"


def save_rank_state(directory: str | os.PathLike, step: int, rank: int, state: dict[str, Any]) -> Path:
    """Write one rank's own state (atomically); rank 0 moves `latest` later, after a barrier."""
    path = rank_path(directory, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_checked(path, {"format": FORMAT, "step": step, "rank": rank, **state})
    return path


def load_rank_state(directory: str | os.PathLike, step: int, rank: int) -> dict[str, Any]:
    """Rank `rank`'s own state at `step`, loaded without running pickled code."""
    path = rank_path(directory, step, rank)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: was the checkpoint written by as many ranks as "
                              f"this run has (rank {rank} is missing)?")
    return read_checked(path, {"format": FORMAT, "rank": rank}, f"rank {rank}'s {FORMAT} file")


# ---------------------------------------------------------------------------------------
# every rank agrees
# ---------------------------------------------------------------------------------------
AGREE_BYTES = 2048                    # of each rank's error message (longer ones are cut)


def all_ranks_agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank when `error` (this rank's, None on success at `what`) happened on any
    rank; return on every rank otherwise, so one rank's failure ends the job at once instead of
    at the others' next collective's timeout.

    One collective over the world: comm.all_gather of AGREE_BYTES of each rank's message (tag
    "agree"). Every rank raises the same CheckpointError: the message when all failed alike, else
    each failed rank's, by rank (launch.print_once prints it once). No process group: `error` raised."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    if error is None:
        text = ""                                         # all zeros: this rank succeeded
    elif isinstance(error, CheckpointError):
        text = str(error) or "CheckpointError"
    else:
        text = f"{type(error).__name__}: {error}"
    mine = torch.tensor(list(text.encode()[:AGREE_BYTES].ljust(AGREE_BYTES, b"\0")), dtype=torch.uint8)
    rows = comm.all_gather(mine, None, tag="agree").view(-1, AGREE_BYTES)
    failed = {r: bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for r, row in enumerate(rows)
              if bool(row.any())}
    if not failed:
        return
    if len(failed) == len(rows) and len(set(failed.values())) == 1:
        message = next(iter(failed.values()))
    else:
        message = f"{what} failed on {len(failed)} of {len(rows)} ranks: " + \
                  "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
    raise CheckpointError(message) from error


# ---------------------------------------------------------------------------------------
# one run writes a directory
# ---------------------------------------------------------------------------------------
class SaveDirLock:
    """The lock of a save directory (lock_save_dir). `previous`: what the lock file said when
    it was taken, when its owner had not released it (it was killed), else None."""

    def __init__(self, file, path: Path, previous: dict | None):
        self.file, self.path, self.previous = file, path, previous

    def release(self) -> None:
        """Empty the lock file (a released lock names nobody) and unlock it."""
        if self.file is None:
            return
        self.file.truncate(0)
        self.file.flush()
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()
        self.file = None


def _owner(text: str) -> dict | None:
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:
        return {"pid": "?", "host": "?", "started": "?", "command": text.strip()[:200]}


def lock_save_dir(directory: str | os.PathLike) -> SaveDirLock:
    """Take the lock of `directory` (created if needed) for this process, the one of its run that
    writes `latest`; CheckpointError naming the owner when another process holds it.

    An exclusive flock(2) on `directory`/minimegatron.lock, whose text names the holder (pid, host,
    start time, command line). The kernel releases it when the holder dies, so a dead owner's lock
    is taken over (`previous` says whose it was), with no pid reuse or other-host confusion."""
    directory = Path(directory)
    check_save_dir(directory)
    path = directory / LOCK_FILE
    if fcntl is None:                                    # pragma: no cover
        return SaveDirLock(None, path, None)
    file = open(path, "a+")                              # created if missing; never truncated by opening
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        file.seek(0)
        owner = _owner(file.read()) or {"pid": "?", "host": "?", "started": "?", "command": "?"}
        file.close()
        raise CheckpointError(f"save_dir {directory} is being written by another run: pid {owner.get('pid')} on "
                              f"host {owner.get('host')}, started {owner.get('started')} ({owner.get('command')}); two "
                              f"runs saving into one directory would mix their checkpoints: wait for that run to "
                              f"end, stop it, or give another --save") from None
    file.seek(0)
    previous = _owner(file.read())
    file.truncate(0)
    file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "command": " ".join(sys.argv)[:300]}) + "\n")
    file.flush()
    return SaveDirLock(file, path, previous)
