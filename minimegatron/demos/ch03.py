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
from ..data.gpt_dataset import global_sample_indices
from ..pp.engine import PipelineEngine, PipelineOptimizer
from ..pp.p2p import PipelineComm
from ..pp.schedules import check_schedule_args, schedule
from ..pp.stages import build_stage_chunks, stage_layers
from ..pp.timeline import peak_in_flight
from ..testing import EquivalenceReport, RunRecord, compare_runs, make_batches, single_device_run
from ..tp import full_parameters
from ..train import build_optimizer, learning_rate, optimizer_step
from .ch00 import tiny_gpt2, tiny_llama

__all__ = ["PPRun", "tiny_model", "make_run", "train_run", "train_runs", "check_run", "RunReport", "expected_p2p_ledger"]


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
        t = self.train
        return make_batches(self.model, t.train_iters, t.micro_batch_size * t.grad_accum_steps * self.dp,
                            t.seq_length, seed=self.seed)

    def local_microbatches(self, batch: dict, dp_rank: int) -> list[dict]:
        t = self.train
        return [{k: v[global_sample_indices(0, t.micro_batch_size, m, t.grad_accum_steps, dp_rank, self.dp)]
                 for k, v in batch.items()} for m in range(t.grad_accum_steps)]


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
        out["intervals"] = rec.intervals
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


@dataclass
class RunReport:
    run: PPRun
    equivalence: EquivalenceReport
    peaks: list[tuple[int, int, int]]          # per stage (pipeline 0): measured, schedule's, bytes
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.equivalence.ok and not self.problems


def check_run(run: PPRun, per_rank: list[dict]) -> RunReport:
    """Judge a run (per_rank: every rank's train_run record, in rank order)."""
    problems = []
    reference = single_device_run(run.model, run.global_batches(), run.train, grad_accum_steps=run.micro_batches)
    pipelines: dict[int, dict[int, dict]] = {}
    for r in per_rank:
        if r["tp_rank"] == 0:                      # one rank of each TP group speaks for it
            pipelines.setdefault(r["dp_rank"], {})[r["pp_rank"]] = r
    first = pipelines[0]
    last_stage = first[run.pp - 1]
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
    del last_stage
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
    return RunReport(run, equivalence, peaks, problems)
