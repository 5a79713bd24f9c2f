"""Tokens per second of tensor-parallel training on this CPU, TP = 1, 2, 4, and the share of
the step spent blocked in collectives.

    python benchmarks/bench_tp.py                        # TP 1, 2, 4 (TP=1 with 1 and 2 threads)
    python benchmarks/bench_tp.py --tp 1 2 --repeats 9   # only the sizes that fit 2 cores
    python benchmarks/bench_tp.py --smoke                # tiny sizes, one window each (< 60 s)

One step is what `python -m minimegatron.train --tensor-model-parallel-size k` runs on every
rank of a TP group, `minimegatron.train.train_step` unchanged: forward of the whole batch
through the GPTModel cut by `tp.apply_tensor_parallel`, the vocab-parallel cross-entropy,
backward, the global gradient-norm clipping (`optim.clip_grad_norm`: replicated parameters
counted once, one all-reduce of one number over the TP group), AdamW, zero_grad. TP=1 is the
plain single-device GPTModel through the same step: the baseline every TP size is compared
with.
Every TP size processes the SAME b x s tokens per step (strong scaling: tensor parallelism
splits one model replica's work, it does not add data), so tokens/s compare directly.

Rows (variants):
  tp1/1t   GPTModel, 1 intra-op thread          the like-for-like baseline: every TP rank
                                                 also runs 1 thread
  tp1/Nt   GPTModel, N intra-op threads         N = each TP size up to the core count (or
                                                 --threads): the same cores as TP=N, used
                                                 by one process through PyTorch's own
                                                 intra-op parallelism
  tp2, tp4 GPTModel + apply_tensor_parallel over k ranks, 1 thread per rank

How it is timed. All variants live in ONE `minimegatron.launch.spawn` world of max(--tp)
gloo ranks; TP size k uses the group of ranks 0..k-1 (the first TP group that
`parallel_state.initialize_model_parallel(tensor_model_parallel_size=k)` would make, as tp
varies fastest). After --warmup untimed steps per variant, the variants take turns window
by window (--repeats windows of --steps steps; a world barrier starts each window), so a
busy moment of the shared machine hits all of them, as in bench_baseline.py and
bench_ddp.py. The ranks outside the active group wait in that barrier; the script measures
the CPU they use meanwhile and prints it (gloo's barrier sleeps: about 0% of a core), so
they do not slow the ranks that run. A window's time is its slowest rank's.

What "blocked in collectives" means. The communication ledger (minimegatron.comm) records
what each collective was asked to move, not how long it took. So, in the rank processes only,
this script wraps `torch.distributed.all_reduce` with a wall-clock timer: the time spent inside
the call, plus, for an `async_op=True` call, the time spent in the returned handle's
`wait()`. That is the time the rank's Python thread could not compute: the transfer and the
reduction, AND waiting for a slower peer to arrive (a collective finishes only when every
member has joined). The part of an asynchronous all-reduce that runs while the rank computes
(if the library overlaps one) is not counted: it did not block. A one-step ledger per
variant checks that every collective of a step is an all-reduce (the only op timed) and
gives the bytes, printed next to the formula of minimegatron/tp/parallel.py:

  per step per rank: (1 + 2L) all-reduces of [b, s, h] forward (embedding, 2 per layer),
                     (2L + 1) of [b, s, h] backward (2 per layer, 1 for the output layer's
                     input), 3 of [b, s] (the loss), 1 of one number (the gradient norm)

which does not depend on tp: the activations every rank must agree on are [b, s, h] whatever
the split. What shrinks with tp is the compute per rank (the matmul FLOPs, about 1/tp; the
norms and the residual adds are replicated on every rank and do not shrink). Also printed: the time
of one all-reduce of [b, s, h] alone (--probe-calls back-to-back calls after a barrier, no
computation in between; once per round, the best round reported), to separate the
collective's own cost from the waiting.

Why TP is not expected to speed anything up here: on a CPU the "interconnect" is loopback
TCP driven by the same cores that compute; 2 ranks on 2 cores already use every core, so the
best TP=2 can do is what TP=1 gets from 2 intra-op threads, minus the communication; 4 ranks
on 2 cores oversubscribe the CPU (each rank gets about half a core, and gloo's threads compete
with the computation). This benchmark shows the communication pattern and its price, not a
speed-up.

A measurement, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone

import torch
import torch.distributed as dist

from minimegatron.analysis import training_flops
from minimegatron.comm import record_communication
from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.launch import spawn
from minimegatron.model import GPTModel
from minimegatron.optim import NormGroup, Optimizer
from minimegatron.parallel_state import Layout
from minimegatron.tp import apply_tensor_parallel, check_tensor_parallel_config, pad_vocab_size
from minimegatron.train import train_step
from machine import cpu_model, load_average  # benchmarks/machine.py


def model_config(args: dict) -> ModelConfig:
    return ModelConfig.llama(hidden_size=args["hidden"], num_layers=args["layers"],
                             num_attention_heads=args["heads"], num_query_groups=args["query_groups"],
                             max_position_embeddings=args["seq"], params_dtype="float32").validate()


def variants(tp_sizes: list[int], threads: list[int]) -> list[tuple[str, int, int]]:
    """(name, tp, intra-op threads per rank) of every row, in the order they take turns."""
    out = []
    if 1 in tp_sizes:
        out += [(f"tp1/{n}t", 1, n) for n in threads]
    out += [(f"tp{k}", k, 1) for k in tp_sizes if k > 1]
    return out


# ---------------------------------------------------------------------------------------
# the collective timer (benchmark only: the library's comm module is not touched)
# ---------------------------------------------------------------------------------------
class _TimedWork:
    """A torch.distributed work handle whose wait() adds its blocked time to a timer."""

    def __init__(self, work, timer: "CollectiveTimer"):
        self._work, self._timer = work, timer

    def wait(self, *a, **kw):
        start = time.perf_counter()
        try:
            return self._work.wait(*a, **kw)
        finally:
            self._timer.seconds += time.perf_counter() - start

    def __getattr__(self, name):                     # is_completed, result, ...: the real handle's
        return getattr(self._work, name)


class CollectiveTimer:
    """Adds up the wall time this process spends blocked in torch.distributed.all_reduce.

    minimegatron.comm.all_reduce looks `dist.all_reduce` up at every call, so replacing the
    attribute of the torch.distributed module inside a rank process is seen by the library
    without changing it. `installed()` puts the original back on exit.
    """

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0

    @contextmanager
    def installed(self):
        original = dist.all_reduce

        def timed_all_reduce(*a, **kw):
            self.calls += 1
            start = time.perf_counter()
            try:
                work = original(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - start
            return _TimedWork(work, self) if work is not None else None

        dist.all_reduce = timed_all_reduce
        try:
            yield self
        finally:
            dist.all_reduce = original


# ---------------------------------------------------------------------------------------
# inside the world
# ---------------------------------------------------------------------------------------
def bench_rank(tp_sizes: list[int], threads: list[int], args: dict) -> dict:
    """Spawn target: build every variant this rank takes part in, warm up, then time
    interleaved windows. Returns this rank's windows, blocked shares, ledger and idle CPU."""
    rank = dist.get_rank()
    cfg = model_config(args)
    rows = variants(tp_sizes, threads)
    # the same batch on every rank and every TP size (a TP group reads one micro-batch)
    g = torch.Generator().manual_seed(1000)
    x = torch.randint(0, cfg.vocab_size, (args["batch"], args["seq"] + 1), generator=g)
    batch = {"tokens": x[:, :-1], "labels": x[:, 1:]}
    train_cfg = TrainConfig(seq_length=args["seq"], micro_batch_size=args["batch"], lr=1e-4,
                            clip_grad=1.0, progress=False)

    # new_group is collective over the world: every rank creates every group, in one order
    groups = {k: dist.new_group(list(range(k))) for k in sorted(set(tp_sizes)) if k > 1}
    runners = {}                                     # name -> (model, optimizer, layout, threads)
    for name, k, n_threads in rows:
        if rank >= k:
            continue                                 # not a member of this variant's group
        if k == 1:                                   # one device: no group to sum the norm over
            model, layout, norm_groups = GPTModel(cfg), Layout(), []
        else:                                        # this rank's shards; rank r is TP rank r of ranks 0..k-1
            model = apply_tensor_parallel(GPTModel(cfg), groups[k])
            layout = Layout(world=k, rank=rank, tp=k, tp_rank=rank, tp_group=groups[k])
            norm_groups = [groups[k]]
        optimizer = Optimizer([model], train_cfg, [NormGroup(groups=tuple(norm_groups), tp_rank=layout.tp_rank)])
        runners[name] = (model, optimizer, layout, n_threads)

    timer = CollectiveTimer()

    def step(name: str) -> float:
        model, optimizer, layout, _ = runners[name]
        loss, _ = train_step([model], optimizer, [batch], layout, 1e-4)
        return loss

    out = {name: {"windows": [], "blocked": [], "blocked_s": [], "loss0": None, "ledger": None, "calls": None,
                  "alone": []} for name, _, _ in rows}
    with timer.installed():
        # warm-up, each variant on its own (the others wait at the barrier); the first loss of
        # each variant is on the same weights and batch: the rows compute the same function
        for name, k, _ in rows:
            dist.barrier()
            if name not in runners:
                continue
            torch.set_num_threads(runners[name][3])
            out[name]["loss0"] = step(name)
            for _ in range(max(0, args["warmup"] - 1)):
                step(name)
            # one more, recorded: the ledger of one step (untimed)
            calls0 = timer.calls
            with record_communication() as ledger:
                step(name)
            out[name]["calls"] = timer.calls - calls0
            out[name]["ledger"] = [(r.op, r.tag, r.nbytes, r.group_ranks) for r in ledger]
            out[name]["ring"] = ledger.ring_bytes()  # bytes a textbook ring sends (comm.ring_traffic)
            torch.set_num_threads(1)

        idle_cpu, idle_since = [], None

        def sync() -> None:
            """World barrier; if this rank sat out since the last one, log its CPU use meanwhile."""
            nonlocal idle_since
            dist.barrier()
            if idle_since is not None:
                cpu0, wall0 = idle_since
                idle_cpu.append((time.process_time() - cpu0) / (time.perf_counter() - wall0))
                idle_since = None

        probe = torch.randn(args["batch"], args["seq"], args["hidden"])
        for _ in range(args["repeats"]):
            for name, k, _ in rows:
                sync()                               # start the window together
                if name not in runners:
                    idle_since = (time.process_time(), time.perf_counter())
                    continue
                torch.set_num_threads(runners[name][3])
                timer.seconds = 0.0
                start = time.perf_counter()
                for _ in range(args["steps"]):
                    step(name)
                elapsed = time.perf_counter() - start
                torch.set_num_threads(1)
                out[name]["windows"].append(elapsed)
                out[name]["blocked"].append(timer.seconds / elapsed)
                out[name]["blocked_s"].append(timer.seconds / args["steps"])
            # one all-reduce of [b, s, h] alone, per TP size, once per round (the best round is
            # the least disturbed by other jobs): ranks in step, no computation in between
            for k, group in groups.items():
                sync()
                if rank >= k:
                    continue
                dist.all_reduce(probe, group=group)  # untimed: connections warm
                dist.barrier(group=group)
                calls0, timer.seconds = timer.calls, 0.0
                for _ in range(args["probe_calls"]):
                    dist.all_reduce(probe, group=group)
                out[f"tp{k}"]["alone"].append(timer.seconds / (timer.calls - calls0))
        sync()
    out["idle_cpu"] = idle_cpu
    return out


# ---------------------------------------------------------------------------------------
# in the parent
# ---------------------------------------------------------------------------------------
def formula_bytes(cfg: ModelConfig, b: int, s: int) -> tuple[int, int]:
    """(all-reduce calls, bytes handed in) per step per rank, from the tp/parallel.py docstring:
    (1 + 2L) fwd + (2L + 1) bwd all-reduces of [b, s, h], 3 of [b, s] for the loss, 1 number
    for the gradient norm. Independent of tp."""
    L, h, e = cfg.num_layers, cfg.hidden_size, 4                  # float32
    big = (1 + 2 * L) + (2 * L + 1)
    return big + 3 + 1, e * (big * b * s * h + 3 * b * s + 1)


def matmul_flops_per_rank(cfg: ModelConfig, b: int, s: int, tp: int) -> float:
    """Matmul FLOPs of one forward + backward on one rank of a TP group of size tp.

    Every matmul is split: attention by heads, the MLP by its inner dimension, the output
    layer by (padded) vocabulary rows, so each rank does 1/tp of the layers' FLOPs and
    Vp/tp of the V logit columns. Work that is not a matmul is not counted (norms and
    residual adds are replicated on every rank; RoPE and the softmaxes are split).
    """
    fl = training_flops(cfg, b, s)
    logits = fl["forward"]["logits"] + fl["backward"]["logits"]
    vp = pad_vocab_size(cfg.vocab_size, tp)
    return (fl["total"] - logits) / tp + logits * (vp / tp) / cfg.vocab_size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4], help="TP sizes (default 1 2 4)")
    p.add_argument("--threads", type=int, nargs="+", default=None,
                   help="intra-op thread counts of the TP=1 rows (default: 1 and each TP size "
                        "up to the core count); TP ranks always run 1 thread each")
    p.add_argument("--hidden", type=int, default=256, help="h (default 256)")
    p.add_argument("--layers", type=int, default=4, help="L (default 4)")
    p.add_argument("--heads", type=int, default=8, help="a (default 8)")
    p.add_argument("--query-groups", type=int, default=4,
                   help="g (default 4: TP=4 needs g divisible by 4, each rank whole key/value groups)")
    p.add_argument("--seq", type=int, default=128, help="s (default 128)")
    p.add_argument("--batch", type=int, default=4, help="b, sequences per step (default 4; the same for every TP size)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps per variant (default 2; plus 1 recorded in the ledger)")
    p.add_argument("--steps", type=int, default=5, help="steps per timed window (default 5)")
    p.add_argument("--repeats", type=int, default=15, help="timed windows per variant (default 15)")
    p.add_argument("--probe-calls", type=int, default=10,
                   help="all-reduces of [b, s, h] per round when timing one alone (default 10)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one window each: checks that it runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.heads, args.query_groups = 32, 2, 4, 4
        args.seq, args.batch = 16, 2
        args.warmup, args.steps, args.repeats, args.probe_calls = 1, 1, 1, 2
    cores = os.cpu_count() or 1
    args.tp = sorted(set(args.tp))
    if args.threads is None:
        args.threads = sorted({1, *(k for k in args.tp if 1 < k <= cores)})
    args.threads = sorted(set(args.threads))
    if any(k < 1 for k in args.tp) or any(n < 1 for n in args.threads):
        p.error("--tp and --threads must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    cfg = model_config(vars(args))
    try:
        for k in args.tp:
            check_tensor_parallel_config(cfg, k)     # before any process starts
    except ConfigError as exc:
        print(f"error: this model does not split over TP={k}: {exc}", file=sys.stderr)
        return 2
    world, cores = max(args.tp), os.cpu_count() or 1
    rows = variants(args.tp, args.threads)
    b, s = args.batch, args.seq
    print(f"command: {cmd}")
    print(f"date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; torch {torch.__version__}, "
          f"python {platform.python_version()}, CPU: {cpu_model()}, {cores} cores")
    print(f"model: LLaMA style h={cfg.hidden_size} L={cfg.num_layers} a={cfg.num_attention_heads} "
          f"g={cfg.query_groups} f={cfg.ffn_size} V={cfg.vocab_size}, float32; s={s}, b={b} "
          f"({b * s:,} tokens per step for every TP size)")
    print(f"timing: one world of {world} gloo rank(s); {args.warmup} warm-up steps + 1 recorded step per "
          f"variant, then {args.repeats} interleaved windows of {args.steps} steps; a window's time is "
          f"its slowest rank's; TP ranks 1 intra-op thread each")
    if world > cores:
        print(f"NOTE: TP={world} runs {world} ranks on {cores} cores: the CPU is OVERSUBSCRIBED "
              f"(each rank gets about {cores / world:.2g} of a core)")

    load_before = load_average()
    t0 = time.perf_counter()
    per_rank = spawn(bench_rank, world, args.tp, args.threads, vars(args),
                     timeout=1200, collective_timeout=300)
    wall = time.perf_counter() - t0
    params = sum(p.numel() for p in GPTModel(cfg).parameters())
    idle = [c for r in per_rank for c in r["idle_cpu"]]
    print(f"world ran {wall:.1f} s; load average {load_before} -> {load_average()}; "
          f"{params:,} parameters")
    if idle:
        print(f"ranks sitting a window out used {100 * statistics.median(idle):.1f}% of a core "
              f"(median; max {100 * max(idle):.1f}%) while waiting in the barrier")

    tokens = b * s * args.steps
    n_calls, n_bytes = formula_bytes(cfg, b, s)
    results, base = [], None
    for name, k, n_threads in rows:
        members = per_rank[:k]
        windows = [max(r[name]["windows"][i] for r in members) for i in range(args.repeats)]
        best, med, worst = min(windows), statistics.median(windows), max(windows)
        blocked = statistics.median(c for r in members for c in r[name]["blocked"])
        blocked_s = statistics.median(c for r in members for c in r[name]["blocked_s"])
        ledger = members[0][name]["ledger"]
        ops = {op for op, _, _, _ in ledger}
        alone = [max(r[name]["alone"][i] for r in members) for i in range(len(members[0][name]["alone"]))]
        row = dict(name=name, tp=k, threads=n_threads, best=tokens / best, median=tokens / med,
                   worst=tokens / worst, ms_best=1000 * best / args.steps, blocked=blocked,
                   ms_blocked=1000 * blocked_s, loss0=members[0][name]["loss0"],
                   calls=len(ledger), timed_calls=members[0][name]["calls"],
                   nbytes=sum(nb for _, _, nb, _ in ledger), ops=ops,
                   ring=members[0][name]["ring"],
                   alone_ms=1000 * min(alone) if alone else None,
                   gflop=matmul_flops_per_rank(cfg, b, s, k) / 1e9)
        if name == "tp1/1t":
            base = row["best"]
        row["vs"] = row["best"] / base if base else float("nan")
        results.append(row)

    print("\nspeed (tokens/s of the whole TP group: b x s per step)")
    print(f"   {'variant':<9}{'ranks x threads':>16}{'tokens/s best':>14}{'median':>9}{'worst':>9}"
          f"{'ms/step best':>13}{'vs tp1/1t':>10}{'blocked in comm':>16}{'ms/step blocked':>16}{'first loss':>12}")
    for r in results:
        over = " oversubscribed" if r["tp"] * r["threads"] > cores else ""
        vs = "-" if base is None else f"{r['vs']:.2f}x"
        print(f"   {r['name']:<9}{str(r['tp']) + ' x ' + str(r['threads']):>16}{r['best']:>14,.0f}"
              f"{r['median']:>9,.0f}{r['worst']:>9,.0f}{r['ms_best']:>13.1f}{vs:>10}"
              f"{100 * r['blocked']:>15.0f}%{r['ms_blocked']:>16.1f}{r['loss0']:>12.6f}{over}")
    print("   (blocked in comm: median over ranks and windows of the time inside all_reduce / its wait,"
          " waiting for peers included)")
    if base is not None:
        ref = results[0]["loss0"]
        diff = max(abs(r["loss0"] - ref) for r in results)
        print(f"   first losses (same initial weights, same batch) differ from tp1/1t by at most {diff:.1e}")

    big = 4 * cfg.num_layers + 2                     # the [b, s, h] all-reduces of a step
    print(f"\ncommunication and compute per step per rank (formula: {n_calls} all-reduces, "
          f"{n_bytes:,} bytes handed in, whatever tp)")
    print(f"   {'variant':<9}{'all-reduces':>12}{'ledger bytes':>14}{'formula bytes':>15}"
          f"{'ring bytes sent':>17}{'matmul GFLOP':>14}{'one [b,s,h] all-reduce alone':>31}"
          f"{f'{big} x alone':>12}")
    for r in results:
        if r["tp"] == 1 and r["calls"] == 0 and r["threads"] != 1:
            continue                                 # the same (empty) ledger as tp1/1t
        formula = 0 if r["tp"] == 1 else n_bytes
        alone = f"{r['alone_ms']:.2f} ms" if r["alone_ms"] is not None else "-"
        all_big = f"{big * r['alone_ms']:.1f} ms" if r["alone_ms"] is not None else "-"
        print(f"   {r['name']:<9}{r['calls']:>12}{r['nbytes']:>14,}{formula:>15,}{r['ring']:>17,.0f}"
              f"{r['gflop']:>14.3f}{alone:>31}{all_big:>12}")
        if r["tp"] > 1 and (r["ops"] - {"all_reduce"} or r["timed_calls"] != r["calls"]):
            print(f"   WARNING: {r['name']}: ledger ops {sorted(r['ops'])}, {r['calls']} recorded vs "
                  f"{r['timed_calls']} timed: the blocked share misses some collectives")
    print("   (TP=1: a one-member group communicates nothing. Ring bytes: what a ring all-reduce sends,"
          " 2(tp-1)/tp x bytes handed in.")
    print(f"    {big} x alone: what the step's [b, s, h] all-reduces would cost with the ranks in step;"
          " compare with 'ms/step blocked' above)")

    print("\nmarkdown:")
    print("| variant | ranks × threads | tokens/s best | median | worst | ms/step (best) | vs tp1/1t (best) "
          "| blocked in comm (median) | ms/step blocked | first loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        vs = "-" if base is None else f"{r['vs']:.2f}×"
        print(f"| {r['name']} | {r['tp']} × {r['threads']} | {r['best']:,.0f} | {r['median']:,.0f} | "
              f"{r['worst']:,.0f} | {r['ms_best']:.1f} | {vs} | {100 * r['blocked']:.0f}% | "
              f"{r['ms_blocked']:.1f} | {r['loss0']:.6f} |")
    print()
    print("| TP | all-reduces / step / rank | ledger bytes | formula bytes | ring bytes sent | "
          f"matmul GFLOP / rank | one [b,s,h] all-reduce alone | {big} × alone |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if r["tp"] == 1 and r["threads"] != 1:
            continue
        formula = 0 if r["tp"] == 1 else n_bytes
        alone = f"{r['alone_ms']:.2f} ms" if r["alone_ms"] is not None else "-"
        all_big = f"{big * r['alone_ms']:.1f} ms" if r["alone_ms"] is not None else "-"
        print(f"| {r['tp']} | {r['calls']} | {r['nbytes']:,} | {formula:,} | {r['ring']:,.0f} | "
              f"{r['gflop']:.3f} | {alone} | {all_big} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
