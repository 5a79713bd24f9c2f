"""Chapter 07's case study: profile the baseline, change what the profile points at, measure.

    python benchmarks/bench_case_study.py                 # under a minute, one thread
    python benchmarks/bench_case_study.py --presets demo  # only the larger preset
    python benchmarks/bench_case_study.py --trace-dir runs/case_study   # also a Chrome trace per variant
    python benchmarks/bench_case_study.py --smoke         # tiny, one window: checks that it runs

The baseline is the training command's step on one process, float32, the byte vocabulary of
257 ids: `python -m minimegatron.train` (its default preset, tiny: LLaMA style, h 32, 2 layers,
4 heads, s 32, micro-batch 4) and `--preset demo` (h 96, 3 layers, 6 heads, 2 key/value groups,
s 64, micro-batch 8). Each one's step, exactly as the loop runs it (parallelize.build_model,
build_optimizer, train.train_step), in four variants, each one of the training command's flags:

  baseline                    (no flag)
  fused AdamW                 --adam-impl fused      torch's one-kernel AdamW
  compiled layers             --kernels compile      each layer through torch.compile
  both                        --adam-impl fused --kernels compile

For the baseline and for "both" it first profiles a few steps (torch.profiler) and prints the
operators by their own time, the share of the matrix products, the optimizer's share and the
number of operator calls a step; then it times the four in interleaved windows (a busy moment
of a shared machine slows them all) and prints each one's step time (median and best window)
and its speed-up over the baseline. The random batch has the preset's shapes (the data does not
change the time of a step).

This is a measurement: nothing asserts a speed here. Chapter 07 records one run of it
(chapters/07_kernels/make_figures.py, RUNS "case-study") and quotes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# Inductor keeps compiled code in a cache (/tmp/torchinductor_<user>): a second run would report
# the cache's speed, not the compiler's. Off here, so "built and warmed up" is a cold compile.
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minimegatron.arguments import PRESETS                                  # noqa: E402
from minimegatron.config import ModelConfig, TrainConfig                    # noqa: E402
from minimegatron.parallel_state import Layout                              # noqa: E402
from minimegatron.parallelize import build_model, build_optimizer          # noqa: E402
from minimegatron.train import train_step                                   # noqa: E402
from machine import load_average                                            # noqa: E402  (benchmarks/machine.py)

VARIANTS = {"baseline": {}, "fused AdamW": dict(adam_impl="fused"), "compiled layers": dict(kernels="compile"),
            "both": dict(adam_impl="fused", kernels="compile")}
GEMMS = ("aten::mm", "aten::addmm", "aten::bmm")


@dataclass
class CaseStudyResults:
    """What main printed, by preset: built_s (variant: seconds to build and warm up), profiles
    (baseline, both: {ms, calls, gemm, optimizer}, a step and shares of it), median_ms, best_ms
    and speedup (over the baseline's median) by variant."""
    exit_code: int = 0
    presets: dict = field(default_factory=dict)


def preset(name: str, smoke: bool) -> tuple[ModelConfig, TrainConfig]:
    model_over, train_over = PRESETS[name]
    model = ModelConfig.llama(vocab_size=257, **model_over)
    train = TrainConfig(**{**train_over, "progress": False, "eval_interval": 0})
    if smoke:
        model = dataclasses.replace(model, hidden_size=32, num_layers=1, num_attention_heads=4, num_query_groups=2)
        train = dataclasses.replace(train, seq_length=16, micro_batch_size=2)
    return model, train


def make_step(model_cfg: ModelConfig, train_cfg: TrainConfig, batch: dict):
    """The loop's own step on one process: a closure that runs one training step."""
    torch.manual_seed(0)
    layout = Layout()
    chunks = build_model(model_cfg, train_cfg, layout)
    optimizer = build_optimizer(chunks, train_cfg, layout)
    return lambda: train_step(chunks, optimizer, [batch], layout, train_cfg.lr)


def profile_lines(name: str, step, steps: int, trace_dir: Path | None) -> tuple[list[str], dict]:
    """(lines, {ms, calls, gemm, optimizer}): a step's recorded time and operator calls, and the
    shares of the matrix products and the optimizer's step."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_dir / f"{name.replace(' ', '_')}.json"))
    events = prof.key_averages()
    ops = [e for e in events if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)                     # every event's own time
    calls = sum(e.count for e in ops)
    gemm = sum(e.self_cpu_time_total for e in ops if e.key in GEMMS)
    optimizer = sum(e.cpu_time_total for e in events if e.key.startswith("Optimizer.step#"))
    found = dict(ms=total / steps / 1e3, calls=calls / steps, gemm=gemm / total, optimizer=optimizer / total)
    lines = [f"[profile] {name}: {steps} steps, {found['ms']:.1f} ms of recorded time a step, "
             f"{found['calls']:.0f} operator calls a step",
             f"  matrix products {found['gemm']:.0%} of the time, the optimizer's step {found['optimizer']:.0%}; "
             f"operators by their own time:"]
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:8]:
        lines.append(f"    {e.key:<48} {e.self_cpu_time_total / total:6.1%}  {e.count / steps:6.0f} calls a step")
    return lines, found


def case_study(name: str, args: argparse.Namespace) -> dict:
    """One preset's build times, profiles and step times (CaseStudyResults.presets[name])."""
    model_cfg, train_cfg = preset(name, args.smoke)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model_cfg.vocab_size, (train_cfg.micro_batch_size, train_cfg.seq_length + 1),
                           generator=gen)
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    print(f"== --preset {name}{' (shrunk by --smoke)' if args.smoke else ''} (h {model_cfg.hidden_size}, "
          f"layers {model_cfg.num_layers}, s {train_cfg.seq_length}, "
          f"micro-batch {train_cfg.micro_batch_size}, V {model_cfg.vocab_size}, float32), one process, one thread; "
          f"load average {load_average()}")
    steps, found = {}, dict(built_s={}, profiles={}, median_ms={}, best_ms={}, speedup={})
    for variant, flags in VARIANTS.items():
        start = time.perf_counter()
        steps[variant] = make_step(model_cfg, dataclasses.replace(train_cfg, **flags), batch)
        for _ in range(3):                                       # warm-up; the compiled ones compile here
            steps[variant]()
        found["built_s"][variant] = time.perf_counter() - start
        print(f"  built and warmed up {variant:<16} in {found['built_s'][variant]:5.1f} s", flush=True)
    for variant in ("baseline", "both"):
        lines, found["profiles"][variant] = profile_lines(variant, steps[variant], max(args.steps, 2),
                                                          args.trace_dir / name if args.trace_dir else None)
        print("\n".join(lines), flush=True)
    times: dict[str, list[float]] = {variant: [] for variant in steps}
    for _ in range(args.repeats):
        for variant, step in steps.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[variant].append((time.perf_counter() - start) / args.steps)
    base = statistics.median(times["baseline"])
    print(f"[time] a training step, {args.repeats} interleaved windows of {args.steps} steps "
          f"(median; best in brackets); load average {load_average()}:")
    for variant, t in times.items():
        median = statistics.median(t)
        found["median_ms"][variant], found["best_ms"][variant] = median * 1e3, min(t) * 1e3
        found["speedup"][variant] = base / median
        print(f"  {variant:<16} {median * 1e3:7.2f} ms  ({min(t) * 1e3:7.2f} ms)   {base / median:.2f} x the baseline")
    return found


def main(argv: list[str] | None = None) -> CaseStudyResults:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=["tiny", "demo"],
                   help="the training command's presets to take through it (default tiny demo)")
    p.add_argument("--repeats", type=int, default=15, help="timed windows per variant (default 15)")
    p.add_argument("--steps", type=int, default=5, help="steps per window (default 5)")
    p.add_argument("--trace-dir", type=Path, default=None, help="write a Chrome trace of each profiled variant here")
    p.add_argument("--smoke", action="store_true", help="tiny model, one window: checks that it runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.repeats, args.steps = 1, 1
    torch.set_num_threads(1)
    return CaseStudyResults(presets={name: case_study(name, args) for name in args.presets})


if __name__ == "__main__":
    sys.exit(main().exit_code)
