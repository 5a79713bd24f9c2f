"""Random numbers under tensor parallelism: which dropout masks must agree across ranks.

A tensor-parallel group holds two kinds of activations (shape legend as in model/gpt.py):

  replicated  the residual stream [b, s, h], e.g. the output of a RowParallelLinear after
              its all-reduce. Every rank of the group holds the SAME full tensor.
  sharded     the activations between a column- and a row-parallel layer, e.g. the
              attention probabilities of this rank's heads [b, a/tp, s, s] or the MLP
              activation [b, s, f/tp]. Rank r holds part r of a larger tensor.

Dropout on each kind needs a different random stream:

  * On a REPLICATED tensor every rank must draw the SAME mask. The replicas are meant to be
    one tensor stored tp times; with different masks they stop being equal after the first
    dropout, and since every later layer reads its own copy, the ranks' residual streams
    (and then their gradients) drift apart: the group no longer computes one model.
  * On a SHARDED tensor every rank must draw a DIFFERENT mask. The shards are different
    pieces of one full tensor, whose mask should be independent Bernoulli draws everywhere.
    The same stream on every rank would cut the same pattern into every shard: head 0 of
    rank 0 and head 0 of rank 1 would always drop the same positions, a mask correlated
    with itself, which is a different (and wrong) regulariser from the single-device one.

So there are two streams. torch's default CPU generator is the shared one, seeded with the
same value on every rank of a group; the tracker holds named extra streams and ``fork``
swaps one in for the duration of a block:

    model_parallel_manual_seed(seed, tp_rank)
    y = F.dropout(row_parallel_out, p)              # default stream: same on the group
    with get_rng_tracker().fork():                  # "model-parallel-rng": per TP rank
        probs = F.dropout(local_head_probs, p)

Seeds, as in Megatron-LM (megatron/training/initialize.py ``_set_random_seed`` adds the
pipeline offset, then megatron/core/tensor_parallel/random.py
``model_parallel_cuda_manual_seed`` derives the TP stream from the offset seed):

    base                 = seed + 100 * pp_rank        (pipeline stages hold different layers)
    default generator    = base                        same on all TP ranks (and DP ranks)
    "model-parallel-rng" = base + 2718 + tp_rank       differs across the TP group, equal on
                                                       ranks with the same tp_rank in other
                                                       DP groups

The DP ranks therefore draw the same masks too; they apply them to different samples.
(Megatron's optional ``data_parallel_random_init`` adds 10 * dp_rank to the base; its
"expert-parallel-rng" and "data-parallel-rng" streams are left out here.)

Megatron-LM: megatron/core/tensor_parallel/random.py (CudaRNGStatesTracker,
model_parallel_cuda_manual_seed, get_cuda_rng_tracker). Difference: Megatron swaps the CUDA
generator and leaves the CPU one alone; on this CPU-only book the default CPU generator is
the one every dropout uses, so it is the one swapped.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["RNGStatesTracker", "get_rng_tracker", "model_parallel_manual_seed",
           "MODEL_PARALLEL_RNG", "TP_SEED_OFFSET", "PP_SEED_STRIDE"]

MODEL_PARALLEL_RNG = "model-parallel-rng"  # Megatron's _MODEL_PARALLEL_RNG_TRACKER_NAME
TP_SEED_OFFSET = 2718   # Megatron: "any POSITIVE value will work"; kept for the same numbers
PP_SEED_STRIDE = 100    # Megatron's training/initialize.py: stage s adds 100 * s
_DEFAULT = "default"    # name of "no stream forked": torch's own generator state


class RNGStatesTracker:
    """Named random streams that can be swapped into torch's default CPU generator.

    A stream is a generator state (a uint8 tensor, ``torch.Generator.get_state()``); the
    tracker owns the states, torch's default generator is the one that draws.

    ``add(name, seed)``  creates stream ``name`` from ``seed``. Neither name nor seed may be
                         used already (two streams from one seed would be the same
                         stream). Does not touch the default generator.
    ``fork(name)``       context manager: on entry saves the default generator's state and
                         loads stream ``name``; on exit stores the advanced state back as
                         ``name`` (the next fork continues where this one stopped) and
                         restores the saved state, so code outside the block sees the
                         default stream exactly as if the block had not run. Restores also
                         when the block raises. Forks nest; forking the stream already
                         active just continues it.
    ``get_states()``     {name: state} copies, for a checkpoint. The default generator is
                         not included: save ``torch.get_rng_state()`` beside it, as
                         Megatron's checkpoint does.
    ``set_states(s)``    replaces all streams by copies of ``s`` (checkpoint resume).
    ``reset()``          forgets every stream and seed.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()
        self._active = _DEFAULT  # which stream torch's default generator is drawing now

    def is_initialized(self) -> bool:
        return bool(self._states)

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
            torch.set_rng_state(self._states[outer_name] if outer_name != _DEFAULT
                                else outer_state)


_RNG_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (Megatron's get_cuda_rng_tracker): one per rank, shared by
    every layer, so each dropout site advances the same per-rank stream."""
    return _RNG_TRACKER


def model_parallel_manual_seed(seed: int, tp_rank: int | None = None,
                               pp_rank: int = 0) -> None:
    """Seed both streams of this rank (Megatron's _set_random_seed +
    model_parallel_cuda_manual_seed); call once per rank instead of torch.manual_seed.

    ``tp_rank`` None: read from ``parallel_state`` (which must be initialized).
    Effect, with base = seed + 100 * pp_rank:
      torch.manual_seed(base)                      the shared stream (replicated tensors)
      tracker reset, then add("model-parallel-rng", base + 2718 + tp_rank)
                                                   the per-TP-rank stream (sharded tensors)
    Raises ValueError for a negative seed or rank.
    """
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
