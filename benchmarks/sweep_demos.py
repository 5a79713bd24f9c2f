"""Run the chapter demos over their documented flag space and print run -> verdict, exit code.

Issue 32: two valid runs reported MISMATCH (a float32 model held to a float64 threshold, an FP8
layout to a tolerance tuned to another run), and an FP8 flag under --precision bf16 was
silently ignored. This sweep is the check that no documented combination does either:

    python benchmarks/sweep_demos.py                 (or: make sweep-demos)
    python benchmarks/sweep_demos.py --list          the runs, without running them
    python benchmarks/sweep_demos.py --only "06 "    the runs whose name contains "06 " (or any of several)

Chapters 06 and 07: every precision x FP8 recipe x format, every recompute granularity, method
and module set, and each kernel path, over the layouts their help offers (tp, sp, cp, pp, ep,
dp, ZeRO), at --quick size. Chapters 01-05 and 08: each demo's main layout flags, --quick.
The combinations a demo must refuse (a flag that would have no effect) are listed with the
exit code 2 they must give, before any rank starts. A run passes when its exit code is the
expected one and, for exit 0, its last line starts with MATCH. The exit status is 1 when any
run did not pass. Logs go to --log-dir (default runs/sweep/<name>.log). About 40 minutes on
2 cores, one run at a time (most spawn 4 ranks; the Triton runs interpret their kernels).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class SweepRun:
    name: str
    chapter: str            # "06": chapters/06_*/demo.py
    args: str
    exit_code: int = 0      # 0: MATCH; 2: refused before any rank starts

    def command(self) -> list[str]:
        demo = next((ROOT / "chapters").glob(f"{self.chapter}_*/demo.py"))
        return [sys.executable, str(demo.relative_to(ROOT)), *shlex.split(self.args)]


def chapter06_runs() -> list[SweepRun]:
    layouts = {"tp2-dp2": "--tp 2 --dp 2", "tp2-sp-pp2": "--tp 2 --sp --pp 2 --dp 1",
               "tp2-sp-cp2": "--tp 2 --sp --cp 2 --dp 1", "tp1-dp4": "--tp 1 --dp 4"}
    runs = [SweepRun(f"06 {p} {name}", "06", f"--quick --precision {p} {flags}")
            for p in ("fp32", "bf16", "fp16") for name, flags in layouts.items()]
    runs.append(SweepRun("06 bf16 zero1 tp1-dp4", "06", "--quick --zero-stage 1 --tp 1 --dp 4"))
    runs.append(SweepRun("06 bf16 tp2-sp-ep2-dp2", "06", "--quick --precision bf16 --tp 2 --sp --ep 2 --dp 2"))
    for recipe in ("tensorwise", "delayed", "blockwise", "mxfp8"):
        for fmt in ("hybrid", "e4m3"):
            runs.append(SweepRun(f"06 fp8 {recipe} {fmt} tp2-sp-dp2", "06",
                                 f"--quick --precision fp8 --fp8-recipe {recipe} --fp8-format {fmt} --tp 2 --sp --dp 2"))
        runs.append(SweepRun(f"06 fp8 {recipe} hybrid tp2-sp-cp2", "06",
                             f"--quick --precision fp8 --fp8-recipe {recipe} --tp 2 --sp --cp 2 --dp 1"))
        runs.append(SweepRun(f"06 fp8 {recipe} hybrid tp2-pp2", "06",
                             f"--quick --precision fp8 --fp8-recipe {recipe} --tp 2 --pp 2 --dp 1"))
        runs.append(SweepRun(f"06 fp8 {recipe} hybrid tp2-sp-ep2-dp2", "06",
                             f"--quick --precision fp8 --fp8-recipe {recipe} --tp 2 --sp --ep 2 --dp 2"))
    runs += [SweepRun("06 fp8 delayed e4m3 tp2-dp4 (issue 32)", "06", "--fp8-format e4m3 --fp8-recipe delayed --dp 4"),
             SweepRun("06 fp8 delayed hybrid tp1-dp4 zero1", "06",
                      "--quick --precision fp8 --fp8-recipe delayed --tp 1 --dp 4 --zero-stage 1"),
             SweepRun("06 fp8 tensorwise 5d (16 ranks)", "06",
                      "--quick --precision fp8 --fp8-recipe tensorwise --tp 2 --sp --cp 2 --pp 2 --ep 2 --dp 2"),
             SweepRun("06 refused: bf16 with --fp8-recipe", "06", "--precision bf16 --fp8-recipe mxfp8", 2),
             SweepRun("06 refused: fp16 with --fp8-format", "06", "--precision fp16 --fp8-format e4m3", 2)]
    return runs


def chapter07_runs() -> list[SweepRun]:
    recomputes = {"none": "--recompute none", "full uniform": "--recompute full",
                  "full block 2": "--recompute full --recompute-method block --recompute-num-layers 2",
                  "selective core_attn": "--recompute selective",
                  "selective core_attn mlp layernorm": "--recompute selective --recompute-modules core_attn mlp layernorm"}
    runs = [SweepRun(f"07 {name} tp2-sp-dp2", "07", f"--quick {flags} --tp 2 --sp --dp 2")
            for name, flags in recomputes.items()]
    runs += [SweepRun("07 full block 1 tp2-sp-pp2", "07",
                      "--quick --recompute full --recompute-method block --tp 2 --sp --pp 2 --dp 1"),
             SweepRun("07 selective core_attn mlp tp2-sp-cp2", "07",
                      "--quick --recompute selective --recompute-modules core_attn mlp --tp 2 --sp --cp 2 --dp 1"),
             SweepRun("07 selective moe moe_act tp2-sp-ep2-dp2", "07",
                      "--quick --recompute selective --recompute-modules moe moe_act --tp 2 --sp --ep 2 --dp 2"),
             SweepRun("07 pack selective tp2-sp-dp2", "07", "--quick --pack --recompute selective --tp 2 --sp --dp 2"),
             SweepRun("07 compile tp2-sp-dp2", "07", "--quick --kernels compile --tp 2 --sp --dp 2"),
             SweepRun("07 triton full pack tp2-dp2 (issue 32)", "07", "--quick --kernels triton --pack"),
             SweepRun("07 triton selective tp2-sp-dp2", "07", "--quick --kernels triton --recompute selective --tp 2 "
                                                               "--sp --dp 2"),
             SweepRun("07 refused: --recompute-method with selective", "07",
                      "--recompute selective --recompute-method block", 2),
             SweepRun("07 refused: --recompute-modules with full", "07", "--recompute full --recompute-modules mlp", 2),
             SweepRun("07 refused: --recompute-num-layers with none", "07", "--recompute none --recompute-num-layers 2",
                      2)]
    return runs


def other_runs() -> list[SweepRun]:
    return ([SweepRun(f"01 zero {z}", "01", f"--quick --zero {z}") for z in ("0", "1", "2", "3")] +
            [SweepRun("01 ddp naive", "01", "--quick --zero 0 --ddp naive"),
             SweepRun("02 tp2-dp2", "02", "--quick --tp 2 --dp 2"), SweepRun("02 tp4", "02", "--quick --tp 4 --dp 1")] +
            [SweepRun(f"03 {s} pp2-dp2", "03", f"--quick --schedule {s} --pp 2 --dp 2") for s in ("gpipe", "1f1b")] +
            [SweepRun("03 interleaved pp2 chunks 2", "03", "--quick --schedule interleaved --chunks 2 --pp 2 --dp 1")] +
            [SweepRun(f"04 cp2 {c}", "04", f"--quick --cp 2 --cp-comm-type {c} --dp 1")
             for c in ("p2p", "all_gather", "a2a")] +
            [SweepRun("04 tp2-sp-cp2", "04", "--quick --tp 2 --sp --cp 2 --dp 1")] +
            [SweepRun(f"05 ep2 {d}", "05", f"--quick --ep 2 --dispatcher {d}") for d in ("alltoall", "allgather")] +
            [SweepRun("08 quick", "08", "--quick")])


def all_runs() -> list[SweepRun]:
    return chapter06_runs() + chapter07_runs() + other_runs()


def run_one(run: SweepRun, log_dir: Path, timeout: float) -> tuple[str, int | None, float]:
    """(verdict: MATCH / MISMATCH / refused / no verdict / time-out, exit code, seconds)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    try:
        proc = subprocess.run(run.command(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        (log_dir / f"{slug(run.name)}.log").write_text(f"{e.stdout or ''}\n{e.stderr or ''}\ntime-out after {timeout} s\n")
        return "time-out", None, time.perf_counter() - start
    output = proc.stdout + proc.stderr
    (log_dir / f"{slug(run.name)}.log").write_text(" ".join(run.command()) + "\n" + output)
    last = next((line for line in reversed(proc.stdout.splitlines()) if line.strip()), "")
    verdict = ("MATCH" if last.startswith("MATCH") else "MISMATCH" if last.startswith("MISMATCH") else
               "refused" if proc.returncode == 2 and "error:" in output else "no verdict")
    return verdict, proc.returncode, time.perf_counter() - start


def passed(run: SweepRun, verdict: str, code: int | None) -> bool:
    return code == run.exit_code and verdict == ("MATCH" if run.exit_code == 0 else "refused")


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=[""], help="run only the runs whose name contains one of these")
    parser.add_argument("--list", action="store_true", help="print the runs and their commands, run nothing")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a run may take (default 900)")
    parser.add_argument("--log-dir", type=Path, default=ROOT / "runs" / "sweep")
    args = parser.parse_args(argv)
    runs = [r for r in all_runs() if any(part in r.name for part in args.only)]
    if not runs:
        parser.error(f"--only {' '.join(args.only)!r} names no run")
    if args.list:
        for r in runs:
            print(f"{r.name:<48} exit {r.exit_code}  {shlex.join(r.command()[1:])}")
        return 0
    args.log_dir.mkdir(parents=True, exist_ok=True)
    print(f"{'run':<48} {'verdict':<10} {'exit':>4} {'seconds':>8}  {'':<4}", flush=True)
    failed = []
    for r in runs:
        verdict, code, seconds = run_one(r, args.log_dir, args.timeout)
        ok = passed(r, verdict, code)
        failed += [] if ok else [r.name]
        print(f"{r.name:<48} {verdict:<10} {'-' if code is None else code:>4} {seconds:>8.0f}  "
              f"{'ok' if ok else 'FAIL (expected exit %d)' % r.exit_code}", flush=True)
    print(f"\n{len(runs) - len(failed)} of {len(runs)} runs as expected" +
          (f"; not: {', '.join(failed)} (logs in {args.log_dir})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
