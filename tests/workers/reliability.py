"""A torchrun entry for tests/test_reliability.py: `python -m minimegatron.train`'s main, with
a fault injected where the test asks for one.

    python -m torch.distributed.run --nproc_per_node=N tests/workers/reliability.py MODE [FLAG ...]

MODE
  main         every rank prints "rank R pid P at T" (flushed: the test reads the pids and the
               time the ranks were ready), then runs train.main(FLAGS)
  hang:R:K     the same, and rank R hangs at the start of iteration K, as a rank stuck in its
               own code: it prints "rank R hangs at T" and sleeps for an hour
"""

from __future__ import annotations

import os
import sys
import time

from minimegatron import train


def _hang_at(iteration: int) -> None:
    """Replace train.train_step (the loop looks it up in the module at every iteration) by one
    that sleeps at its `iteration`-th call."""
    real, calls = train.train_step, [0]

    def train_step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == iteration:
            print(f"rank {os.environ['RANK']} hangs at {time.time():.3f}", flush=True)
            time.sleep(3600)
        return real(*args, **kwargs)

    train.train_step = train_step


def main(mode: str, flags: list[str]) -> int:
    rank = int(os.environ["RANK"])
    if mode.startswith("hang:"):
        _, who, iteration = mode.split(":")
        if rank == int(who):
            _hang_at(int(iteration))
    print(f"rank {rank} pid {os.getpid()} at {time.time():.3f}", flush=True)
    return train.main(flags)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
