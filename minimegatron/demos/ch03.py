"""Chapter 03, pipeline parallelism: the runs its tests, notebook and demo make.

    from minimegatron.demos import ch03
    from minimegatron.launch import spawn
    run = ch03.make_run(ch03.tiny_model("gpt2"), pp=4, kind="1f1b", micro_batches=8)
    per_rank = spawn(ch03.train_run, 4, run)
    report = ch03.check_run(run, per_rank)      # equivalence, p2p ledger, in-flight micro-batches

A `PPRun` trains one model on pp x dp ranks (the pipeline group varies slowest, Megatron's
order "tp-cp-ep-dp-pp"): each pipeline holds the model cut into stages
(pp.stages.build_stage_chunks) and runs the schedule `kind` (pp.schedules) over M
micro-batches per step; the dp pipelines are data-parallel replicas, each chunk wrapped in
chapter 01's bucketed DDP. `train_run` trains it on every rank; `check_run` judges it, in the
parent, against independent references:

  equivalence    testing.single_device_run on the same global batches (losses, first-step
                 gradients and final parameters, merged from the stages by their global names);
  communication  the p2p ledger of a step against the formula: per boundary between virtual
                 stages, one activation forward and one gradient backward per micro-batch,
                 b s h e bytes each;
  memory         the peak number of micro-batch-chunks whose activations a stage holds,
                 measured, against pp.timeline.peak_in_flight of the schedule, and its bytes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from .. import comm, parallel_state
from ..config import ModelConfig, TrainConfig
from ..pp.engine import PipelineEngine, PipelineOptimizer
from ..pp.p2p import PipelineComm
from ..pp.schedules import check_schedule_args, schedule
from ..pp.stages import build_stage_chunks, stage_layers
from ..pp.timeline import Interval, bubble_fraction, idle_fraction, peak_in_flight, simulate
from ..testing import EquivalenceReport, RunRecord, compare_runs, global_batches, local_microbatch, single_device_run
from ..tp import full_parameters
from ..train import build_optimizer, learning_rate, optimizer_step
from .ch00 import tiny_gpt2, tiny_llama

__all__ = ["PPRun", "tiny_model", "make_run", "train_run", "train_runs", "check_run", "RunReport", "expected_p2p_ledger",
           "measured_timeline", "summary_line"]


def tiny_model(style: str = "gpt2", dtype: str = "float64", **overrides) -> ModelConfig:
    """h = 32, 4 layers (so 4 stages, or 2 stages x 2 chunks, each get one), sequences up to 16,
    V = 257, in `dtype`. GPT-2 style ties the embeddings: the first and last stage both hold
    the matrix."""
    base = {"hidden_size": 32, "num_layers": 4, "max_position_embeddings": 16, "params_dtype": dtype}
    return (tiny_gpt2 if style == "gpt2" else tiny_llama)(**{**base, **overrides})


@dataclass(frozen=True)
class PPRun:
    """One run: `model` on tp x pp x dp ranks (tp > 1: 3D, each stage tensor-parallel),
    schedule `kind` with num_chunks chunks per rank,
    `train.grad_accum_steps` = M micro-batches of `train.micro_batch_size` = b rows per step and
    pipeline, `train.train_iters` steps, optional uneven layers_per_stage; seed: the batches."""
    model: ModelConfig
    pp: int
    dp: int
    kind: str
    num_chunks: int
    train: TrainConfig
    layers_per_stage: tuple[int, ...] | None = None
    seed: int = 0
    tp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def micro_batches(self) -> int:
        return self.train.grad_accum_steps

    def global_batches(self) -> list[dict[str, torch.Tensor]]:
        return global_batches(self.model, self.train, self.dp, self.seed)

    def local_microbatches(self, batch: dict, dp_rank: int) -> list[dict]:
        """This data-parallel rank's M micro-batches (every stage of its pipeline reads them)."""
        return [local_microbatch(batch, self.train, m, dp_rank, self.dp) for m in range(self.micro_batches)]


def make_run(model: ModelConfig, pp: int = 2, dp: int = 1, kind: str = "1f1b", *, num_chunks: int = 1,
             micro_batches: int = 4, micro_batch_size: int = 2, steps: int = 2, clip_grad: float = 0.05,
             layers_per_stage: list[int] | None = None, seed: int = 0, tp: int = 1) -> PPRun:
    """A validated PPRun: ValueError / ConfigError naming the numbers for a schedule or a
    partition that cannot work (checked on every rank's arguments, before any process starts).
    clip_grad 0.05 is below the tiny model's gradient norm: every step clips, so the norm
    summed over the stages (tied embedding counted once) is checked too."""
    for r in range(pp):
        check_schedule_args(kind, pp, r, micro_batches, num_chunks)
        for c in range(num_chunks):
            stage_layers(model.num_layers, pp, r, num_chunks, c, layers_per_stage)
    train = TrainConfig(seq_length=model.max_position_embeddings, micro_batch_size=micro_batch_size,
                        grad_accum_steps=micro_batches, train_iters=steps, lr_warmup_iters=0, clip_grad=clip_grad,
                        adam_eps=1e-5 if model.params_dtype == "float32" else 1e-8, progress=False,
                        tensor_model_parallel_size=tp, eval_interval=0).validate(model.validate())
    return PPRun(model, pp, dp, kind, num_chunks, train, None if layers_per_stage is None else tuple(layers_per_stage),
                 seed, tp)


# ---------------------------------------------------------------------------------------
# on every rank
# ---------------------------------------------------------------------------------------
def train_run(run: PPRun) -> dict:
    """Spawn (or torchrun) target on each of run.pp * run.dp ranks. Returns {"pp_rank",
    "dp_rank", "losses" (per step; last stage only, else None), "grads" (first step) and
    "params" (final) of this rank's chunks under global names (the last stage's copy of a tied
    embedding left out), "ledger" [step] -> [(op, bytes, tag)], "peak_in_flight",
    "peak_bytes", "saved_bytes" (per micro-batch-chunk, first step), "intervals" (last step),
    "layers" (per chunk), "tied_copy" (the last stage's output layer, when tied)}.
    The step is the training loop's own (PipelineEngine, train.optimizer_step)."""
    import torch.distributed as dist

    if dist.get_world_size() != run.world:
        raise ValueError(f"this run needs tp x pp x dp = {run.tp} x {run.pp} x {run.dp} = {run.world} ranks, "
                         f"the world has {dist.get_world_size()}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=run.tp, pipeline_model_parallel_size=run.pp)
    pp_rank, dp_rank = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_data_parallel_rank()
    pp_group, dp_group = parallel_state.get_pipeline_model_parallel_group(), parallel_state.get_data_parallel_group()
    tp_group = parallel_state.get_tensor_model_parallel_group() if run.tp > 1 else None
    embedding_group = parallel_state.get_embedding_group() if run.pp > 1 else None

    chunks = build_stage_chunks(run.model, run.pp, pp_rank, run.num_chunks,
                                None if run.layers_per_stage is None else list(run.layers_per_stage), tp_group)
    t = run.train
    p2p = PipelineComm(parallel_state.get_group_ranks("pp"), pp_rank, run.num_chunks,
                       (t.micro_batch_size, t.seq_length, run.model.hidden_size), run.model.dtype)
    engine = PipelineEngine(chunks, run.kind, run.micro_batches, p2p, pp_group, embedding_group,
                            dp_group if run.dp > 1 else None, tp_group)
    optimizer = PipelineOptimizer(build_optimizer(engine.module, t), engine)
    out = {"pp_rank": pp_rank, "dp_rank": dp_rank, "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
           "losses": [], "ledger": [], "peak_in_flight": 0, "peak_bytes": 0,
           "layers": [c.layer_numbers for c in chunks], "ops": engine.ops}
    for step, batch in enumerate(run.global_batches()):
        with comm.record_communication() as ledger:     # the schedule, the DP and embedding syncs
            loss = engine.pipeline_step(run.local_microbatches(batch, dp_rank))
        if step == 0:
            out["grads"] = engine.stage_tensors("grads")           # (outside the ledger)
            out["saved_bytes"] = dict(engine.last_record.saved_bytes)
        with comm.record_communication() as ledger_step:          # the norm
            optimizer_step(engine, optimizer, learning_rate(step, t), t.clip_grad)
        rec = engine.last_record
        out["losses"].append(loss)
        out["ledger"].append([(r.op, r.nbytes, r.tag) for r in [*ledger, *ledger_step]])
        out["peak_in_flight"] = max(out["peak_in_flight"], rec.peak_in_flight)
        out["peak_bytes"] = max(out["peak_bytes"], rec.peak_bytes)
        out["intervals"], out["t0"] = rec.intervals, rec.t0
    out["params"] = engine.stage_tensors("params")
    for c, chunk in enumerate(chunks):             # the last stage's copy of a tied embedding
        if p2p.is_last(c) and not p2p.is_first(c) and not run.model.untie_embeddings_and_output_weights:
            out["tied_copy"] = (full_parameters(chunk) if tp_group is not None
                                else {"output_layer.weight": chunk.output_layer.weight.detach().clone()}
                                )["output_layer.weight"]
    return out


def train_runs(runs: list[PPRun]) -> list[dict]:
    """train_run for each of `runs` in turn, in one world (each run's pp x dp must be the
    world size): starting ranks costs seconds, a tiny run a fraction of one."""
    return [train_run(run) for run in runs]


# ---------------------------------------------------------------------------------------
# the formulas and the verdict
# ---------------------------------------------------------------------------------------
def expected_p2p_ledger(run: PPRun, pp_rank: int) -> list[tuple[str, int, str]]:
    """The p2p calls of one step on stage `pp_rank`, as (op, bytes, tag): for each of its
    virtual stages k and each micro-batch, a receive of the activation (k > 0) and a send of
    it (k < last), forward ("pp-fwd"); a receive of the gradient (k < last) and a send of it
    (k > 0), backward ("pp-bwd"); b s h e bytes each."""
    t, cfg = run.train, run.model
    nbytes = t.micro_batch_size * t.seq_length * cfg.hidden_size * torch.empty((), dtype=cfg.dtype).element_size()
    last = run.pp * run.num_chunks - 1
    calls = []
    for c in range(run.num_chunks):
        k = c * run.pp + pp_rank
        per_mb = ([("recv", nbytes, "pp-fwd"), ("send", nbytes, "pp-bwd")] if k > 0 else []) + \
                 ([("send", nbytes, "pp-fwd"), ("recv", nbytes, "pp-bwd")] if k < last else [])
        calls += per_mb * run.micro_batches
    return calls


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
        lines.append("      simulated (1, 2):   " + " ".join(f"{x:6.3f}" for x in self.simulated_idle))
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
    worst = {k: max(getattr(r.equivalence, k) for r in reports)
             for k in ("max_loss_diff", "max_grad_diff", "max_param_diff")}
    tol = reports[0].equivalence.tolerance
    diffs = (f"max |dloss| {worst['max_loss_diff']:.1e} (tol {tol.loss:.0e}), max |dgrad| {worst['max_grad_diff']:.1e}, "
             f"max |dparam| {worst['max_param_diff']:.1e} (rtol {tol.rtol:.0e}, atol {tol.atol:.0e})")
    names = ", ".join(f"{r.run.kind} " + (f"tp={r.run.tp} x " if r.run.tp > 1 else "") + f"pp={r.run.pp} x dp={r.run.dp}"
                      for r in reports)
    bad = [r for r in reports if not r.ok]
    if bad:
        return ("MISMATCH: " + "; ".join(f"{r.run.kind} pp={r.run.pp}: " + (r.problems[0] if r.problems else
                                                                           "differs from the single-device run")
                                         for r in bad) + f"; {diffs}")
    return f"MATCH: {names} equal the single-device run: {diffs}; in-flight counts and p2p bytes equal the formulas"


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
    grads, params = {}, {}
    for stage in range(run.pp):
        for name in first[stage]["grads"]:
            if name in grads:
                problems.append(f"{name} is held by two stages")
        grads.update(first[stage]["grads"])
        params.update(first[stage]["params"])
    equivalence = compare_runs(reference, RunRecord(losses, grads, params), run.model.dtype)
    peaks = []
    for stage in range(run.pp):
        rec = first[stage]
        want = peak_in_flight(schedule(run.kind, run.pp, stage, run.micro_batches, run.num_chunks))
        peaks.append((rec["peak_in_flight"], want, rec["peak_bytes"]))
        if rec["peak_in_flight"] != want:
            problems.append(f"stage {stage}: {rec['peak_in_flight']} micro-batch-chunks held at once, "
                            f"the schedule's peak is {want}")
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
