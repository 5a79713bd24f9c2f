"""Chapter 01 demo: data parallelism, from the naive all-reduce to ZeRO-3, proven on N ranks.

    torchrun --standalone --nproc_per_node=4 chapters/01_dp/demo.py --zero 1
    torchrun --standalone --nproc_per_node=4 chapters/01_dp/demo.py --zero 0 --ddp naive
    torchrun --standalone --nproc_per_node=2 chapters/01_dp/demo.py --zero all --micro-batches 4
    python chapters/01_dp/demo.py                   # no torchrun: spawns --ranks ranks (2) itself
    python chapters/01_dp/demo.py --quick --zero all            # every variant, a few seconds
    python chapters/01_dp/demo.py --quick --break-averaging     # the classic bug: MISMATCH

This file is the chapter's experiment and its command line; the notebook imports the same
functions (`ch01 = booktools.demo.import_chapter("01")`):

    variants = ch01.chapter_variants(ch01.tiny_model(), micro_batches=2)  # naive .. zero3
    results = spawn(ch01.run_variants, 2, [(2, v) for v in variants])     # one world
    reports = ch01.check_variants([(2, v) for v in variants], results)
    print(reports[0])     # equivalence, ledger against the formula, memory against the formula

A `Variant` is one data-parallel training run: a model config and a TrainConfig whose
zero_stage / ddp_impl / ddp_bucket_size pick the wrapper. Every rank builds the same tiny
model from (seed, parameter name), wraps it as `python -m minimegatron.train --zero-stage`
does (`dp.apply_data_parallel`, then `optim.Optimizer` over what the wrapper holds: under ZeRO
this rank's shards), and trains
`--steps` AdamW steps on its slice of a fixed global batch: `--micro-batches` M micro-batches
of `--micro-batch-size` b sequences per rank, the first M-1 inside `no_sync()`. Then rank 0 (or the parent, without torchrun) judges each
run (`check_variant`) against three things computed independently of the run, and prints:

  [1/3] equivalence: `testing.single_device_run` on the same global batches: the losses, the
        first step's gradients (reassembled to full single-device tensors) and the final
        parameters, compared by `testing.compare_runs` with the tolerance of the dtype; and
        whether every rank ends with bit-identical parameters (fingerprints);
  [2/3] communication: the ledger of each phase of every step on every rank (each
        micro-batch, the optimizer step), by collective, against `expected_ledger`:
        `analysis.data_parallel_phases`, the formulas of dp/naive.py, ddp.py, zero.py and
        fsdp.py evaluated on the parameter shapes alone;
  [3/3] memory per rank: parameter, gradient and AdamW-state bytes measured on the real
        tensors (storage sizes) against `expected_memory` (the same layout rules: buckets /
        units padded to dp * S) and next to the ZeRO paper's formula
        `analysis.training_memory(config, zero_stage=, dp=)`; the difference is the padding.

Every step is the training loop's own `train.train_step`, with its forward and backward
written out here per micro-batch (then its finalize_model_grads and `train.optimizer_step`) so
that the ledger of each micro-batch can be shown; the reference is the same step on one device
(`testing.single_device_run`).

The last line starts with MATCH (exit status 0) or MISMATCH (exit status 1); under torchrun
every rank exits with rank 0's verdict.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minimegatron import comm
from minimegatron.analysis import count_parameters, training_memory
from minimegatron.analysis.communication import data_parallel_phases, zero3_unit_numels, zero_bucket_numels
from minimegatron.config import ModelConfig, TrainConfig
from booktools.demo import (Results, add_training_flags, check_at_least_one, demo_parser, import_chapter,
                            largest_differences, run_demo)
from minimegatron.dp import (DistributedDataParallel, FullyShardedDataParallel, ZeroDataParallel, apply_data_parallel,
                             finish_grad_sync, local_tensors, no_sync, unwrap)
from minimegatron.dp.zero import storage_bytes
from minimegatron.model import GPTModel, finalize_model_grads
from minimegatron.optim import NormGroup, Optimizer, learning_rate
from minimegatron.testing import (EquivalenceReport, RunRecord, compare_runs, global_batches, local_microbatch,
                                  single_device_run, wait_until)
from minimegatron.train import optimizer_step

ch00 = import_chapter("00")       # the tiny models and the fingerprint of a tensor

__all__ = ["KINDS", "LEDGER_FORMULAS", "Variant", "make_variant", "chapter_variants", "tiny_model", "run_variants",
           "build_variant", "train_variant", "forget_averaging", "zero_bucket_numels", "zero3_unit_numels",
           "expected_ledger", "expected_memory", "LedgerRow", "MemoryRow", "VariantReport",
           "check_variant", "check_variants", "summary_line", "phase_names", "main"]

# kind -> (zero_stage, ddp_impl, title)
KINDS: dict[str, tuple[int, str, str]] = {
    "naive": (0, "naive", "naive DP: one all-reduce per gradient, after backward"),
    "ddp": (0, "bucketed", "bucketed DDP: one all-reduce per bucket, launched during backward"),
    "zero1": (1, "bucketed", "ZeRO-1: optimizer state sharded (Megatron's distributed optimizer)"),
    "zero2": (2, "bucketed", "ZeRO-2: optimizer state and gradients sharded"),
    "zero3": (3, "bucketed", "ZeRO-3 / FSDP: optimizer state, gradients and parameters sharded"),
}

# kind -> the communication formula of one step (e bytes per element, N parameters)
LEDGER_FORMULAS: dict[str, str] = {
    "naive": "one all-reduce per parameter (numel e each), N e in all; none inside no_sync",
    "ddp": "one all-reduce per bucket (its numel e), N e in all; none inside no_sync",
    "zero1": "reduce-scatter dp S_b e per bucket; all-reduce e (norm); all-gather S_b e per bucket",
    "zero2": "reduce-scatter dp S_b e per bucket; all-reduce e (norm); all-gather S_b e per bucket",
    "zero3": "per micro-batch all-gather S_u e per unit use (fwd, and bwd but the lookup's); "
             "reduce-scatter dp S_u e per use when syncing; all-reduce e (norm)",
}


def tiny_model(style: str = "llama", dtype: str = "float64", **overrides) -> ModelConfig:
    """The chapter's model: chapter 00's tiny GPT-2 or LLaMA at h = 32, L = 2, sequences up
    to 16 tokens (about 40k parameters), in `dtype`. `overrides` go to the ModelConfig."""
    make = ch00.tiny_llama if style == "llama" else ch00.tiny_gpt2
    return make(**{"hidden_size": 32, "max_position_embeddings": 16, "params_dtype": dtype, **overrides})


# ---------------------------------------------------------------------------------------
# a run
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """One data-parallel training run.

    name: unique within a world (the key of its results). model: the ModelConfig (its
    params_dtype is the run's dtype). train: the TrainConfig; zero_stage / ddp_impl /
    ddp_bucket_size pick the wrapper, grad_accum_steps = M micro-batches of micro_batch_size
    = b rows of seq_length tokens per rank, train_iters = steps. seed: the random token
    batches (`testing.make_batches`). break_averaging: the classic bug, on purpose: after the
    gradient sync every gradient the optimizer steps is multiplied by dp, which is what
    skipping the 1/dp scale gives (the sum over ranks instead of the mean).
    sync_every_microbatch: the other classic mistake (naive DP only): no no_sync(), the
    gradients are averaged after every micro-batch. The numbers stay right (the average of
    sums is the sum of averages); the communication is M times the formula.
    """
    name: str
    model: ModelConfig
    train: TrainConfig
    seed: int = 0
    break_averaging: bool = False
    sync_every_microbatch: bool = False

    @property
    def kind(self) -> str:
        if self.train.zero_stage == 0:
            return "naive" if self.train.ddp_impl == "naive" else "ddp"
        return f"zero{self.train.zero_stage}"

    @property
    def title(self) -> str:
        return KINDS[self.kind][2]

    @property
    def micro_batches(self) -> int:
        return self.train.grad_accum_steps

    def global_batches(self, dp: int) -> list[dict[str, torch.Tensor]]:
        """One global batch of b * M * dp sequences per step: what the single-device run sees."""
        return global_batches(self.model, self.train, dp, self.seed)

    def local_microbatch(self, batch: dict, m: int, dp: int, rank: int) -> dict:
        """Rank `rank`'s micro-batch m of a global batch (testing.local_microbatch)."""
        return local_microbatch(batch, self.train, m, rank, dp)


def make_variant(kind: str, model: ModelConfig, *, micro_batches: int = 1, steps: int = 2,
                 micro_batch_size: int = 2, seq_length: int | None = None, bucket_size: int | None = 8192,
                 clip_grad: float = 1.0, adam_eps: float | None = None, seed: int = 0,
                 break_averaging: bool = False, sync_every_microbatch: bool = False,
                 name: str | None = None) -> Variant:
    """A Variant of `kind` ("naive", "ddp", "zero1", "zero2", "zero3").

    bucket_size: elements per bucket for DDP and ZeRO-1/2 (None: Megatron's default for DDP,
    which is one bucket for a tiny model, and one bucket per weight-decay group for ZeRO).
    adam_eps: default 1e-8 in float64 and 1e-5 in float32 (AdamW amplifies the rounding of
    near-zero gradients; see the notes of minimegatron/testing.py).
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {sorted(KINDS)}")
    if sync_every_microbatch and kind != "naive":
        raise ValueError(f"sync_every_microbatch needs kind='naive', got {kind!r}: the other wrappers "
                         "start a new step at the first forward after a sync")
    stage, impl, _ = KINDS[kind]
    if adam_eps is None:
        adam_eps = 1e-5 if model.params_dtype == "float32" else 1e-8
    train = TrainConfig(seq_length=seq_length or model.max_position_embeddings, micro_batch_size=micro_batch_size,
                        grad_accum_steps=micro_batches, train_iters=steps, lr_warmup_iters=0, clip_grad=clip_grad,
                        adam_eps=adam_eps, zero_stage=stage, ddp_impl=impl, ddp_bucket_size=bucket_size,
                        progress=False, eval_interval=0).validate(model.validate())
    return Variant(name or kind, model, train, seed, break_averaging, sync_every_microbatch)


def chapter_variants(model: ModelConfig, kinds=tuple(KINDS), **kwargs) -> list[Variant]:
    """One Variant per kind, same model and settings (make_variant's keyword arguments)."""
    return [make_variant(kind, model, **kwargs) for kind in kinds]


def phase_names(micro_batches: int, sync_every_microbatch: bool = False) -> list[str]:
    """The phases of a step whose communication is recorded separately."""
    early = "+ sync" if sync_every_microbatch else "(no_sync)"
    names = [f"micro-batch {m} {early}" for m in range(micro_batches - 1)]
    return names + [f"micro-batch {micro_batches - 1} + sync", "optimizer step"]


# ---------------------------------------------------------------------------------------
# on every rank
# ---------------------------------------------------------------------------------------
def forget_averaging(optimizer, dp: int) -> None:
    """The bug `Variant.break_averaging` plants: multiply every gradient the optimizer is about
    to step by dp, i.e. use the SUM over ranks where the mean belongs (no 1/dp scale)."""
    with torch.no_grad():
        for segment in optimizer.segments:               # where each gradient lives (optim.Segment)
            grad = segment.grad()
            if grad is not None:
                grad.mul_(dp)


def _calls(ledger) -> list[tuple[str, int, str]]:
    return [(r.op, r.nbytes, r.tag) for r in ledger if r.tag != "inspect"]   # not what we read off


def _full_tensors(wrapper, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient), whole, by name: ZeRO's shards gathered (tag "inspect")."""
    return {n: t.detach().clone() for n, (_, t) in local_tensors(wrapper, grads).items()}


def _parameters_at_rest(wrapper, model) -> list[torch.Tensor]:
    """The tensors holding this rank's parameters between steps. ZeRO-3 also lists gathered
    unit buffers that are still alive; gloo's worker thread lets go of a finished collective's
    buffers a moment after wait() returns (see fsdp.py), so give them up to 0.5 s to die. One
    that survives is real memory and is measured."""
    if isinstance(wrapper, FullyShardedDataParallel):
        wait_until(lambda: len(wrapper.memory_tensors()["params"]) <= len(wrapper.units))
    return wrapper.memory_tensors()["params"] if _sharded(wrapper) else list(model.parameters())


def _sharded(wrapper) -> bool:
    return isinstance(wrapper, (ZeroDataParallel, FullyShardedDataParallel))


def build_variant(v: Variant, group) -> tuple[torch.nn.Module, Optimizer]:
    """(model chunk, optimizer) of `v` on this rank, data parallel over `group`, as the training
    loop builds them (parallelize.build_model / build_optimizer, with nothing but DP): the one
    GPTModel wrapped by `dp.apply_data_parallel` as v.train asks (the bare model when the group
    has one rank), and `optim.Optimizer` over it, which steps what the wrapper holds (under ZeRO
    this rank's shards, whose gradient norm then also sums over `group`)."""
    chunk = apply_data_parallel(GPTModel(v.model), v.train, group)
    return chunk, Optimizer([chunk], v.train, [NormGroup(groups=(group,) if _sharded(chunk) else ())])


def train_variant(v: Variant, group) -> dict:
    """Train `v` on this rank over the data-parallel `group`; return what `check_variant` needs.

    Every step is the training loop's `train.train_step`, with its forward and backward written
    out here per micro-batch (then train_step's own second half) so that each micro-batch's
    communication can be shown: micro-batches 0..M-2 inside no_sync(), the last one outside;
    then finalize_model_grads (finish_grad_sync) and train.optimizer_step (the learning rate,
    the global norm clipped, AdamW, zero_grad). The ledger is split per phase
    (`phase_names`). Returns {"dp", "rank", "losses" (this rank's local loss per step),
    "ledger" [step][phase] -> [(op, bytes, tag)], "fingerprints" {name: int} of the final full
    parameters, "memory" {"params", "grads", "exp_avg", "exp_avg_sq", "optimizer"} bytes
    measured on the tensors (gradients at the last sync, the rest after the last step),
    "grad_peak" (ZeRO-2: the most full-gradient bytes held during the last step's backward),
    "grads" (first step, full) and "params" (final, full) on rank 0 only, "timeline" (DDP:
    the last step's BucketTimeline), "buckets" (DDP: parameter names per bucket), "profile"
    (ZeRO-3: [(label, sharded bytes, gathered bytes)] of the first step, each gathered buffer
    given up to 0.5 s to die: testing.wait_until)}.
    """
    dp, rank = comm.group_size(group), comm.group_rank(group)
    wrapper, optimizer = build_variant(v, group)
    model = unwrap(wrapper)
    M = v.micro_batches
    out = {"dp": dp, "rank": rank, "losses": [], "ledger": [], "timeline": None, "profile": None}
    ddp = isinstance(wrapper, DistributedDataParallel) and v.train.zero_stage == 0
    if ddp:
        out["buckets"] = [b.names for b in wrapper.buckets]
    batches = v.global_batches(dp)
    for step, batch in enumerate(batches):
        marks: list[int] = []                     # where each phase starts in the step's ledger

        def forward_backward(chunks, microbatches):
            total = 0.0
            for m, mb in enumerate(microbatches):
                marks.append(len(ledger))
                sync = m == M - 1 or v.sync_every_microbatch
                with nullcontext() if sync else no_sync(wrapper):
                    local = wrapper(mb["tokens"], labels=mb["labels"]).mean() / M
                    local.backward()
                if sync and m < M - 1:
                    finish_grad_sync(wrapper)     # the mistake: a sync per micro-batch
                total += local.item()
            return total                          # the last sync: finalize_model_grads

        def on_grads(step=step):
            marks.append(len(ledger))             # the sync is done; the optimizer step comes next
            if v.break_averaging:
                forget_averaging(optimizer, dp)
            if step == 0:
                out["grads"] = _full_tensors(wrapper, grads=True)   # (tag "inspect", not a phase's)
            if step == len(batches) - 1:          # gradients are held in full size from sync to step
                grads = wrapper.memory_tensors()["grads"] if _sharded(wrapper) else [p.grad for p in model.parameters()]
                out["memory"] = {"grads": storage_bytes(grads)}
                out["grad_peak"] = wrapper.grad_bytes_peak if isinstance(wrapper, ZeroDataParallel) else None

        profiling = isinstance(wrapper, FullyShardedDataParallel) and step == 0
        microbatches = [v.local_microbatch(batch, m, dp, rank) for m in range(M)]
        with wrapper.memory_profile(settle=wait_until) if profiling else nullcontext() as events:
            with comm.record_communication() as ledger:
                loss = forward_backward([wrapper], microbatches)
                finalize_model_grads([wrapper])
                on_grads()
                optimizer_step(optimizer, learning_rate(step, v.train))
        if profiling:
            out["profile"] = [(e.label, e.sharded, e.gathered) for e in events]
        bounds = marks + [len(ledger)]
        out["ledger"].append([_calls(list(ledger)[a:b]) for a, b in zip(bounds, bounds[1:])])
        out["losses"].append(loss)
        if ddp:
            out["timeline"] = wrapper.timeline
    params = _parameters_at_rest(wrapper, model)
    state = list(optimizer.state.values())
    out["memory"].update(params=storage_bytes(params), exp_avg=storage_bytes(s["exp_avg"] for s in state),
                         exp_avg_sq=storage_bytes(s["exp_avg_sq"] for s in state))
    out["memory"]["optimizer"] = out["memory"]["exp_avg"] + out["memory"]["exp_avg_sq"]
    out["params"] = _full_tensors(wrapper)
    out["fingerprints"] = {n: ch00.fingerprint(t) for n, t in out["params"].items()}
    if rank != 0:                          # full tensors come back from rank 0 only
        out["grads"], out["params"] = {}, {}
    return out


def run_variants(jobs: list[tuple[int, Variant]]) -> dict[str, dict]:
    """Spawn (or torchrun) target: every rank runs this with the same `jobs`, a list of
    (dp, Variant). Ranks 0..dp-1 form the data-parallel group of a job (the whole world when
    dp is the world size); ranks outside it skip the job. Returns {variant name: this rank's
    train_variant record} for the jobs this rank took part in."""
    names = [v.name for _, v in jobs]
    if len(set(names)) != len(names):
        raise ValueError(f"run_variants: variant names must be unique, got {names}")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {}
    for dp in sorted({dp for dp, _ in jobs}):
        if not 1 <= dp <= world:
            raise ValueError(f"run_variants: dp={dp} needs 1..{world} ranks (the world has {world})")
        # new_group is collective over the whole world: every rank calls it, member or not
        groups[dp] = dist.group.WORLD if dp == world else dist.new_group(list(range(dp)))
    return {v.name: train_variant(v, groups[dp]) for dp, v in jobs if rank < dp}


# ---------------------------------------------------------------------------------------
# the formulas, from the parameter shapes alone
# ---------------------------------------------------------------------------------------
def _element_size(model: ModelConfig) -> int:
    return torch.empty((), dtype=model.dtype).element_size()


def expected_ledger(v: Variant, dp: int) -> list[list[tuple[str, int, str]]]:
    """The collectives one rank issues in each phase of a step (`phase_names`), as
    (op, bytes, tag): analysis.data_parallel_phases on the parameter shapes of v's model."""
    return data_parallel_phases(GPTModel(v.model), v.train, dp, _element_size(v.model))


def expected_memory(v: Variant, dp: int, rank: int) -> dict[str, int]:
    """Bytes rank `rank` holds, from the layout rules: {"params", "grads", "optimizer"}.

    stage 0: N e, N e, 2 N e (AdamW's m and v on every parameter).
    stage 1/2: the buckets are padded to dp S_b: params sum_b dp S_b e; grads sum_b dp S_b e
    (stage 1) or sum_b S_b e (stage 2); optimizer 2 real e, real = this rank's elements that
    are not padding. stage 3: the units likewise: params and grads sum_u S_u e.
    """
    model = GPTModel(v.model)
    e, stage = _element_size(v.model), v.train.zero_stage
    N = sum(p.numel() for p in model.parameters())
    if stage == 0:
        return {"params": N * e, "grads": N * e, "optimizer": 2 * N * e}
    sizes = (zero_bucket_numels(model, v.train.ddp_bucket_size) if stage < 3
             else list(zero3_unit_numels(model).values()))
    shards = [math.ceil(n / dp) for n in sizes]
    real = sum(max(0, min(s, n - rank * s)) for n, s in zip(sizes, shards))
    return {"params": (sum(shards) if stage == 3 else dp * sum(shards)) * e,
            "grads": (dp * sum(shards) if stage == 1 else sum(shards)) * e,
            "optimizer": 2 * real * e}


# ---------------------------------------------------------------------------------------
# the verdict (in the parent, or on rank 0)
# ---------------------------------------------------------------------------------------
@dataclass
class LedgerRow:
    """One (phase, op, tag) of a step on one rank: calls and bytes, measured and formula."""
    phase: str
    op: str
    tag: str
    calls: int
    nbytes: int
    formula_calls: int
    formula_bytes: int
    ok: bool          # the multiset of call sizes equals the formula's, not just the sums

    def __str__(self) -> str:
        what = f"{self.op} x{self.calls} ({self.tag})" if self.op else "no communication"
        return (f"{self.phase:<26}{what:<31}measured {self.nbytes:>9,} bytes / "
                f"formula {self.formula_bytes:>9,} bytes: {'OK' if self.ok else 'DIFFERENT'}")


@dataclass
class MemoryRow:
    """Bytes of one kind on one rank: measured, from the layout, and the ZeRO formula."""
    kind: str
    rank: int
    measured: int
    layout: int
    formula: int

    @property
    def padding(self) -> int:
        return self.layout - self.formula

    @property
    def ok(self) -> bool:
        return self.measured == self.layout

    def __str__(self) -> str:
        note = ""
        if self.padding and self.kind == "optimizer":
            note = f" ({self.padding:+,}: this rank's share of real elements vs ceil(N/dp))"
        elif self.padding:
            note = f" ({self.padding:+,}: padding to dp x S)"
        return (f"{self.kind:<10}rank {self.rank}  measured {self.measured:>9,} bytes / formula "
                f"{self.formula:>9,} bytes{note}: {'OK' if self.ok else 'DIFFERENT'}")


@dataclass
class VariantReport:
    variant: Variant
    dp: int
    equivalence: EquivalenceReport
    replicas_ok: bool
    ledger: list[LedgerRow]                    # rank 0, step 0 (all ranks and steps checked)
    memory: list[MemoryRow]                    # every rank
    problems: list[str] = field(default_factory=list)
    timeline: object | None = None             # DDP: rank 0's BucketTimeline of the last step
    buckets: list[list[str]] | None = None     # DDP: parameter names per bucket
    profile: list[tuple[str, int, int]] | None = None   # ZeRO-3: rank 0's first step

    @property
    def ok(self) -> bool:
        return self.equivalence.ok and not self.problems

    def measured_memory(self, rank: int = 0) -> dict[str, int]:
        return {r.kind: r.measured for r in self.memory if r.rank == rank}

    def formula_memory(self) -> dict[str, int]:
        return {r.kind: r.formula for r in self.memory if r.rank == 0}

    def step_bytes(self) -> dict[tuple[str, str], int]:
        """Measured bytes of one step on rank 0 by (op, tag)."""
        out: Counter = Counter()
        for r in self.ledger:
            if r.op:
                out[(r.op, r.tag)] += r.nbytes
        return dict(out)

    def __str__(self) -> str:
        v, t = self.variant, self.variant.train
        M, b = v.micro_batches, t.micro_batch_size
        head = (f"=== {v.name}: {v.title}\n    dp={self.dp} ranks, {M} micro-batch(es) of {b} x {t.seq_length} "
                f"tokens per rank, {t.train_iters} steps, {v.model.params_dtype}"
                + (", AVERAGING BROKEN ON PURPOSE" if v.break_averaging else ""))
        eq = str(self.equivalence).splitlines()
        eq = eq[:4] + eq[4:7] + ([f"  ... {len(eq) - 7} more problems"] if len(eq) > 7 else [])
        lines = [head,
                 f"[1/3] equivalence with the single-device run on the same global batch "
                 f"({b * M * self.dp} sequences per step):"]
        lines += ["      " + x for x in eq]
        lines.append(f"      replicas: the {self.dp} ranks end with "
                     + ("bit-identical full parameters" if self.replicas_ok else "DIFFERENT parameters"))
        lines.append("[2/3] communication of one step (rank 0, step 0; every rank and step checked):")
        lines.append(f"      formula: {LEDGER_FORMULAS[v.kind]}")
        lines += ["      " + str(r) for r in self.ledger]
        lines.append(f"[3/3] memory per rank, measured vs training_memory(config, zero_stage="
                     f"{t.zero_stage}, dp={self.dp}):")
        lines += ["      " + str(r) for r in self.memory]
        lines += [f"      problem: {p}" for p in self.problems]
        return "\n".join(lines)


def _ledger_rows(measured: list[list[tuple]], expected: list[list[tuple]], names: list[str]) -> list[LedgerRow]:
    rows = []
    for name, got, want in zip(names, measured, expected):
        keys = list(dict.fromkeys([(op, tag) for op, _, tag in want] + [(op, tag) for op, _, tag in got]))
        if not keys:
            rows.append(LedgerRow(name, "", "", 0, 0, 0, 0, True))
        for op, tag in keys:
            g = sorted(n for o, n, t in got if (o, t) == (op, tag))
            w = sorted(n for o, n, t in want if (o, t) == (op, tag))
            rows.append(LedgerRow(name, op, tag, len(g), sum(g), len(w), sum(w), g == w))
    return rows


def _as_record(per_rank: list[dict]) -> RunRecord:
    """The data-parallel run as one RunRecord: a step's global loss is the mean of the ranks'
    local losses; gradients and parameters are rank 0's (the replicas are checked apart)."""
    losses = [sum(r["losses"][k] for r in per_rank) / len(per_rank) for k in range(len(per_rank[0]["losses"]))]
    return RunRecord(losses, per_rank[0]["grads"], per_rank[0]["params"])


def check_variant(v: Variant, dp: int, per_rank: list[dict]) -> VariantReport:
    """Judge one run (per_rank: every rank's train_variant record, in rank order)."""
    problems: list[str] = []
    reference = single_device_run(v.model, v.global_batches(dp), v.train, grad_accum_steps=v.micro_batches)
    equivalence = compare_runs(reference, _as_record(per_rank), v.model.dtype)
    replicas_ok = all(r["fingerprints"] == per_rank[0]["fingerprints"] for r in per_rank)
    if not replicas_ok:
        problems.append("the ranks' final parameters differ: the replicas drifted apart")

    expected, names = expected_ledger(v, dp), phase_names(v.micro_batches, v.sync_every_microbatch)
    for r, record in enumerate(per_rank):
        for step, measured in enumerate(record["ledger"]):
            for name, got, want in zip(names, measured, expected):
                if sorted(got) != sorted(want):
                    problems.append(f"ledger, rank {r}, step {step}, {name}: measured {Counter(got)}, "
                                    f"formula {Counter(want)}")
    ledger = _ledger_rows(per_rank[0]["ledger"][0], expected, names)

    formula = training_memory(v.model, zero_stage=v.train.zero_stage, dp=dp)
    memory = []
    for r, record in enumerate(per_rank):
        layout = expected_memory(v, dp, r)
        for kind in ("params", "grads", "optimizer"):
            row = MemoryRow(kind, r, record["memory"][kind], layout[kind], formula[kind])
            memory.append(row)
            if not row.ok:
                problems.append(f"memory, rank {r}: {kind} measured {row.measured:,} bytes, the layout "
                                f"gives {row.layout:,} (ZeRO formula {row.formula:,})")
    n_e = count_parameters(v.model)["total"] * _element_size(v.model)
    total_state = sum(record["memory"]["optimizer"] for record in per_rank)
    expected_state = 2 * n_e * (dp if v.train.zero_stage == 0 else 1)
    if total_state != expected_state:
        problems.append(f"optimizer state over all ranks: {total_state:,} bytes, expected {expected_state:,} "
                        "(sharded: every element exactly once)")
    memory.sort(key=lambda row: (["params", "grads", "optimizer"].index(row.kind), row.rank))
    rank0 = per_rank[0]
    return VariantReport(v, dp, equivalence, replicas_ok, ledger, memory, problems,
                         rank0.get("timeline"), rank0.get("buckets"), rank0.get("profile"))


def check_variants(jobs: list[tuple[int, Variant]], results: list[dict[str, dict]]) -> list[VariantReport]:
    """check_variant for every job; `results` is run_variants' list over ranks."""
    return [check_variant(v, dp, [results[r][v.name] for r in range(dp)]) for dp, v in jobs]


def summary_line(reports: list[VariantReport]) -> str:
    """The demo's last line: MATCH ... or MISMATCH ..., with the largest differences."""
    diffs = largest_differences([r.equivalence for r in reports])
    names = ", ".join(r.variant.name for r in reports)
    bad = [r for r in reports if not r.ok]
    if bad:
        why = []
        for r in bad:
            parts = (["differs from the single-device run"] if not r.equivalence.ok else []) + \
                    (["ledger/memory/replicas differ from the formula"] if r.problems else [])
            why.append(f"{r.variant.name} {' and '.join(parts)}")
        return f"MISMATCH: {'; '.join(why)}; {diffs}"
    dps = sorted({r.dp for r in reports})
    dtypes = sorted({r.variant.model.params_dtype for r in reports})
    return (f"MATCH: {names} with dp={'/'.join(map(str, dps))} equal the single-device run "
            f"({'/'.join(dtypes)}): {diffs}; ledger and memory equal the formulas")


# ---------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------
# --zero -> the kinds of one run (None: --ddp says which of naive and ddp)
CLI_VARIANTS = {"0": None, "1": ["zero1"], "2": ["zero2"], "3": ["zero3"], "all": list(KINDS)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = demo_parser("01", "Chapter 01: train a tiny model data-parallel (naive, bucketed DDP, ZeRO-1/2/3) and "
                               "check it against the single-device run, the communication formulas and the "
                               "memory formulas.")
    parser.add_argument("--zero", choices=list(CLI_VARIANTS), default="all",
                        help="ZeRO stage: 0 (replicated; see --ddp), 1, 2, 3, or all (naive, bucketed, "
                             "1, 2 and 3 in one world; the default)")
    parser.add_argument("--ddp", choices=["naive", "bucketed"], default="bucketed",
                        help="with --zero 0: one all-reduce per parameter after backward (naive) or "
                             "per bucket during backward (bucketed, the default)")
    add_training_flags(parser)
    parser.add_argument("--bucket-size", type=int, default=8192,
                        help="elements per bucket for DDP and ZeRO-1/2 (default 8192: several buckets; "
                             "Megatron's default of 40M would make one)")
    parser.add_argument("--ranks", type=int, default=2,
                        help="without torchrun: how many ranks to spawn (default 2); torchrun sets its own")
    parser.add_argument("--break-averaging", action="store_true",
                        help="the classic bug, on purpose: sum the gradients over ranks instead of "
                             "averaging them (no 1/dp); the check must say MISMATCH")
    return check_at_least_one(parser, parser.parse_args(argv), "micro_batches", "micro_batch_size", "ranks",
                              "bucket_size", "steps")


@dataclass(frozen=True)
class Jobs:
    """The demo's run: every (dp, Variant) job, trained in one world of `world` ranks."""
    jobs: list[tuple[int, Variant]]
    world: int

    def name(self) -> str:
        return f"data parallelism, {len(self.jobs)} variant(s) ({', '.join(v.name for _, v in self.jobs)})"


def build_jobs(args: argparse.Namespace, dp: int) -> Jobs:
    """The jobs every rank runs: the same on every rank."""
    sizes = {} if args.quick else dict(hidden_size=64, num_layers=3, max_position_embeddings=32)
    model = tiny_model(args.style, args.dtype, **sizes)
    kinds = CLI_VARIANTS[args.zero] or ["naive" if args.ddp == "naive" else "ddp"]
    steps = args.steps if args.steps is not None else (2 if args.quick else 3)
    return Jobs([(dp, make_variant(kind, model, micro_batches=args.micro_batches, steps=steps,
                                   micro_batch_size=args.micro_batch_size, bucket_size=args.bucket_size,
                                   break_averaging=args.break_averaging)) for kind in kinds], dp)


def train_jobs(run: Jobs) -> dict[str, dict]:
    """run_variants of the jobs (what each rank runs under torchrun or spawn)."""
    return run_variants(run.jobs)


@dataclass
class DPResults(Results):
    """What the report printed: the largest differences from the single-device run over the
    variants (2 digits, as printed) and, per variant, whether it matched, rank 0's ledger of
    step 0 ([phase, op, tag, calls, bytes, formula calls, formula bytes]) and every rank's
    memory ([kind, rank, measured bytes, layout, formula])."""
    max_loss_diff: float = 0.0
    max_grad_diff: float = 0.0
    max_param_diff: float = 0.0
    variants: dict = field(default_factory=dict)


def report(args, run: Jobs, per_rank_results: list[dict]) -> DPResults:
    """Check every variant, print the reports; return their results (verdict: the last line)."""
    jobs = run.jobs
    dp, first = jobs[0][0], jobs[0][1]
    cfg, t = first.model, first.train
    n = count_parameters(cfg)["total"]
    print(f"model: {args.style}, h={cfg.hidden_size} L={cfg.num_layers}, {n:,} parameters, {cfg.params_dtype}"
          + (f" (AdamW eps {t.adam_eps:g})" if cfg.params_dtype == "float32" else "")
          + f"; global batch {t.micro_batch_size} x {t.grad_accum_steps} x {dp} = "
            f"{t.micro_batch_size * t.grad_accum_steps * dp} sequences of {t.seq_length} tokens per step")
    if dp == 1:
        print("note: one rank is the single-device run with extra steps; nothing is communicated")
    reports = check_variants(jobs, per_rank_results)
    for r in reports:
        print()
        print(r)
        if r.timeline is not None:
            print(f"      bucket timeline of the last step, rank 0 (buckets launched during backward: "
                  f"{r.timeline.launched_during_backward()}):")
            print("      " + r.timeline.table().replace("\n", "\n      "))
    worst = [max(getattr(r.equivalence, k) for r in reports)
             for k in ("max_loss_diff", "max_grad_diff", "max_param_diff")]
    return DPResults(0, summary_line(reports), *(float(f"{x:.1e}") for x in worst), {
        r.variant.name: {"ok": r.ok, "ledger": [[x.phase, x.op, x.tag, x.calls, x.nbytes, x.formula_calls,
                                                 x.formula_bytes] for x in r.ledger],
                         "memory": [[x.kind, x.rank, x.measured, x.layout, x.formula] for x in r.memory]}
        for r in reports})


def main(argv=None) -> DPResults:
    return run_demo(parse_args(argv), "01", build_jobs, train_jobs, report, spawn_dp=lambda args: args.ranks)


if __name__ == "__main__":      # the guard matters: spawned ranks import this file again
    sys.exit(main().exit_code)
