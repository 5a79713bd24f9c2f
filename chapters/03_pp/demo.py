"""Chapter 03 demo: pipeline parallelism (and 3D), proven on tp x pp x dp ranks.

    torchrun --standalone --nproc_per_node=4 chapters/03_pp/demo.py --pp 4 --schedule 1f1b
    torchrun --standalone --nproc_per_node=4 chapters/03_pp/demo.py --pp 4 --schedule gpipe
    torchrun --standalone --nproc_per_node=4 chapters/03_pp/demo.py --pp 2 --schedule interleaved --chunks 2 --dp 2
    torchrun --standalone --nproc_per_node=8 chapters/03_pp/demo.py --tp 2 --pp 2 --dp 2      # 3D
    torchrun --standalone --nproc_per_node=4 chapters/03_pp/demo.py --pp 2 --dp 2 --zero-stage 1   # ZeRO x PP
    python chapters/03_pp/demo.py                     # no torchrun: spawns the ranks (pp 4, 1f1b) itself
    python chapters/03_pp/demo.py --quick --pp 2      # a few seconds

This file is the chapter's experiment and its command line. The tests, the graders, the
notebook and make_figures.py run the same experiment from Python:

    from minimegatron.launch import spawn
    from booktools.demo import import_chapter
    ch03 = import_chapter("03")              # this file, as chapters.03_pp.demo
    run = ch03.make_run(ch03.tiny_model("gpt2"), pp=4, kind="1f1b", micro_batches=8)
    per_rank = spawn(ch03.train_run, 4, run)
    report = ch03.check_run(run, per_rank)        # equivalence, p2p ledger, in-flight micro-batches

A `PPRun` trains one model on tp x pp x dp ranks (Megatron's order: tp fastest, pp slowest).
Every rank builds its chunks as the training loop does (parallelize.build_model: the layers
cut from the single-device model, pp.build_stage -> tensor parallel -> chapter 01's bucketed
DDP), and runs `--steps` AdamW steps of train.train_step: the schedule `--schedule` over
`--micro-batches` micro-batches (pp.forward_backward_pipelining), model.finalize_model_grads
(the gradient hooks: the DP sync, the tied embedding's sum), the optimizer step (the global
gradient norm and clipping, AdamW). `train_run` trains it on every rank; `check_run` judges it, in the parent (or on rank 0
under torchrun), against independent references:

  [1/4] equivalence: losses, first-step gradients and final parameters, gathered from the
        stages under single-device names (parallelize.full_model_tensors), against
        `testing.single_device_run` on the same global batches;
  [2/4] the bubble: the textbook idle fraction, the unit-cost simulation of the same
        schedules (the line "simulated, t_b=2t_f": a forward costs 1, a backward 2, per
        micro-batch and stage, communication free), and the wall clock of the last real step,
        per stage;
  [3/4] activations held at once: the peak number of micro-batch-chunks in flight on each
        stage, measured, against pp.timeline.peak_in_flight of the schedule, and the bytes
        saved for backward at the peak;
  [4/4] the p2p ledger of a step against analysis.pipeline_messages: per boundary between virtual stages,
        one activation forward and one gradient backward per micro-batch, b s h e bytes each;

draws the last step's timeline next to the simulated one (--figure, default
runs/ch03_timeline.png), and ends with a line starting MATCH (exit 0) or MISMATCH (exit 1).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch

import minimegatron.pp as pipeline
from minimegatron import comm
from minimegatron.analysis.communication import pipeline_messages
from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.dp import apply_data_parallel, local_tensors, unwrap
from minimegatron.optim import learning_rate, param_is_not_shared
from minimegatron.parallel_state import Layout
from minimegatron.parallelize import build_model, build_optimizer, full_model_tensors, validate_layout
from minimegatron.placement import gather_full_tensors
from minimegatron.pp import (KINDS, Interval, PipelineComm, bubble_fraction, check_schedule_args, idle_fraction,
                             peak_in_flight, simulate)
from minimegatron.testing import (EquivalenceReport, RunRecord, compare_runs, local_microbatch, single_device_run)
from minimegatron.tp import apply_tensor_parallel
from minimegatron.resume import initialize_layout
from minimegatron.train import before_optimizer_step, train_step
from booktools.demo import (Results, Run, add_training_flags, check_at_least_one, demo_parser, import_chapter,
                            model_line, run_demo, verdict_line)

# A rank calls exercise 3.2 (stage_layers) as pipeline.stage_layers, an attribute of the
# package minimegatron.pp: a grader's plug (booktools.exercises) swaps it there.


def tiny_model(style: str = "gpt2", dtype: str = "float64", **overrides) -> ModelConfig:
    """h = 32, 4 layers (so 4 stages, or 2 stages x 2 chunks, each get one), a = 4 heads
    (LLaMA: g = 2 key/value groups), sequences up to 16, V = 257, in `dtype`. GPT-2 style ties
    the embeddings: the first and last stage both hold the matrix."""
    base = {"hidden_size": 32, "num_layers": 4, "num_attention_heads": 4, "max_position_embeddings": 16,
            "params_dtype": dtype}
    if style == "gpt2":
        return ModelConfig.gpt2(**{**base, **overrides}).validate()
    return ModelConfig.llama(**{**base, "num_query_groups": 2, **overrides}).validate()


# ---------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PPRun(Run):
    """One run (booktools.demo.Run): `model` on tp x pp x dp ranks, as `train` says (its
    tensor_model_parallel_size, pipeline_model_parallel_size, pipeline_schedule and
    num_virtual_stages_per_pipeline_rank: the training loop's own fields; grad_accum_steps = M
    micro-batches of micro_batch_size = b rows per step and pipeline; train_iters steps), `dp`
    data-parallel pipelines, optional uneven layers_per_stage."""
    layers_per_stage: tuple[int, ...] | None = None

    kind = property(lambda self: self.train.pipeline_schedule)
    num_chunks = property(lambda self: self.train.num_virtual_stages_per_pipeline_rank)

    def name(self) -> str:
        return ("pipeline parallelism on " + (f"tp={self.tp} x " if self.tp > 1 else "") + f"pp={self.pp} x dp={self.dp}"
                + (f" (ZeRO-{self.train.zero_stage})" if self.train.zero_stage else ""))

    def local_microbatches(self, batch: dict, dp_rank: int) -> list[dict]:
        """This data-parallel rank's M micro-batches (every stage of its pipeline reads them)."""
        return [local_microbatch(batch, self.train, m, dp_rank, self.dp) for m in range(self.micro_batches)]


def make_run(model: ModelConfig, pp: int = 2, dp: int = 1, kind: str = "1f1b", *, num_chunks: int = 1,
             micro_batches: int = 4, micro_batch_size: int = 2, steps: int = 2, clip_grad: float = 0.05,
             layers_per_stage: list[int] | None = None, seed: int = 0, tp: int = 1, zero_stage: int = 0) -> PPRun:
    """A validated PPRun: ValueError / ConfigError naming the numbers for a schedule or a
    partition that cannot work (checked before any process starts; parallelize.validate_layout
    for even splits, as train.py). clip_grad 0.05 is below the tiny model's gradient norm: every
    step clips, so the norm summed over the stages (tied embedding counted once) is checked too.
    zero_stage 1 or 2: chapter 01's ZeRO over each stage's data-parallel ranks, one optimizer
    over every chunk (the tied embedding in a bucket of its own, sharded alike on both stages)."""
    check_schedule_args(kind, pp, 0, micro_batches, num_chunks)
    for r in range(pp):
        for c in range(num_chunks):
            pipeline.stage_layers(model.num_layers, pp, r, num_chunks, c, layers_per_stage)
    train = TrainConfig(seq_length=model.max_position_embeddings, micro_batch_size=micro_batch_size,
                        grad_accum_steps=micro_batches, train_iters=steps, lr_warmup_iters=0, clip_grad=clip_grad,
                        adam_eps=1e-5 if model.params_dtype == "float32" else 1e-8, progress=False,
                        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_schedule=kind,
                        num_virtual_stages_per_pipeline_rank=num_chunks, eval_interval=0, zero_stage=zero_stage)
    if layers_per_stage is None:
        validate_layout(model, train, tp * pp * dp)
    else:                                                # build_model cuts evenly only: see build_chunks
        train.validate(model.validate())
    return PPRun(model, train, dp, seed, None if layers_per_stage is None else tuple(layers_per_stage))


# ---------------------------------------------------------------------------------------
# on every rank
# ---------------------------------------------------------------------------------------
def build_chunks(run: PPRun, layout: Layout) -> list[torch.nn.Module]:
    """This rank's model chunks. Even splits: parallelize.build_model, as train.py builds them.
    Uneven (run.layers_per_stage): build_model cuts evenly only, so its three steps by hand:
    pp.build_stage with the counts, then tp.apply_tensor_parallel, then dp.apply_data_parallel."""
    if run.layers_per_stage is None:
        return build_model(run.model, run.train, layout)
    return [apply_data_parallel(apply_tensor_parallel(
        pipeline.build_stage(run.model, layout, c, run.num_chunks, list(run.layers_per_stage)), layout.tp_group),
        run.train, layout.dp_group) for c in range(run.num_chunks)]


def train_run(run: PPRun) -> dict:
    """Spawn (or torchrun) target on each of run.world ranks. Returns {"pp_rank", "dp_rank",
    "tp_rank", "losses" (per step: this pipeline's mean loss, the same on every stage),
    "grads" (first step) and "params" (final): the whole single-device model of this rank's
    pipeline, by single-device name and full shape (parallelize.full_model_tensors; the last
    stage's copy of a tied embedding left out), "names" (the parameters this rank holds, its
    tied copy left out), "numel" (elements of every parameter this rank holds, its copy
    included), "ledger" [step] -> [(op, bytes, tag)] (the schedule, finalize_model_grads and
    the norm; no inspection gathers), "peak_in_flight", "peak_bytes", "saved_bytes" (per
    micro-batch-chunk, first step), "intervals" and "t0" (last step), "layers" (per chunk),
    "tied_copy" (the last stage's output layer, when tied)}.

    Every step is train.train_step, its forward and backward the schedule's
    (pp.forward_backward_pipelining), its StepRecord kept (`records`: the timings and the saved
    bytes); the gradients are read between finalize_model_grads and the optimizer
    (train.before_optimizer_step), their gathers left out of the ledger."""
    import torch.distributed as dist

    if dist.get_world_size() != run.world:
        raise ValueError(f"this run needs tp x pp x dp = {run.tp} x {run.pp} x {run.dp} = {run.world} ranks, "
                         f"the world has {dist.get_world_size()}")
    t = run.train
    layout = initialize_layout(t)
    chunks = build_chunks(run, layout)
    optimizer = build_optimizer(chunks, t, layout)
    p2p = PipelineComm(layout.pp_ranks, layout.pp_rank, run.num_chunks,
                       (t.micro_batch_size, t.seq_length, run.model.hidden_size), run.model.dtype)
    models = [unwrap(c) for c in chunks]
    out = {"pp_rank": layout.pp_rank, "dp_rank": layout.dp_rank, "tp_rank": layout.tp_rank,
           "losses": [], "ledger": [], "peak_in_flight": 0, "peak_bytes": 0,
           "layers": [m.layer_numbers for m in models],
           "names": [n for m in models for n, p in m.named_parameters() if param_is_not_shared(p)],
           "numel": sum(p.numel() for m in models for p in m.parameters())}
    for step, batch in enumerate(run.global_batches()):
        records = []

        def on_grads(step=step):
            if step == 0:
                out["grads"] = full_model_tensors(chunks, layout, grads=True)     # (tag "full": left out)

        # the ledger: the schedule, the DP and embedding syncs, the norm
        with comm.record_communication() as ledger, before_optimizer_step(optimizer, on_grads):
            loss, _ = train_step(chunks, optimizer, run.local_microbatches(batch, layout.dp_rank), layout,
                                 learning_rate(step, t), p2p, run.kind, records=records)
        rec = records[0]
        if step == 0:
            out["saved_bytes"] = dict(rec.saved_bytes)
        out["losses"].append(loss)
        out["ledger"].append([(r.op, r.nbytes, r.tag) for r in ledger if r.tag != "full"])
        out["peak_in_flight"] = max(out["peak_in_flight"], rec.peak_in_flight)
        out["peak_bytes"] = max(out["peak_bytes"], rec.peak_bytes)
        out["intervals"], out["t0"] = rec.intervals, rec.t0
    out["params"] = full_model_tensors(chunks, layout)
    for model in models:                           # the last stage's copy of a tied embedding
        if model.post_process and not model.pre_process and not run.model.untie_embeddings_and_output_weights:
            out["tied_copy"] = gather_full_tensors(local_tensors(model), copies=True)["output_layer.weight"]
    return out


def train_runs(runs: list[PPRun]) -> list[dict]:
    """train_run for each of `runs` in turn, in one world (each run's tp x pp x dp must be the
    world size): starting ranks costs seconds, a tiny run a fraction of one."""
    return [train_run(run) for run in runs]


# ---------------------------------------------------------------------------------------
# the formulas and the verdict
# ---------------------------------------------------------------------------------------
def expected_p2p_ledger(run: PPRun, pp_rank: int) -> list[tuple[str, int, str]]:
    """The p2p calls of one step on stage `pp_rank`, as (op, bytes, tag):
    analysis.pipeline_messages (per virtual stage and micro-batch, the activation received
    and sent, "pp-fwd", its gradient received and sent, "pp-bwd"; b s h e bytes each)."""
    return [(op, n, tag) for (op, tag, n), c in pipeline_messages(run.model, run.train, pp_rank).items()
            for _ in range(c)]


def measured_timeline(per_rank: list[dict]) -> list[Interval]:
    """The last step of pipeline 0 (dp rank 0, tp rank 0 of each stage) on one time axis:
    each stage's intervals shifted by its step start minus the earliest (perf_counter is one
    clock for the whole machine); Interval.rank is the pipeline stage."""
    stages = {r["pp_rank"]: r for r in per_rank if r["dp_rank"] == 0 and r["tp_rank"] == 0}
    origin = min(r["t0"] for r in stages.values())
    return sorted((Interval(stage, i.op, i.microbatch, i.chunk, i.start + r["t0"] - origin, i.end + r["t0"] - origin)
                   for stage, r in stages.items() for i in r["intervals"]), key=lambda i: (i.rank, i.start))


@dataclass
class RunReport:
    run: PPRun
    equivalence: EquivalenceReport
    peaks: list[tuple[int, int, int]]          # per stage (pipeline 0): measured, schedule's, bytes
    p2p: list[tuple[int, int, int]]            # per stage (pipeline 0): calls, bytes measured, bytes formula
    measured_idle: list[float]                 # per stage, the last step's wall clock
    simulated_idle: list[float]                # per stage, unit costs t_f = 1, t_b = 2
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.equivalence.ok and not self.problems

    @property
    def formula(self) -> dict[str, float]:
        r = self.run
        return bubble_fraction(r.kind, r.pp, r.micro_batches, r.num_chunks)

    def __str__(self) -> str:
        r, t = self.run, self.run.train
        layout = (f"tp={r.tp} x " if r.tp > 1 else "") + f"pp={r.pp} x dp={r.dp}"
        lines = [f"=== {r.kind}" + (f" with {r.num_chunks} chunks per rank" if r.num_chunks > 1 else "")
                 + f", {layout} ({r.world} ranks), m={r.micro_batches} micro-batches of {t.micro_batch_size} x "
                 f"{t.seq_length} tokens, {t.train_iters} steps, {r.model.params_dtype}, clip_grad {t.clip_grad}",
                 f"[1/4] equivalence with the single-device run on the same global batch "
                 f"({t.micro_batch_size * r.micro_batches * r.dp} sequences per step):"]
        lines += ["      " + x for x in str(self.equivalence).splitlines()[:7]]
        f = self.formula
        lines.append(f"[2/4] the bubble: formula (p-1)/(v m + p-1) = {r.pp - 1}/({r.num_chunks} x {r.micro_batches} "
                     f"+ {r.pp - 1}) = {f['idle']:.3f} of the step idle on every stage (bubble/ideal "
                     f"(p-1)/(v m) = {f['bubble_over_ideal']:.3f})")
        lines.append("      stage:              " + " ".join(f"{s:>6}" for s in range(r.pp)))
        lines.append("      simulated, t_b=2t_f:" + " ".join(f"{x:6.3f}" for x in self.simulated_idle)
                     + "   (timeline.simulate, t_f = 1 and t_b = 2 per micro-batch, free p2p)")
        lines.append("      measured, last step:" + " ".join(f"{x:6.3f}" for x in self.measured_idle)
                     + "   (wall clock; ranks share this machine's cores)")
        lines.append("[3/4] activations held at once (micro-batch-chunks), measured vs the schedule's peak:")
        for stage, (got, want, nbytes) in enumerate(self.peaks):
            lines.append(f"      stage {stage}: {got} (schedule: {want}), {nbytes:,} bytes saved for backward at the peak"
                         + (": OK" if got == want else ": DIFFERENT"))
        lines.append("[4/4] p2p per step (ledger vs formula: one b s h e activation forward and one gradient "
                     "backward per micro-batch and stage boundary):")
        for stage, (calls, got, want) in enumerate(self.p2p):
            lines.append(f"      stage {stage}: {calls} sends+receives, {got:,} bytes / formula {want:,}: "
                         + ("OK" if got == want else "DIFFERENT"))
        lines += [f"      problem: {p}" for p in self.problems[:6]]
        if len(self.problems) > 6:
            lines.append(f"      ... and {len(self.problems) - 6} more problems")
        return "\n".join(lines)


def summary_line(reports: list[RunReport]) -> str:
    """The demo's last line: MATCH ... or MISMATCH ..."""
    return verdict_line(reports, lambda r: f"{r.run.kind} " + r.run.name().removeprefix("pipeline parallelism on "),
                        "in-flight counts and p2p bytes equal the formulas")


def check_run(run: PPRun, per_rank: list[dict]) -> RunReport:
    """Judge a run (per_rank: every rank's train_run record, in rank order)."""
    problems = []
    reference = single_device_run(run.model, run.global_batches(), run.train, grad_accum_steps=run.micro_batches)
    pipelines: dict[int, dict[int, dict]] = {}
    for r in per_rank:
        if r["tp_rank"] == 0:                      # one rank of each TP group speaks for it
            pipelines.setdefault(r["dp_rank"], {})[r["pp_rank"]] = r
    first = pipelines[0]
    dp_losses = [pipelines[d][run.pp - 1]["losses"] for d in sorted(pipelines)]
    losses = [sum(step) / len(dp_losses) for step in zip(*dp_losses)]
    holders = Counter(name for stage in range(run.pp) for name in first[stage]["names"])
    problems += [f"{name} is held by {n} stages" for name, n in holders.items() if n > 1]
    equivalence = compare_runs(reference, RunRecord(losses, first[0]["grads"], first[0]["params"]), run.model.dtype)
    peaks = []
    for stage in range(run.pp):
        rec = first[stage]
        want = peak_in_flight(pipeline.schedule(run.kind, run.pp, stage, run.micro_batches, run.num_chunks))
        peaks.append((rec["peak_in_flight"], want, rec["peak_bytes"]))
        if rec["peak_in_flight"] != want:
            more = "more" if rec["peak_in_flight"] > want else "fewer"
            problems.append(f"stage {stage}: {rec['peak_in_flight']} micro-batch-chunks held at once, {more} than "
                            f"the schedule's peak of {want} (the warm-up count decides it)")
    for rank, rec in enumerate(per_rank):
        want = Counter(expected_p2p_ledger(run, rec["pp_rank"]))
        for step, calls in enumerate(rec["ledger"]):
            got = Counter(c for c in calls if c[2] in ("pp-fwd", "pp-bwd"))
            if got != want:
                problems.append(f"p2p ledger, rank {rank}, step {step}: measured {dict(got)}, formula {dict(want)}")
    p2p = []
    for stage in range(run.pp):
        calls = [c for c in first[stage]["ledger"][0] if c[2] in ("pp-fwd", "pp-bwd")]
        p2p.append((len(calls), sum(n for _, n, _ in calls), sum(n for _, n, _ in expected_p2p_ledger(run, stage))))
    timeline = measured_timeline(per_rank)
    simulated = simulate(run.kind, run.pp, run.micro_batches, run.num_chunks)
    return RunReport(run, equivalence, peaks, p2p, [idle_fraction(timeline, s) for s in range(run.pp)],
                     [idle_fraction(simulated, s) for s in range(run.pp)], problems)


# ---------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = demo_parser("03", "Chapter 03: train a tiny model pipeline-parallel (optionally x tensor x data parallel) "
                               "and check it against the single-device run, the bubble formula, the in-flight "
                               "micro-batches and the p2p formula.")
    parser.add_argument("--pp", type=int, default=4, help="pipeline stages (default 4)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size inside each stage (default 1)")
    parser.add_argument("--dp", type=int, default=None,
                        help="data-parallel pipelines (default: world / (tp pp) under torchrun, 1 without)")
    parser.add_argument("--schedule", choices=KINDS, default="1f1b", help="default 1f1b")
    parser.add_argument("--chunks", type=int, default=None,
                        help="model chunks per rank for --schedule interleaved (default 2)")
    add_training_flags(parser, style="gpt2", micro_batches=8)      # gpt2: tied, first and last stage share it
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2], default=0,
                        help="chapter 01's ZeRO over each stage's data-parallel ranks (default 0: bucketed DDP)")
    parser.add_argument("--figure", default="runs/ch03_timeline.png", help="where to draw the timelines ('' : none)")
    args = parser.parse_args(argv)
    if args.chunks is None:
        args.chunks = 2 if args.schedule == "interleaved" else 1
    return check_at_least_one(parser, args, "pp", "tp", "chunks", "micro_batches", "micro_batch_size", "dp",
                              "steps")


def build_run(args: argparse.Namespace, dp: int) -> PPRun:
    """The run every rank trains; ConfigError / ValueError naming the numbers if it cannot."""
    layers = args.pp * args.chunks * (1 if args.quick else 2)
    sizes = {} if args.quick else dict(hidden_size=64, max_position_embeddings=32)
    extra = {"num_query_groups": args.tp} if args.style == "llama" else {}
    model = tiny_model(args.style, args.dtype, num_layers=layers, **sizes, **extra)
    return make_run(model, pp=args.pp, dp=dp, tp=args.tp, kind=args.schedule, num_chunks=args.chunks,
                    micro_batches=args.micro_batches, micro_batch_size=args.micro_batch_size,
                    steps=args.steps if args.steps is not None else (2 if args.quick else 3), zero_stage=args.zero_stage)


@dataclass
class PPResults(Results):
    """What the report printed, per stage of pipeline 0: micro-batch-chunks held at once
    (measured, the schedule's) and the bytes saved at the peak; p2p calls, bytes and the
    formula's bytes per step; the idle fraction (measured, simulated; 3 decimals as printed);
    the largest differences from the single-device run (2 digits as printed)."""
    max_loss_diff: float = 0.0
    max_grad_diff: float = 0.0
    max_param_diff: float = 0.0
    held: list = field(default_factory=list)
    held_schedule: list = field(default_factory=list)
    held_bytes: list = field(default_factory=list)
    p2p_calls: list = field(default_factory=list)
    p2p_bytes: list = field(default_factory=list)
    p2p_formula: list = field(default_factory=list)
    measured_idle: list = field(default_factory=list)
    simulated_idle: list = field(default_factory=list)


def report(args, run: PPRun, per_rank: list[dict]) -> PPResults:
    """Check the run, print the report (and draw its timelines); return its results."""
    print(model_line(run.model, f" ({run.model.num_layers // (run.pp * run.num_chunks)} per virtual stage)"))
    print()
    result = check_run(run, per_rank)
    print(result)
    if args.figure:               # the figure code lives with the chapter's other figures
        import_chapter("03", "make_figures").draw_run(run, per_rank, args.figure)
        print(f"      timelines: {args.figure}")
    e = result.equivalence
    return PPResults(0, summary_line([result]),
                     *(float(f"{x:.1e}") for x in (e.max_loss_diff, e.max_grad_diff, e.max_param_diff)),
                     *map(list, zip(*result.peaks)), *map(list, zip(*result.p2p)),
                     [round(x, 3) for x in result.measured_idle], [round(x, 3) for x in result.simulated_idle])


def main(argv=None) -> PPResults:
    return run_demo(parse_args(argv), "03", build_run, train_run, report,
                    model_parallel=lambda args: {"tp": args.tp, "pp": args.pp})


if __name__ == "__main__":      # the guard matters: spawned ranks import this file again
    sys.exit(main().exit_code)
