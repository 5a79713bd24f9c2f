"""`--profile` (chapter 07): torch.profiler over a few steps of any layout (Megatron's
`--profile --use-pytorch-profiler`).

    with StepProfiler(cfg, rank, out_dir) as profiler:   # the training loop
        for step in ...:
            train_step(...)
            profiler.step()

Schedule: wait until profile_step_start, warm up on the step before it, record the steps
[profile_step_start, profile_step_end) (counted from 0); then each rank in profile_ranks (all
when empty) writes `<out_dir>/torch_profile/rank-<r>.json.gz` (chrome://tracing, Perfetto) and
rank 0 prints the operators that took the most time.

Megatron: megatron/training/training.py (the torch.profiler schedule).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

__all__ = ["StepProfiler"]


class StepProfiler:
    """torch.profiler over steps [cfg.profile_step_start, cfg.profile_step_end) of this rank
    (nothing when cfg.profile is off or the rank is not in cfg.profile_ranks). `trace` is the
    Chrome trace written, `table` rank 0's top operators, once the last step has been recorded."""

    def __init__(self, cfg, rank: int, out_dir: str | Path):
        self.on = cfg.profile and (not cfg.profile_ranks or rank in cfg.profile_ranks)
        self.rank, self.trace, self.table, self.prof = rank, None, None, None
        if not self.on:
            return
        start, end = cfg.profile_step_start, cfg.profile_step_end
        self.trace = Path(out_dir) / "torch_profile" / f"rank-{rank}.json.gz"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.prof = profile(activities=activities, on_trace_ready=self._write, schedule=schedule(
            wait=max(start - 1, 0), warmup=1 if start > 0 else 0, active=end - start, repeat=1))

    def _write(self, prof: profile) -> None:
        self.trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.trace))
        if self.rank == 0:                  # the operators that took the most time, self time first
            self.table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)

    def __enter__(self) -> "StepProfiler":
        if self.on:
            self.prof.start()
        return self

    def step(self) -> None:
        """After each training step."""
        if self.on:
            self.prof.step()

    def __exit__(self, *exc) -> None:
        if self.on:
            self.prof.stop()
