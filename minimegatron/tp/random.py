"""Random numbers under tensor parallelism: which dropout masks must agree across ranks.

Dropout on a REPLICATED tensor (the residual stream [b, s, h]) must draw the same mask on
every rank of the group; on a SHARDED one ([b, a/tp, s, s] probabilities, [b, s, f/tp]) a
different mask per rank (chapter 02 says why). So two streams: torch's default CPU generator,
seeded alike on the group, and a tracker's named streams that ``fork`` swaps in for a block:

    model_parallel_manual_seed(seed, tp_rank)
    y = F.dropout(row_parallel_out, p)              # default stream: same on the group
    with get_rng_tracker().fork():                  # "model-parallel-rng": per TP rank
        probs = F.dropout(local_head_probs, p)

Seeds: base = seed + 100 * pp_rank; default generator = base; "model-parallel-rng" =
base + 2718 + tp_rank (DP ranks draw the same masks).

Megatron-LM: megatron/core/tensor_parallel/random.py (CudaRNGStatesTracker; it swaps the CUDA
generator, this book the CPU one)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["RNGStatesTracker", "get_rng_tracker", "model_parallel_manual_seed", "MODEL_PARALLEL_RNG", "TP_SEED_OFFSET"]

MODEL_PARALLEL_RNG = "model-parallel-rng"  # Megatron's _MODEL_PARALLEL_RNG_TRACKER_NAME
TP_SEED_OFFSET = 2718   # Megatron: "any POSITIVE value will work"; kept for the same numbers
PP_SEED_STRIDE = 100    # Megatron's training/initialize.py: stage s adds 100 * s
_DEFAULT = "default"    # name of "no stream forked": torch's own generator state


class RNGStatesTracker:
    """Named random streams (torch.Generator states, uint8 tensors) swapped into torch's default CPU generator.

    ``add(name, seed)``  new stream; name and seed must both be unused. Leaves the default alone.
    ``fork(name)``       context: load stream ``name``; on exit (also on raise) store its advanced
                         state back and restore the default generator as if the block had not run.
                         Forks nest; forking the active stream continues it.
    ``get_states()``     {name: state} copies (not the default generator's: save torch.get_rng_state()).
    ``set_states(s)``    replace all streams by copies of ``s``.  ``reset()`` forget all."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()
        self._active = _DEFAULT  # which stream torch's default generator is drawing now

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} is already used by another RNG stream")
        self._seeds.add(seed)
        # a private generator: seeding it leaves the default generator untouched
        self._states[name] = torch.Generator().manual_seed(seed).get_state()

    def get_states(self) -> dict[str, torch.Tensor]:
        # inside a fork the active stream's latest state is in the generator, not the dict
        if self._active != _DEFAULT:
            self._states[self._active] = torch.get_rng_state()
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        if self._active != _DEFAULT:
            raise RuntimeError(f"set_states inside fork({self._active!r}): the fork would "
                               "overwrite the restored state on exit")
        self._states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self._states:
            known = ", ".join(map(repr, self._states)) or "none"
            raise KeyError(f"RNG stream {name!r} was not added (known: {known}); call "
                           "model_parallel_manual_seed(...) or tracker.add(name, seed) first")
        outer_name, outer_state = self._active, torch.get_rng_state()
        if outer_name != _DEFAULT:
            # nested fork: the outer stream has advanced; keep it so the outer fork resumes it
            self._states[outer_name] = outer_state
        torch.set_rng_state(self._states[name])
        self._active = name
        try:
            yield
        finally:
            self._states[name] = torch.get_rng_state()
            self._active = outer_name
            # read back from the dict: for a same-name nested fork it holds the advanced state
            torch.set_rng_state(self._states[outer_name] if outer_name != _DEFAULT else outer_state)


_RNG_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process's one tracker (Megatron's get_cuda_rng_tracker), shared by every layer."""
    return _RNG_TRACKER


def model_parallel_manual_seed(seed: int, tp_rank: int | None = None, pp_rank: int = 0) -> None:
    """Seed both streams of this rank, instead of torch.manual_seed: torch.manual_seed(base), then
    tracker reset and add("model-parallel-rng", base + 2718 + tp_rank), base = seed + 100 * pp_rank.
    ``tp_rank`` None: from parallel_state. ValueError for a negative seed or rank.
    Megatron: _set_random_seed + model_parallel_cuda_manual_seed."""
    if tp_rank is None:
        from ..parallel_state import get_tensor_model_parallel_rank
        tp_rank = get_tensor_model_parallel_rank()
    for what, value in (("seed", seed), ("tp_rank", tp_rank), ("pp_rank", pp_rank)):
        if value < 0:
            raise ValueError(f"model_parallel_manual_seed: {what} must be >= 0, got {value}")
    base = seed + PP_SEED_STRIDE * pp_rank
    torch.manual_seed(base)
    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, base + TP_SEED_OFFSET + tp_rank)
