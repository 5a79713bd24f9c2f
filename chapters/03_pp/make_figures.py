"""The figures of chapter 03 and the tables the chapter quotes.

    python chapters/03_pp/make_figures.py          # a minute or two on 2 cores; writes figures/*.png
    python chapters/03_pp/make_figures.py --simulated-only   # seconds: the first three figures only
    python -m booktools.measured record 03         # make numbers CH=03: this script and the demo
                                                   # runs of RUNS, then the text's numbers (measure)

From the schedules alone (pp.schedules, pp.timeline; no process started):
  schedules.png          the simulated timelines of GPipe, 1F1B and interleaved 1F1B (v = 2)
                         for pp = 4 stages and m = 8 micro-batches, t_f = 1, t_b = 2
  bubble_vs_m.png        the idle fraction (p - 1) / (v m + p - 1) against m, for pp = 4 and 8
                         and v = 1, 2, 4: the formula as lines, the simulation as markers
  rank_grid_3d.png       16 ranks as tp = 2 x dp = 2 x pp = 4 (viz.draw_rank_grid):
                         the TP, DP, pipeline and embedding groups
It prints the warm-up counts and orders of every stage, and stops with an error if any
simulated idle fraction differs from the formula or any schedule's warm-up or peak of
micro-batches in flight differs from its closed form (pp = 2, 3, 4, 8, every m up to 4 pp,
v = 2, 3, 4 for interleaving, m == pp included).

One spawned gloo world of 4 ranks (minimegatron.launch.spawn) trains, with the training
loop's own pieces (train_runs of chapters/03_pp/demo.py: parallelize.build_model,
pp.forward_backward_pipelining, model.finalize_model_grads, the optimizer's clipping), the demo's
tiny GPT-2 style model (tied embeddings, h = 64, L = 8, V = 257, b = 2, s = 32, float64, 3
AdamW steps, clipping on):
  * gpipe, 1f1b and interleaved (v = 2) on pp = 4, m = 8;
  * interleaved (v = 2) on pp = 2 x dp = 2, m = 4 (the data-parallel sync of each chunk).
Each run is judged by the demo's check_run (equivalence with one device, p2p ledger, in-flight
counts); on top of that this script checks the p2p bytes, the peak counts and the peak bytes
against the chapter's formulas and the ledger of the pp x dp step (one DP all-reduce per chunk
per step, one tied-embedding all-reduce, one norm), and stops with an error on a difference.
It draws
  timeline_1f1b_measured.png  the last 1F1B step as it ran (wall clock) above its simulation
  activations.png        micro-batches in flight per stage and schedule (counts from the
                         schedule, equal to the measured ones) and the bytes saved for backward
                         at the peak, measured with saved-tensor hooks
The counts and bytes do not change from run to run; the wall-clock timeline does (4 ranks
share 2 cores, and other jobs may run on the machine).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import matplotlib
import matplotlib.patches  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

from minimegatron import parallel_state  # noqa: E402
from minimegatron.launch import spawn  # noqa: E402
from minimegatron.pp import (Interval, bubble_fraction, idle_fraction, num_warmup_microbatches,  # noqa: E402
                             peak_in_flight, schedule, simulate)
from booktools.demo import import_chapter  # noqa: E402
from booktools.measured import RoundOff, claim  # noqa: E402
from minimegatron.viz import draw_rank_grid, new_figure  # noqa: E402

ch03 = import_chapter("03")        # chapters/03_pp/demo.py: the runs and their checks

OUT = Path(__file__).resolve().parent / "figures"
P, M, V = 4, 8, 2                       # the chapter's pipeline: 4 stages, 8 micro-batches, 2 chunks
KINDS = [("gpipe", 1), ("1f1b", 1), ("interleaved", V)]
COLORS = {"gpipe": "#C44E52", "1f1b": "#4C72B0", "interleaved": "#55A868"}


def fail(message: str) -> None:
    print(f"MISMATCH: {message}", file=sys.stderr)
    raise SystemExit(1)


def compact(ops) -> str:
    return " ".join(f"{op}{mb}" + (f".{c}" if any(x[2] for x in ops) else "") for op, mb, c in ops)


# ---------------------------------------------------------------------------------------
# the chapter's closed forms
# ---------------------------------------------------------------------------------------
def warmup_formula(kind: str, p: int, r: int, m: int, v: int) -> int:
    if kind == "gpipe":
        return m
    if kind == "1f1b":
        return min(p - r - 1, m)
    # Megatron-Core's get_pp_rank_microbatches with group size p; no special case for m == p
    return min(2 * (p - r - 1) + (v - 1) * p, v * m)


def peak_formula(kind: str, p: int, r: int, m: int, v: int) -> int:
    """Micro-batch-chunks alive at once: the warm-up, plus the one steady-state forward."""
    w = warmup_formula(kind, p, r, m, v)
    return min(w + 1, v * m) if kind != "gpipe" else m


def idle_formula(p: int, m: int, v: int) -> float:
    return (p - 1) / (v * m + p - 1)


# ---------------------------------------------------------------------------------------
# 1. the schedules, simulated (no process)
# ---------------------------------------------------------------------------------------
def closed_forms_section() -> None:
    """Warm-up and peak of every stage against the closed forms, beyond the figure's pp=4, m=8."""
    checked = 0
    for p in (2, 3, 4, 8):
        for kind, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("interleaved", (2, 3, 4))):
            for v in vs:
                for m in (range(p, 4 * p + 1, p) if kind == "interleaved" else range(1, 4 * p + 1)):
                    for r in range(p):
                        w, want = num_warmup_microbatches(kind, p, r, m, v), warmup_formula(kind, p, r, m, v)
                        peak, want_peak = peak_in_flight(schedule(kind, p, r, m, v)), peak_formula(kind, p, r, m, v)
                        if (w, peak) != (want, want_peak):
                            fail(f"{kind} p={p} r={r} m={m} v={v}: warm-up {w}, peak {peak}; "
                                 f"closed forms {want}, {want_peak}")
                        checked += 1
    print(f"== warm-up and peak in flight equal their closed forms for {checked} (kind, p, rank, m, v)")
    print("   interleaved, m == p (no all-warm-up special case): "
          + "; ".join(f"p={p} v={v}: warm-up {[num_warmup_microbatches('interleaved', p, r, p, v) for r in range(p)]}"
                      for p, v in ((4, 2), (2, 2), (8, 2))))


def legend_by_color(ax, intervals, names: dict) -> None:
    """One legend entry per shade plot_timeline drew: it draws one bar per interval, in order."""
    seen = {}
    for i, bar in zip(intervals, ax.patches):
        seen.setdefault((i.op, i.chunk), bar.get_facecolor())
    handles = [matplotlib.patches.Patch(facecolor=seen[key], edgecolor="black", linewidth=0.4, label=names[key])
               for key in sorted(seen, key=lambda k: (k[0] == "B", k[1]))]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.005, 1.0))


def schedules_section() -> None:
    print(f"== the schedules of pp={P}, m={M} (interleaved: v={V}); warm-up = forwards before the first backward")
    for kind, v in KINDS:
        for r in range(P):
            ops = schedule(kind, P, r, M, v)
            w = num_warmup_microbatches(kind, P, r, M, v)
            if w != warmup_formula(kind, P, r, M, v):
                fail(f"{kind} stage {r}: warm-up {w}, formula {warmup_formula(kind, P, r, M, v)}")
            peak = peak_in_flight(ops)
            if peak != peak_formula(kind, P, r, M, v):
                fail(f"{kind} stage {r}: peak {peak}, formula {peak_formula(kind, P, r, M, v)}")
            print(f"  {kind:<11} stage {r}: warm-up {w:>2}, peak in flight {peak:>2}:  {compact(ops)}")

    fig, axes = plt.subplots(3, 1, figsize=(17, 9), sharex=True)
    for ax, (kind, v) in zip(axes, KINDS):
        intervals = simulate(kind, P, M, v)
        idle = [idle_fraction(intervals, r) for r in range(P)]
        want = idle_formula(P, M, v)
        if max(abs(x - want) for x in idle) > 1e-12:
            fail(f"{kind}: simulated idle {idle}, formula {want}")
        makespan = max(i.end for i in intervals)
        peaks = [peak_in_flight(schedule(kind, P, r, M, v)) for r in range(P)]
        name = {"gpipe": "GPipe (all forwards, then all backwards)",
                "1f1b": "1F1B (warm-up pp - rank - 1 forwards, then one forward one backward)",
                "interleaved": f"interleaved 1F1B, v = {V} chunks per rank (labels: micro-batch.chunk)"}[kind]
        plot_timeline(intervals, f"{name}: the step ends at {makespan:g} (makespan: first start to last end), "
                                 f"every stage idle {want:.3f} of it; "
                                 f"{'micro-batch-chunks' if v > 1 else 'micro-batches'} in flight per stage {peaks}",
                      unit="time (t_f = 1 per micro-batch forward, t_b = 2 per backward)", ax=ax)
        ax.title.set_fontsize(9.5)
        if v > 1:
            for text in ax.texts:                      # half-width boxes: smaller labels, no overlap
                text.set_fontsize(6)
            legend_by_color(ax, intervals, {(op, c): f"{'forward' if op == 'F' else 'backward'}, chunk {c}"
                                            for op in "FB" for c in range(v)})
        else:
            legend_by_color(ax, intervals, {("F", 0): "forward", ("B", 0): "backward"})
        print(f"  {kind:<11} simulated makespan {makespan:g} (formula (m + (p-1)/v)(t_f + t_b) = "
              f"{(M + (P - 1) / v) * 3:g}), idle {want:.4f} on every stage")
    for ax in axes[:-1]:
        ax.set_xlabel("")
    fig.suptitle(f"The three schedules on pp = {P} stages, m = {M} micro-batches (pp.timeline.simulate); "
                 "white: the stage is idle (the bubble)", fontsize=10.5)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(OUT / "schedules.png", dpi=100)
    plt.close(fig)


def bubble_section() -> int:
    """Figure 2 and the table; returns how many simulated points equal the formula."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    checked = 0
    for ax, p in zip(axes, (4, 8)):
        ms = list(range(1, 33))
        for v, style in ((1, "-"), (2, "--"), (4, ":")):
            label = "GPipe = 1F1B: (p-1)/(m+p-1)" if v == 1 else f"interleaved v={v}: (p-1)/(vm+p-1)"
            color = "#4C72B0" if v == 1 else "#55A868" if v == 2 else "#8172B2"
            line = [m for m in ms if v == 1 or m >= p]            # interleaving needs m >= p
            ax.plot(line, [idle_formula(p, m, v) for m in line], style, color=color, lw=1.4, label=label)
        for kind, v, marker, color in (("gpipe", 1, "o", "#C44E52"), ("1f1b", 1, "x", "#4C72B0"),
                                       ("interleaved", 2, "s", "#55A868"), ("interleaved", 4, "^", "#8172B2")):
            pts = [m for m in ms if kind != "interleaved" or m % p == 0]
            if kind != "interleaved":
                pts = [m for m in pts if m in (1, 2, 4, 6, 8, 12, 16, 24, 32)]
            ys = []
            for m in pts:
                intervals = simulate(kind, p, m, v)
                idle = [idle_fraction(intervals, r) for r in range(p)]
                if max(abs(x - idle_formula(p, m, v)) for x in idle) > 1e-12:
                    fail(f"{kind} p={p} m={m} v={v}: simulated {idle}, formula {idle_formula(p, m, v)}")
                if abs(bubble_fraction(kind, p, m, v)["idle"] - idle[0]) > 1e-12:
                    fail(f"bubble_fraction({kind}, {p}, {m}, {v}) differs from the simulation")
                ys.append(idle[0])
                checked += 1
            ax.plot(pts, ys, marker, color=color, ms=6 if marker != "x" else 7, mfc="none" if marker != "x" else None,
                    label=f"simulated {kind}" + (f" v={v}" if v > 1 else ""))
        ax.set_xlabel("m (micro-batches per step)")
        ax.set_title(f"pp = {p}: idle fraction of every stage (unit-cost simulation vs formula)", fontsize=9.5)
        ax.grid(alpha=0.3)
        ax.set_xlim(0, 33)
    axes[0].set_ylabel("idle time / step time")
    axes[0].legend(fontsize=7.5, loc="upper right")
    fig.tight_layout()
    fig.savefig(OUT / "bubble_vs_m.png", dpi=100)
    plt.close(fig)
    print(f"\n== the bubble: {checked} simulated points of the figure (m up to 32, every stage) equal "
          "(p-1)/(v m + p-1)")
    print(f"{'p':>3}{'m':>4}   idle (p-1)/(vm+p-1) for v = 1, 2, 4     bubble/ideal (p-1)/(vm) for v = 1, 2, 4"
          "   (each simulated too)")
    for p, m in ((4, 4), (4, 8), (4, 16), (4, 32), (8, 8), (8, 32), (8, 64)):
        idle = [bubble_fraction("1f1b" if v == 1 else "interleaved", p, m, v)["idle"] for v in (1, 2, 4)]
        for v, x in zip((1, 2, 4), idle):
            sim = simulate("1f1b" if v == 1 else "interleaved", p, m, v)
            if max(abs(idle_fraction(sim, r) - x) for r in range(p)) > 1e-12:
                fail(f"table row p={p} m={m} v={v}: the simulation differs from {x}")
        over = [bubble_fraction("1f1b" if v == 1 else "interleaved", p, m, v)["bubble_over_ideal"] for v in (1, 2, 4)]
        print(f"{p:>3}{m:>4}   " + "  ".join(f"{x:6.3f}" for x in idle) + "              "
              + "  ".join(f"{x:6.3f}" for x in over))
    return checked


def rank_grid_section() -> None:
    for world, tp, pp in ((8, 2, 2), (16, 2, 4)):
        groups = parallel_state.rank_groups(world, tp=tp, pp=pp)
        dp = world // (tp * pp)
        print(f"\n== rank_groups({world}, tp={tp}, pp={pp}): dp={dp}, order tp-cp-ep-dp-pp, "
              f"rank = tp_rank + {tp} dp_rank + {tp * dp} pp_rank")
        for key in ("tp", "dp", "pp", "embedding", "tp-pp"):
            print(f"  {key:<10}{groups[key]}")
    draw_rank_grid(16, tp=2, pp=4, keys=("tp", "dp", "pp", "embedding"), path=OUT / "rank_grid_3d.png")


# ---------------------------------------------------------------------------------------
# 2. real pipelines on 4 spawned ranks
# ---------------------------------------------------------------------------------------
def model():
    """The demo's model for pp = 4 (chapters/03_pp/demo.py without --quick): 8 layers."""
    return ch03.tiny_model("gpt2", "float64", num_layers=8, hidden_size=64, max_position_embeddings=32)


# the four pipelines of the spawned world (RUNS, at the end, is what the chapter's text quotes)
PIPELINES = [ch03.make_run(model(), pp=P, kind=kind, num_chunks=v, micro_batches=M, micro_batch_size=2, steps=3)
             for kind, v in KINDS]
PIPELINES.append(ch03.make_run(model(), pp=2, dp=2, kind="interleaved", num_chunks=2, micro_batches=4,
                               micro_batch_size=2, steps=3))


def p2p_formula_bytes(run: ch03.PPRun, stage: int) -> int:
    """One [b, s, h] activation forward and one gradient backward per micro-batch and boundary:
    each virtual stage k of this rank receives (k > 0) and sends (k < last) both ways."""
    t, cfg = run.train, run.model
    nbytes = t.micro_batch_size * t.seq_length * cfg.hidden_size * 8              # float64
    last = run.pp * run.num_chunks - 1
    ends = sum((k > 0) + (k < last) for k in (c * run.pp + stage for c in range(run.num_chunks)))
    return 2 * ends * run.micro_batches * nbytes


def replay_peak_bytes(ops, saved: dict) -> int:
    """The most bytes alive over the schedule, from each micro-batch-chunk's measured bytes."""
    alive, peak = 0, 0
    for op, mb, c in ops:
        alive += saved[(mb, c)] if op == "F" else -saved[(mb, c)]
        peak = max(peak, alive)
    return peak


def check_real(runs, per_run) -> dict:
    out = {}
    for run, per_rank in zip(runs, per_run):
        report = ch03.check_run(run, per_rank)
        name = run.kind + (f" v={run.num_chunks}" if run.num_chunks > 1 else "") + f", pp={run.pp} x dp={run.dp}"
        e = report.equivalence
        print(f"\n== {name}, m={run.micro_batches}: {'MATCH' if report.ok else 'MISMATCH'} with one device "
              f"(max |dloss| {e.max_loss_diff:.1e}, |dgrad| {e.max_grad_diff:.1e}, |dparam| {e.max_param_diff:.1e})")
        if not report.ok:
            fail(f"{name}:\n{report}")
        stages = {r["pp_rank"]: r for r in per_rank if r["dp_rank"] == 0}
        rows = []
        for s in range(run.pp):
            rec = stages[s]
            ops = schedule(run.kind, run.pp, s, run.micro_batches, run.num_chunks)
            count, want = rec["peak_in_flight"], peak_formula(run.kind, run.pp, s, run.micro_batches, run.num_chunks)
            replay = replay_peak_bytes(ops, rec["saved_bytes"])
            sent = sum(n for _, n, tag in rec["ledger"][0] if tag in ("pp-fwd", "pp-bwd"))
            if count != want or rec["peak_bytes"] != replay or sent != p2p_formula_bytes(run, s):
                fail(f"{name} stage {s}: peak {count} (formula {want}), bytes {rec['peak_bytes']} (replay {replay}), "
                     f"p2p {sent} (formula {p2p_formula_bytes(run, s)})")
            per_chunk = sorted({rec["saved_bytes"][(0, c)] for c in range(run.num_chunks)})
            rows.append((s, count, rec["peak_bytes"], per_chunk, sent, rec["layers"]))
            print(f"  stage {s}: layers {rec['layers']}; in flight {count} (formula {want}); "
                  f"{rec['peak_bytes']:,} bytes at the peak; "
                  f"per micro-batch-chunk {', '.join(f'{x:,}' for x in per_chunk)}; "
                  f"p2p {sent:,} bytes/step (formula {p2p_formula_bytes(run, s):,})")
        print("  idle fraction, last step's wall clock: "
              + " ".join(f"{x:.3f}" for x in report.measured_idle)
              + f"   (formula {idle_formula(run.pp, run.micro_batches, run.num_chunks):.3f})")
        out[(run.kind, run.pp, run.dp)] = {"rows": rows, "report": report, "per_rank": per_rank, "name": name}
    return out


def ledger_section(run: ch03.PPRun, per_rank: list[dict]) -> dict[str, dict[str, list[int]]]:
    """Every collective of one step of pp=2 x dp=2 interleaved, per rank; the DP sync runs
    once per chunk and step (with the chunk's last backward), not once per micro-batch.
    Returns {rank: {"op tag": [calls, bytes]}}."""
    found = {}
    print(f"\n== one step of interleaved v=2, pp=2 x dp=2, m={run.micro_batches}: every rank's calls "
          "(op, tag): count, bytes")
    groups = parallel_state.rank_groups(4, pp=2)
    print(f"  groups: pp {groups['pp']}, dp {groups['dp']}, embedding {groups['embedding']}")
    for rank, rec in enumerate(per_rank):
        calls: dict = {}
        for op, nbytes, tag in rec["ledger"][0]:
            c = calls.setdefault((op, tag), [0, 0])
            c[0] += 1
            c[1] += nbytes
        print(f"  rank {rank} (stage {rec['pp_rank']}, dp rank {rec['dp_rank']}, layers {rec['layers']}): "
              + "; ".join(f"{op} {tag} x{n} {b:,} B" for (op, tag), (n, b) in sorted(calls.items())))
        found[str(rank)] = {f"{op} {tag}": c for (op, tag), c in sorted(calls.items())}
        grads, grad_bytes = calls.get(("all_reduce", "grads"), [0, 0])
        held = rec["numel"]                    # every parameter this rank holds, a tied copy included
        if grads != run.num_chunks or grad_bytes != 8 * held:
            fail(f"rank {rank}: {grads} data-parallel all-reduces of {grad_bytes} bytes per step, expected one per "
                 f"chunk ({run.num_chunks}) of all {held} parameters held, 8 bytes each")
        for tag in ("embedding-grads", "grad-norm", "loss"):
            if calls.get(("all_reduce", tag), [0])[0] != 1:
                fail(f"rank {rank}: expected exactly one all-reduce {tag!r}, got {calls.get(('all_reduce', tag))}")
    return found


def draw_measured(run: ch03.PPRun, per_rank: list[dict]) -> dict[str, float]:
    """Figure 3; returns the median forward and backward (ms) and their ratio, as printed."""
    measured = ch03.measured_timeline(per_rank)
    fig, (real, sim) = plt.subplots(2, 1, figsize=(12, 6.6))
    plot_timeline(measured, f"measured: the last of 3 steps of 1F1B, pp = {run.pp}, m = {run.micro_batches}, "
                            "4 processes on 2 shared CPU cores (grey: blocked in a receive; orange: handing an "
                            "output to an asynchronous send)", unit="seconds since the first stage started the step",
                  ax=real)
    plot_timeline(simulate(run.kind, run.pp, run.micro_batches), "simulated with t_f = 1, t_b = 2, free communication",
                  unit="time units", ax=sim)
    for ax in (real, sim):
        ax.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(OUT / "timeline_1f1b_measured.png", dpi=100)
    plt.close(fig)
    f = [i.end - i.start for i in measured if i.op == "F"]
    b = [i.end - i.start for i in measured if i.op == "B"]
    wait = sum(i.end - i.start for i in measured if i.op == "recv wait")
    span = max(i.end for i in measured) - min(i.start for i in measured)
    tf, tb = statistics.median(f), statistics.median(b)
    found = {"forward_ms": round(tf * 1e3, 2), "backward_ms": round(tb * 1e3, 2), "tb_over_tf": round(tb / tf, 2)}
    print(f"\n== the measured 1F1B step: {span * 1e3:.0f} ms; median forward {found['forward_ms']:.2f} ms, "
          f"median backward {found['backward_ms']:.2f} ms (t_b / t_f = {found['tb_over_tf']:.2f}); "
          f"{wait * 1e3:.0f} ms blocked in receives over the 4 stages")
    return found


def draw_activations(real: dict) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12.5, 4.4))
    width = 0.26
    for k, (kind, v) in enumerate(KINDS):
        rows = real[(kind, P, 1)]["rows"]
        xs = [s + (k - 1) * width for s in range(P)]
        counts = [r[1] for r in rows]
        left.bar(xs, counts, width=width, color=COLORS[kind],
                 label=f"{kind}" + (f" (v = {v}: micro-batch-chunks, each 1/{v} of a stage)" if v > 1 else ""))
        for x, c in zip(xs, counts):
            left.text(x, c + 0.15, str(c), ha="center", fontsize=7.5)
        mib = [r[2] / 2**20 for r in rows]
        right.bar(xs, mib, width=width, color=COLORS[kind], label=kind)
        for x, y in zip(xs, mib):
            right.text(x, y + 0.08, f"{y:.2f}", ha="center", fontsize=7)
    for ax in (left, right):
        ax.set_xticks(range(P), [f"stage {s}" for s in range(P)])
        ax.grid(alpha=0.3, axis="y")
    left.set_ylabel("micro-batches (or chunks) alive at the peak")
    left.set_title(f"Held at once, pp = {P}, m = {M}: GPipe m, 1F1B pp - rank,\n"
                   f"interleaved 2(pp-rank-1) + (v-1)pp + 1 (schedule = measured)", fontsize=9.5)
    left.legend(fontsize=7.5, loc="upper right")
    left.set_ylim(0, M + 4)
    right.set_ylabel("MiB saved for backward at the peak")
    right.set_title("Measured bytes at the peak (saved-tensor hooks; h = 64, L = 8,\n"
                    "b = 2, s = 32, float64; stage 0 adds the embedding, stage 3 the logits)", fontsize=9.5)
    right.legend(fontsize=8, loc="upper center", ncol=3)
    right.set_ylim(0, right.get_ylim()[1] * 1.2)
    fig.tight_layout()
    fig.savefig(OUT / "activations.png", dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# the figures (drawn from the records the code keeps; the notebook and the tests draw them too)
# ---------------------------------------------------------------------------------------
def plot_timeline(intervals: list[Interval], title: str = "", path=None, unit: str = "time", ax=None):
    """Draw a pipeline schedule (pp.timeline.simulate, or a measured run): one row per rank
    (rank 0 on top), F boxes light, B boxes dark, each labelled with its micro-batch (and
    chunk when there are several); waiting for a receive grey, handing an output to a send
    orange, idle white.
    Draws into `ax` if given, else into a new Figure (Agg canvas; saved to `path` if given);
    returns the Figure."""
    ranks = sorted({i.rank for i in intervals})
    chunks = max(i.chunk for i in intervals) + 1
    colors = {"F": ["#9ecae1", "#c6dbef", "#deebf7"], "B": ["#3182bd", "#6baed6", "#08519c"]}
    if ax is None:
        fig = new_figure(figsize=(10, 0.55 * len(ranks) + 1.2))
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    for i in intervals:
        color = colors[i.op][i.chunk % 3] if i.op in colors else "#fdae6b" if i.op == "send" else "#d9d9d9"
        y = len(ranks) - 1 - ranks.index(i.rank)
        ax.barh(y, i.end - i.start, left=i.start, height=0.8, color=color, edgecolor="black", linewidth=0.4)
        if i.op in ("F", "B"):
            label = f"{i.microbatch}" + (f".{i.chunk}" if chunks > 1 else "")
            ax.text((i.start + i.end) / 2, y, label, ha="center", va="center", fontsize=7,
                    color="white" if i.op == "B" else "black")
    ax.set_yticks(range(len(ranks)), [f"stage {r}" for r in reversed(ranks)])
    ax.set_xlabel(unit)
    ax.set_title(title)
    if path is not None:
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    return fig


def draw_run(run: ch03.PPRun, per_rank: list[dict], path: str) -> None:
    """The demo's --figure: the last real step's timeline above the unit-cost simulation of the
    same schedule."""
    title = f"{run.kind}, pp={run.pp}, m={run.micro_batches}" + (f", v={run.num_chunks}" if run.num_chunks > 1 else "")
    fig = new_figure(figsize=(11, 1.1 * run.pp + 2.5))
    real, sim = fig.subplots(2, 1)
    plot_timeline(ch03.measured_timeline(per_rank), f"measured, last step (grey: waiting for a receive): {title}",
                  unit="seconds", ax=real)
    plot_timeline(simulate(run.kind, run.pp, run.micro_batches, run.num_chunks),
                  f"simulated with t_f = 1, t_b = 2: {title}", unit="time units", ax=sim)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------------------
# the numbers the chapter quotes (booktools/measured.py: `make numbers CH=03` reruns RUNS,
# records every value of measure() in chapters/03_pp/measured.json, and the <!--m:key-->
# markers of the README and the notebook's markdown are checked against it)
# ---------------------------------------------------------------------------------------
RUNS = {
    "figures": "python chapters/03_pp/make_figures.py",
    "demo-1f1b": "torchrun --standalone --nproc_per_node=4 chapters/03_pp/demo.py --pp 4 --schedule 1f1b",
    "demo-3d": "torchrun --standalone --nproc_per_node=8 chapters/03_pp/demo.py --tp 2 --pp 2 --dp 2",
}

def measure(outputs: dict[str, list[str]], results: dict[str, dict | None]) -> dict[str, float]:
    """Every number of the README and the notebook's markdown that the code computes or the runs
    measure, by marker key: the runs' results (FiguresResults, demo.PPResults) or the package's
    functions."""
    values = {}
    figures, demo, demo3d = results["figures"], results["demo-1f1b"], results["demo-3d"]

    # §2.1 what travels: the demo's ledger (1F1B), make_figures' interleaved run (v = 2)
    (end_calls, middle_calls), (end_bytes, middle_bytes) = demo["p2p_calls"][:2], demo["p2p_bytes"][:2]
    values |= {"p2p_message_bytes": end_bytes / end_calls, "p2p_end_messages": end_calls, "p2p_end_bytes": end_bytes,
               "p2p_middle_messages": middle_calls, "p2p_middle_bytes": middle_bytes}
    real = figures["pipelines"]
    interleaved, one_f_one_b, gpipe = (real[f"{k}, pp=4 x dp=1"] for k in ("interleaved v=2", "1f1b", "gpipe"))
    values |= {"p2p_interleaved_end_bytes": interleaved[0]["p2p"],
               "p2p_interleaved_middle_bytes": interleaved[1]["p2p"]}

    # §3.3 interleaving at m = p: Megatron-Core's warm-up, no special case
    values |= {f"warmup_m4_stage{r}": num_warmup_microbatches("interleaved", 4, r, 4, 2) for r in range(4)}
    values["makespan_m4_interleaved"] = max(i.end for i in simulate("interleaved", 4, 4, 2))
    values |= {f"peak_m4_interleaved_stage{r}": peak_in_flight(schedule("interleaved", 4, r, 4, 2)) for r in (2, 3)}
    makespans = {kind: max(i.end for i in simulate(kind, P, M, v)) for kind, v in KINDS}
    claim(makespans["gpipe"] == makespans["1f1b"], "GPipe and 1F1B end at the same time")
    values |= {"makespan_1f1b": makespans["1f1b"], "makespan_interleaved": makespans["interleaved"]}

    # §4.1 the bubble: the figure's simulated points and the table (and the questions' p = 8, m = 32)
    values["bubble_points"] = figures["bubble_points"]
    for p, m in ((4, 4), (4, 8), (4, 32), (8, 8), (8, 32), (8, 64)):
        for v in (1, 2, 4):
            b = bubble_fraction("1f1b" if v == 1 else "interleaved", p, m, v)
            values |= {f"idle_p{p}_m{m}_v{v}": b["idle"], f"over_ideal_p{p}_m{m}_v{v}": b["bubble_over_ideal"]}

    # §4.2 the demo's run and Figure 3 (wall clock: machine-dependent, never claimed fixed)
    values["demo_max_dloss"] = RoundOff(demo["max_loss_diff"])
    idle = demo["measured_idle"]
    values |= {"demo_measured_idle_min": min(idle), "demo_measured_idle_max": max(idle)}
    values |= {f"figure3_{k}": x for k, x in figures["figure3"].items()}

    # §5 activation memory: counts from the schedules, bytes measured by make_figures' runs
    for kind, v in KINDS:
        values |= {f"peak_{kind}_stage{r}": peak_in_flight(schedule(kind, P, r, M, v)) for r in range(P)}
        rows = real[f"{kind}{' v=2' if v > 1 else ''}, pp={P} x dp=1"]
        values |= {f"peak_bytes_{kind}_stage{r}": row["peak"] for r, row in enumerate(rows)}
    two_layers = one_f_one_b[1]["chunks"][0]
    values |= {"bytes_two_layers": two_layers, "bytes_stage0_extra": one_f_one_b[0]["chunks"][0] - two_layers,
               "bytes_stage3_extra": one_f_one_b[3]["chunks"][0] - two_layers}
    ratio = [interleaved[r]["peak"] / one_f_one_b[r]["peak"] for r in range(P)]
    values |= {f"interleaved_over_1f1b_stage{r}": ratio[r] for r in range(P)}
    values |= {"interleaved_over_1f1b_min": min(ratio), "interleaved_over_1f1b_max": max(ratio),
               "interleaved_stage0_microbatches": values["peak_interleaved_stage0"] / V,
               "interleaved_stage0_count_ratio": values["peak_interleaved_stage0"] / V / values["peak_1f1b_stage0"]}
    claim(gpipe[0]["peak"] == 2 * one_f_one_b[0]["peak"] and gpipe[3]["peak"] == 8 * one_f_one_b[3]["peak"],
          "at m = 8 stage 0 holds exactly twice 1F1B's bytes, stage 3 eight times")
    claim(min(ratio) == ratio[0] and max(row["peak"] for row in interleaved) == interleaved[0]["peak"],
          "the peak of the pipeline, stage 0's, grows by the smallest factor")
    sends = [row["p2p"] // 2 for row in one_f_one_b]           # a stage sends half of what it moves
    values |= {"sent_held_min": min(sends), "sent_held_max": max(sends)}
    values["warmup_interleaved_stage0"] = num_warmup_microbatches("interleaved", P, 0, M, V)

    # §6.1 one step of interleaved v = 2 on pp = 2 x dp = 2: every rank's collectives
    stage0, stage1 = figures["ledger"]["0"], figures["ledger"]["2"]
    p2p = [stage0[key] for key in stage0 if key.split()[1].startswith("pp-")]
    values |= {"ledger_dp_allreduces": stage0["all_reduce grads"][0],
               "ledger_dp_bytes_stage0": stage0["all_reduce grads"][1],
               "ledger_dp_params_stage0": stage0["all_reduce grads"][1] // 8,
               "ledger_dp_bytes_stage1": stage1["all_reduce grads"][1],
               "ledger_dp_params_stage1": stage1["all_reduce grads"][1] // 8,
               "ledger_tied_allreduces": stage0["all_reduce embedding-grads"][0],
               "ledger_tied_bytes": stage0["all_reduce embedding-grads"][1],
               "ledger_norm_allreduces": stage0["all_reduce grad-norm"][0],
               "ledger_loss_allreduces": stage0["all_reduce loss"][0],
               "ledger_p2p_messages": sum(n for n, _ in p2p), "ledger_p2p_bytes": sum(b for _, b in p2p)}

    # §7.1 3D on 8 ranks (the demo)
    values |= {"demo3d_max_dloss": RoundOff(demo3d["max_loss_diff"]),
               "demo3d_max_dgrad": RoundOff(demo3d["max_grad_diff"]),
               "demo3d_max_dparam": RoundOff(demo3d["max_param_diff"]),
               **{f"demo3d_held_stage{s}": demo3d["held"][s] for s in (0, 1)},
               **{f"demo3d_bytes_stage{s}": demo3d["held_bytes"][s] for s in (0, 1)},
               "demo3d_p2p_bytes": demo3d["p2p_bytes"][0]}

    # the questions (README §12, the notebook's last cells: the same calls as its checking cell)
    values |= {f"q8_over_ideal_p{p}": bubble_fraction("1f1b", p, 8 * p)["bubble_over_ideal"] for p in (2, 4, 8, 16)}
    values["q3_m_1f1b"] = next(m for m in range(1, 1000) if bubble_fraction("1f1b", 8, m)["idle"] <= 0.05)
    values["q3_m_interleaved_v4"] = next(m for m in range(8, 1000, 8)
                                         if bubble_fraction("interleaved", 8, m, 4)["idle"] <= 0.05)
    values |= {"q4_gpipe": peak_in_flight(schedule("gpipe", 8, 0, 32)),
               "q4_1f1b": peak_in_flight(schedule("1f1b", 8, 0, 32)),
               "q4_interleaved_chunks": peak_in_flight(schedule("interleaved", 8, 0, 32, 2)),
               "q4_interleaved_microbatches": peak_in_flight(schedule("interleaved", 8, 0, 32, 2)) / 2}
    return {key: x if isinstance(x, RoundOff) else int(x) if float(x).is_integer() else float(x)
            for key, x in values.items()}


@dataclass
class FiguresResults:
    """The numbers main printed: the bubble's simulated points, each measured pipeline's stages
    ({count, peak, chunks, p2p}: in flight, bytes at the peak, bytes of one micro-batch-chunk of
    each chunk, p2p bytes per step), the pp=2 x dp=2 ledger ({rank: {"op tag": [calls, bytes]}})
    and Figure 3's medians (ms, to the printed 2 decimals)."""
    exit_code: int = 0
    bubble_points: int = 0
    pipelines: dict = field(default_factory=dict)
    ledger: dict = field(default_factory=dict)
    figure3: dict = field(default_factory=dict)


def main(argv=None) -> FiguresResults:
    plt.switch_backend("Agg")       # a script: no screen (importing this file leaves the backend alone)
    simulated_only = "--simulated-only" in (sys.argv[1:] if argv is None else argv)
    OUT.mkdir(parents=True, exist_ok=True)
    print(f"chapter 03 figures, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    closed_forms_section()
    schedules_section()
    found = FiguresResults(bubble_points=bubble_section())
    rank_grid_section()
    if simulated_only:
        print("\n--simulated-only: the measured figures (timeline_1f1b_measured.png, activations.png) are kept")
        return found

    per_rank = spawn(ch03.train_runs, 4, PIPELINES, timeout=600)
    per_run = [[r[i] for r in per_rank] for i in range(len(PIPELINES))]
    real = check_real(PIPELINES, per_run)
    found.pipelines = {r["name"]: [{"count": count, "peak": peak, "chunks": chunks, "p2p": sent}
                                   for _, count, peak, chunks, sent, _ in r["rows"]] for r in real.values()}
    found.ledger = ledger_section(PIPELINES[3], per_run[3])
    found.figure3 = draw_measured(PIPELINES[1], per_run[1])
    draw_activations(real)

    print("\n== bytes at the peak (pp=4, m=8), interleaved / 1F1B and GPipe / 1F1B per stage")
    for s in range(P):
        one = real[("1f1b", P, 1)]["rows"][s][2]
        print(f"  stage {s}: interleaved {real[('interleaved', P, 1)]['rows'][s][2] / one:.2f} x, "
              f"GPipe {real[('gpipe', P, 1)]['rows'][s][2] / one:.2f} x")
    print("\nall checks passed: simulated idle == formula, peaks == closed form == measured, p2p bytes == formula, "
          "peak bytes == replay of the measured per-micro-batch bytes, one DP all-reduce per chunk and step")
    for path in sorted(OUT.glob("*.png")):
        print(f"{path.name}: {path.stat().st_size / 1024:.0f} KB")
    return found


if __name__ == "__main__":
    sys.exit(main().exit_code)
