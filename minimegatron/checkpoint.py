"""Save and resume a training run, exactly.

A checkpoint is one file `iter_{step:07d}.pt` in a directory, plus a text file `latest`
naming the newest one (Megatron keeps `latest_checkpointed_iteration.txt` for the same job).
It holds everything that decides the rest of the run:

  model and optimizer state   the numbers being trained
  step                        which global batch comes next (the data order is a pure
                              function of the step, see data.gpt_dataset.batch_for_step)
  RNG state                   dropout masks after resuming equal the uninterrupted run's
  configs                     a checkpoint from another model is refused, by field
  history                     the loss curve so far, so the plot continues

With data parallelism over n > 1 ranks, each rank also writes `iter_{step:07d}.rank{r}.pt`
with what only it holds: its optimizer state (a shard under ZeRO) and its RNG state. Every
rank writes its file, all ranks meet at a barrier, and only then does rank 0 write the main
file and move `latest`: a checkpoint that `latest` names is always complete. Resuming needs
the same number of ranks (resharding a checkpoint is the capstone's subject).

Safety rules:
  - written to a temporary name and renamed: a crash while saving never destroys the
    previous checkpoint (rename is atomic on POSIX filesystems); the `*.tmp` files a killed
    save leaves behind are removed by the next save_checkpoint in that directory;
  - resuming from a directory that holds no checkpoint (missing, a file, or no `latest`)
    warns and trains from scratch, as Megatron's `--load` does ("could not find the metadata
    file ... will start from random"); a `latest` that is empty or names a missing file is
    an error;
  - loaded with `torch.load(weights_only=True)`: tensors, numbers, strings and containers
    only, never code from a pickle.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

FORMAT = "minimegatron-checkpoint-v1"


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or from another model."""


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Delete the `*.tmp` files that saves killed half-way left in `directory`; returns them.

    Only safe while nothing else writes to the directory: train calls save_checkpoint on
    rank 0 after the barrier that follows every rank's own file, so no save is in flight."""
    stale = sorted(Path(directory).glob("*.tmp"))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def save_checkpoint(directory: str | os.PathLike, step: int, state: dict[str, Any]) -> Path:
    """Write `state` (plus the step and format tag) as iter_{step}.pt and point `latest` at it.

    First removes the `*.tmp` files earlier saves left when they were killed (see
    remove_stale_temporaries: no other save may be writing to the directory)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(directory)
    path = directory / f"iter_{step:07d}.pt"
    payload = {"format": FORMAT, "step": step, **state}
    _atomic_write(path, lambda tmp: torch.save(payload, tmp))
    _atomic_write(directory / "latest", lambda tmp: tmp.write_text(path.name + "\n"))
    return path


def latest_checkpoint(directory: str | os.PathLike, *, warn: bool = True) -> Path | None:
    """The file `latest` points at, or None when the directory holds no checkpoint.

    With `warn` (the default, how a run's --load-dir is read), None comes with a
    UserWarning saying why (no such directory, a file, no `latest`) and that the run starts
    from scratch, printed by rank 0 only. CheckpointError when `latest` is empty or names a
    file that does not exist."""
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
    if not path.is_file():
        raise CheckpointError(f"{pointer} names {name}, which does not exist in {directory}")
    return path


def load_checkpoint(path: str | os.PathLike, *, model_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load a checkpoint file (or the latest one in a directory) without running pickled code.

    If `model_config` is given, the checkpoint's stored model config must equal it; otherwise
    CheckpointError lists the differing fields, e.g. "hidden_size: checkpoint 64, run 128".
    """
    path = Path(path)
    if path.is_dir():
        found = latest_checkpoint(path, warn=False)
        if found is None:
            raise CheckpointError(f"no checkpoint in {path} (no 'latest' file)")
        path = found
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: say which, keep the cause
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} file")
    if model_config is not None:
        stored = state.get("model_config", {})
        diffs = [f"{k}: checkpoint {stored.get(k)!r}, run {v!r}"
                 for k, v in model_config.items() if stored.get(k) != v]
        if diffs:
            raise CheckpointError(f"checkpoint {path} is from another model: " + "; ".join(diffs))
    return state


def rank_path(directory: str | os.PathLike, step: int, rank: int) -> Path:
    """The file holding rank `rank`'s own state at `step`."""
    return Path(directory) / f"iter_{step:07d}.rank{rank}.pt"


def save_rank_state(directory: str | os.PathLike, step: int, rank: int, state: dict[str, Any]) -> Path:
    """Write one rank's own state (atomically); rank 0 moves `latest` later, after a barrier."""
    path = rank_path(directory, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, lambda tmp: torch.save({"format": FORMAT, "step": step, "rank": rank, **state}, tmp))
    return path


def load_rank_state(directory: str | os.PathLike, step: int, rank: int) -> dict[str, Any]:
    """Rank `rank`'s own state at `step`, loaded without running pickled code."""
    path = rank_path(directory, step, rank)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: was the checkpoint written by as many ranks as "
                              f"this run has (rank {rank} is missing)?")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    if state.get("format") != FORMAT or state.get("rank") != rank:
        raise CheckpointError(f"{path} is not rank {rank}'s {FORMAT} file")
    return state
