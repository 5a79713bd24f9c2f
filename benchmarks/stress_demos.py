"""Run every torchrun entry of the book many times and count the runs that fail after success.

Issue 11: a run printed MATCH and then exited non-zero, one rank aborting while Python shut
down ("terminate called without an active exception", SIGABRT), so torchrun reported the
whole job as failed. The cause and the fix are in minimegatron/launch.py (finish_torchrun).
This script is the check: N runs of each job below under torchrun, two jobs at a time (so the
ranks compete for the cores, as on a learner's loaded laptop), each with a time limit.

    python benchmarks/stress_demos.py --runs 10            (or: make stress N=10)

A run succeeded when it printed its success line (MATCH for a chapter demo, "final train
loss" for minimegatron.train) and exited 0. What the script counts, per job:
  after-success  printed the success line, then exited non-zero: the failure of issue 11
  no-success     never printed it (a MISMATCH, a crash during the run, or a time-out)
  aborted        of those, how many printed "terminate called" (the C++ abort)
The exit status is 1 when any run failed (either kind), else 0. The output of every run is
kept in --log-dir (default runs/stress/<job>-<i>.log) so a failure can be read.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The Makefile's TORCHRUN: one machine, rendezvous on 127.0.0.1, a port the OS picks.
TORCHRUN = (f"{ROOT / '.venv/bin/torchrun'} --nnodes=1 --rdzv-backend=c10d "
            "--rdzv-endpoint=127.0.0.1:0 --local-addr=127.0.0.1")


@dataclass(frozen=True)
class Job:
    name: str
    ranks: int
    args: str               # what follows torchrun's own flags ({out} is the run's own folder)
    success: str            # a regular expression for the line a successful run prints


# The layouts issue 11 found failing, one per chapter with a torchrun demo, and the training
# entry (each writes into its own folder, so that two runs at once do not share files).
JOBS = [
    Job("ch01 dp --zero 1 (4 ranks)", 4, "chapters/01_dp/demo.py --zero 1 --quick", r"^MATCH"),
    Job("ch02 tp --tp 2 --dp 2 (4 ranks)", 4, "chapters/02_tp/demo.py --tp 2 --dp 2 --quick", r"^MATCH"),
    Job("ch03 pp --pp 4 --schedule 1f1b (4 ranks)", 4,
        "chapters/03_pp/demo.py --pp 4 --schedule 1f1b --quick --figure ''", r"^MATCH"),
    Job("ch03 pp --pp 2 --dp 2 --zero-stage 1 (4 ranks)", 4,
        "chapters/03_pp/demo.py --pp 2 --dp 2 --zero-stage 1 --micro-batches 4 --quick --figure ''", r"^MATCH"),
    Job("ch04 sp cp --tp 2 --sp --cp 2 (4 ranks)", 4,
        "chapters/04_sp_cp/demo.py --tp 2 --sp --cp 2 --quick", r"^MATCH"),
    Job("ch05 ep --tp 2 --sp --ep 2 (4 ranks)", 4,
        "chapters/05_ep_moe/demo.py --tp 2 --sp --ep 2 --quick", r"^MATCH"),
    Job("train tiny tp 2 (4 ranks)", 4,
        "-m minimegatron.train --preset tiny --tensor-model-parallel-size 2 --train-iters 5 "
        "--out-dir {out}", r"^final train loss"),
]


@dataclass
class Outcome:
    job: Job
    index: int
    returncode: int | None          # None: killed at the time limit
    succeeded_line: bool
    aborted: bool
    seconds: float
    log: Path


@dataclass
class Tally:
    runs: int = 0
    ok: int = 0
    after_success: int = 0
    no_success: int = 0
    aborted: int = 0
    seconds: list[float] = field(default_factory=list)


def run_once(job: Job, index: int, torchrun: str, log_dir: Path, time_limit: float) -> Outcome:
    slug = re.sub(r"[^a-z0-9]+", "-", job.name.lower()).strip("-")
    log = log_dir / f"{slug}-{index}.log"
    out = log_dir / f"{slug}-{index}.out"
    command = (shlex.split(torchrun) + [f"--nproc_per_node={job.ranks}"]
               + shlex.split(job.args.format(out=out)))
    start = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + shlex.join(command) + "\n")
        f.flush()
        try:
            code = subprocess.run(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=time_limit).returncode
        except subprocess.TimeoutExpired:   # subprocess.run killed torchrun; its ranks follow
            code = None
    text = log.read_text(errors="replace")
    return Outcome(job, index, code, re.search(job.success, text, re.MULTILINE) is not None,
                   "terminate called" in text, time.perf_counter() - start, log)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10, help="runs of each job (default 10)")
    ap.add_argument("--parallel", type=int, default=2, help="runs at a time (default 2)")
    ap.add_argument("--torchrun", default=TORCHRUN, help="the torchrun command line, without "
                    "--nproc_per_node (default: the Makefile's TORCHRUN)")
    ap.add_argument("--only", action="append", default=[], metavar="TEXT",
                    help="run only the jobs whose name contains TEXT (repeatable)")
    ap.add_argument("--time-limit", type=float, default=600.0,
                    help="seconds before a run is killed and counted as failed (default 600)")
    ap.add_argument("--log-dir", type=Path, default=ROOT / "runs" / "stress")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.parallel < 1:
        ap.error(f"--runs and --parallel must be at least 1, got {args.runs} and {args.parallel}")
    jobs = [j for j in JOBS if not args.only or any(t in j.name for t in args.only)]
    if not jobs:
        ap.error(f"--only {args.only} matches none of {[j.name for j in JOBS]}")
    args.log_dir.mkdir(parents=True, exist_ok=True)

    # Interleave the jobs (run 1 of each, then run 2 of each, ...) so that a run shares the
    # cores with a run of another job, and a shortened session still covers every job.
    work = [(job, i) for i in range(1, args.runs + 1) for job in jobs]
    print(f"{len(work)} runs ({args.runs} of each of {len(jobs)} jobs), {args.parallel} at a time; "
          f"logs in {args.log_dir}", flush=True)
    tallies = {job.name: Tally() for job in jobs}
    start = time.perf_counter()
    with ThreadPoolExecutor(args.parallel) as pool:
        futures = [pool.submit(run_once, job, i, args.torchrun, args.log_dir, args.time_limit)
                   for job, i in work]
        for done, fut in enumerate(futures, 1):
            o = fut.result()
            t = tallies[o.job.name]
            t.runs += 1
            t.seconds.append(o.seconds)
            t.aborted += o.aborted
            if o.succeeded_line and o.returncode == 0:
                t.ok += 1
                verdict = "ok"
            elif o.succeeded_line:
                t.after_success += 1
                verdict = f"FAILED AFTER SUCCESS (exit {o.returncode}): {o.log}"
            else:
                t.no_success += 1
                verdict = (f"FAILED (time limit {args.time_limit:g} s)" if o.returncode is None
                           else f"FAILED (exit {o.returncode}, no success line)") + f": {o.log}"
            print(f"[{done}/{len(work)}] {o.job.name} #{o.index}: {o.seconds:.0f} s, {verdict}",
                  flush=True)

    print(f"\n{'job':44s} {'runs':>5s} {'ok':>5s} {'after-success':>14s} {'no-success':>11s} "
          f"{'aborted':>8s} {'median s':>9s}")
    total = Tally()
    for name, t in tallies.items():
        median = sorted(t.seconds)[len(t.seconds) // 2]
        print(f"{name:44s} {t.runs:5d} {t.ok:5d} {t.after_success:14d} {t.no_success:11d} "
              f"{t.aborted:8d} {median:9.0f}")
        for k in ("runs", "ok", "after_success", "no_success", "aborted"):
            setattr(total, k, getattr(total, k) + getattr(t, k))
    print(f"{'total':44s} {total.runs:5d} {total.ok:5d} {total.after_success:14d} "
          f"{total.no_success:11d} {total.aborted:8d}")
    print(f"{total.after_success} of {total.runs} runs exited non-zero after their success line; "
          f"{total.no_success} never printed it ({time.perf_counter() - start:.0f} s in all)")
    return 0 if total.ok == total.runs else 1


if __name__ == "__main__":
    sys.exit(main())
