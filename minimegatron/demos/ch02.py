"""Chapter 02, tensor parallelism: the experiments its notebook runs and its demo prints.

    from minimegatron.demos import ch02
    from minimegatron.launch import spawn
    run = ch02.make_run(ch02.tiny_model("llama"), tp=2, dp=2)        # 4 ranks
    per_rank = spawn(ch02.train_run, 4, run)
    print(ch02.check_run(run, per_rank))   # equivalence, ledger and memory against the formulas

A `TPRun` is one training run on a tp x dp grid of ranks (tp fastest, Megatron's order):
every matrix of the model is split over a tensor-parallel group of tp ranks
(`tp.TensorParallelGPTModel`), and the dp groups of tp ranks are data-parallel replicas,
wrapped by chapter 01's `dp.build_data_parallel` (zero_stage 0, 1 or 2), exactly as
`python -m minimegatron.train --tensor-model-parallel-size` runs it. `train_run` trains it on
every rank of the world and `check_run` judges it, in the parent (or on rank 0), against
three things computed independently of the run:

  equivalence   `testing.single_device_run` on the same global batches: losses, the first
                step's gradients and the final parameters, reassembled from the shards under
                single-device names, with the tolerance of the dtype;
  communication the ledger of each phase of each step on every rank, split by group (TP, DP),
                against `expected_ledger`: the formulas of the chapter (tp/model.py's
                docstring for the TP group, chapter 01's for the DP group);
  memory        the parameter elements each rank holds, counted on its real tensors, against
                `analysis.tensor_parallel_parameters` (what is split, what is replicated).
"""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from .. import comm
from ..analysis import tensor_parallel_parameters
from ..config import ModelConfig, TrainConfig
from ..dp import build_data_parallel
from ..testing import EquivalenceReport, RunRecord, compare_runs, global_batches, local_microbatch, single_device_run
from ..tp import TensorParallelGPTModel, full_parameters
from ..tp.model import reassemble
from ..train import build_optimizer, learning_rate, optimizer_step, parallel_context
from .ch00 import fingerprint, tiny_gpt2, tiny_llama
from .ch01 import gradient_sync_ledger

__all__ = ["TPRun", "tiny_model", "make_run", "train_run", "expected_ledger", "check_run", "RunReport",
           "summary_line", "phase_names"]

Call = tuple[str, str, int, str]          # (op, "tp" or "dp", bytes, tag)


def tiny_model(style: str = "llama", dtype: str = "float64", **overrides) -> ModelConfig:
    """The chapter's model: h = 32, L = 2, 4 query heads, sequences up to 16, the byte
    vocabulary V = 257 (divisible by no tp > 1: it is padded), in `dtype`. LLaMA style has 4
    key/value groups, so it splits up to tp = 4 (GQA needs whole groups per rank)."""
    base = {"hidden_size": 32, "max_position_embeddings": 16, "params_dtype": dtype}
    if style == "llama":
        return tiny_llama(**{**base, "num_query_groups": 4, **overrides})
    return tiny_gpt2(**{**base, **overrides})


@dataclass(frozen=True)
class TPRun:
    """One run: `model` trained on tp x dp ranks with `train` (zero_stage picks chapter 01's
    data-parallel variant; grad_accum_steps = M micro-batches of micro_batch_size = b rows of
    seq_length tokens per data-parallel rank; train_iters = steps). seed: the token batches."""
    model: ModelConfig
    tp: int
    dp: int
    train: TrainConfig
    seed: int = 0

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def micro_batches(self) -> int:
        return self.train.grad_accum_steps

    def global_batches(self) -> list[dict[str, torch.Tensor]]:
        """One global batch of b * M * dp sequences per step: what the single device sees."""
        return global_batches(self.model, self.train, self.dp, self.seed)

    def local_microbatch(self, batch: dict, m: int, dp_rank: int) -> dict:
        """Micro-batch m of a global batch for data-parallel rank dp_rank (every rank of its
        TP group reads the same rows: testing.local_microbatch)."""
        return local_microbatch(batch, self.train, m, dp_rank, self.dp)


def make_run(model: ModelConfig, tp: int = 2, dp: int = 1, *, zero_stage: int = 0, micro_batches: int = 2,
             micro_batch_size: int = 2, steps: int = 2, clip_grad: float = 0.05, bucket_size: int | None = 4000,
             seed: int = 0) -> TPRun:
    """A validated TPRun (ConfigError naming the numbers for a layout that does not split:
    heads, groups or ffn by tp, zero_stage 3 with tp). tp must be at least 2 (tp = 1 is
    chapter 01). AdamW eps 1e-5 in float32 (see testing.py), 1e-8 in float64. clip_grad
    0.05 is below the tiny model's gradient norm (about 0.5 to 2): every step clips, so the
    tensor-parallel norm (replicated parameters counted once) is part of what is checked."""
    if tp < 2 or dp < 1:
        raise ValueError(f"tp={tp} must be >= 2 and dp={dp} >= 1 (tp=1 is chapter 01's data parallelism)")
    train = TrainConfig(seq_length=model.max_position_embeddings, micro_batch_size=micro_batch_size,
                        grad_accum_steps=micro_batches, train_iters=steps, lr_warmup_iters=0, clip_grad=clip_grad,
                        adam_eps=1e-5 if model.params_dtype == "float32" else 1e-8, zero_stage=zero_stage,
                        ddp_bucket_size=bucket_size, tensor_model_parallel_size=tp, progress=False,
                        eval_interval=0).validate(model.validate())
    return TPRun(model, tp, dp, train, seed)


def phase_names(micro_batches: int) -> list[str]:
    """The phases of a step whose communication is recorded separately."""
    return [f"micro-batch {m}" + (" + DP sync" if m == micro_batches - 1 else " (no_sync)")
            for m in range(micro_batches)] + ["optimizer step"]


# ---------------------------------------------------------------------------------------
# on every rank
# ---------------------------------------------------------------------------------------
def train_run(run: TPRun) -> dict:
    """Spawn (or torchrun) target, on every rank of a world of run.tp * run.dp ranks.

    Builds the grid (train.parallel_context), the TensorParallelGPTModel of this TP group and
    chapter 01's data-parallel wrapper over the DP group (passing the model as
    tensor_parallel, so the gradient norm sums over both groups). Every step: micro-batches
    0..M-2 inside no_sync(), the last one outside (then finish_grad_sync), then
    train.optimizer_step (clip, AdamW). Returns {"tp_rank", "dp_rank", "losses" (this DP
    rank's loss per step), "ledger" [step][phase] -> [(op, "tp"|"dp", bytes, tag)],
    "param_elements" (elements of this rank's parameters), "dp_sync" (chapter 01's DP
    formula on this rank's parameter shapes, see expected_ledger), "fingerprints" {name: int} of the
    final full parameters, "grads" (first step, full, DP-averaged) and "params" (final, full)
    on rank 0 only}.
    """
    import torch.distributed as dist

    if dist.get_world_size() != run.world:
        raise ValueError(f"this run needs tp x dp = {run.tp} x {run.dp} = {run.world} ranks, "
                         f"the world has {dist.get_world_size()}")
    grid = parallel_context(run.tp)
    model = TensorParallelGPTModel(run.model, grid.tp_group)
    if grid.dp_group is None:
        engine, optimizer = model, build_optimizer(model, run.train)
    else:
        engine, optimizer = build_data_parallel(model, run.train, grid.dp_group, tensor_parallel=model)
    tp_ranks = tuple(dist.get_process_group_ranks(grid.tp_group))

    def calls(ledger) -> list[Call]:
        return [(r.op, "tp" if r.group_ranks == tp_ranks else "dp", r.nbytes, r.tag) for r in ledger]

    M, out = run.micro_batches, {"tp_rank": comm.group_rank(grid.tp_group), "dp_rank": grid.dp_rank,
                                 "losses": [], "ledger": []}
    out["param_elements"] = sum(p.numel() for p in model.parameters())
    e = torch.empty((), dtype=run.model.dtype).element_size()
    out["dp_sync"] = gradient_sync_ledger(model, run.train, run.dp, e) if run.dp > 1 else ([], [])
    for step, batch in enumerate(run.global_batches()):
        phases, loss = [], 0.0
        for m in range(M):
            mb = run.local_microbatch(batch, m, grid.dp_rank)
            last = m == M - 1
            with comm.record_communication() as ledger:
                with engine.no_sync() if grid.dp_group is not None and not last else nullcontext():
                    local = engine(mb["tokens"], labels=mb["labels"]).mean() / M
                    local.backward()
                if grid.dp_group is not None and last:
                    engine.finish_grad_sync()
            loss += local.item()
            phases.append(calls(ledger))
        if step == 0:                                        # collectives outside the ledger
            local_grads = (engine.gather_gradients() if hasattr(engine, "gather_gradients") else
                           {n: p.grad for n, p in model.named_parameters()})
            out["grads"] = reassemble(model, local_grads, "inspect")
        with comm.record_communication() as ledger:
            optimizer_step(engine, optimizer, learning_rate(step, run.train), run.train.clip_grad,
                           tensor_parallel=model)
        phases.append(calls(ledger))
        out["losses"].append(loss)
        out["ledger"].append(phases)
    out["params"] = full_parameters(model)
    out["fingerprints"] = {n: fingerprint(t) for n, t in out["params"].items()}
    if dist.get_rank() != 0:
        out["grads"], out["params"] = {}, {}
    return out


# ---------------------------------------------------------------------------------------
# the formulas
# ---------------------------------------------------------------------------------------
def expected_ledger(run: TPRun, dp_sync) -> list[list[Call]]:
    """The collectives one rank issues in each phase of a step (`phase_names`), as
    (op, group, bytes, tag); e bytes per element, b s tokens per micro-batch, L layers.

    TP group, every micro-batch (tp/model.py): forward 1 + 2L all-reduces of b s h e (the
    embedding's g, and g after linear_proj and linear_fc2 of each layer) and 3 of b s e (the
    vocab-parallel loss: max, target logit, sum of exponentials); backward 2L + 1 of b s h e
    (f before linear_qkv and linear_fc1 of each layer, f before the output layer).
    DP group, last micro-batch and optimizer step: `dp_sync`, chapter 01's formula
    (ch01.gradient_sync_ledger) evaluated on the shapes of a rank's parameters, a TP shard
    (train_run returns it; the shapes are checked against tensor_parallel_parameters).
    Optimizer step: the squared gradient norm, one all-reduce of e over the TP group (plus
    one over the DP group under ZeRO, where the gradients are also split over DP).
    """
    cfg, t = run.model, run.train
    e = torch.empty((), dtype=cfg.dtype).element_size()
    bsh, bs, L = t.micro_batch_size * t.seq_length * cfg.hidden_size, t.micro_batch_size * t.seq_length, cfg.num_layers
    tp_microbatch = ([("all_reduce", "tp", bsh * e, "fwd")] * (1 + 2 * L) + [("all_reduce", "tp", bs * e, "fwd")] * 3
                     + [("all_reduce", "tp", bsh * e, "bwd")] * (2 * L + 1))
    M = run.micro_batches
    phases = [list(tp_microbatch) for _ in range(M)] + [[("all_reduce", "tp", e, "grad-norm")]]
    if run.dp > 1:
        last, step = dp_sync
        phases[M - 1] += [(op, "dp", n, tag) for op, n, tag in last]
        phases[M] += [(op, "dp", n, tag) for op, n, tag in step]
    return phases


# ---------------------------------------------------------------------------------------
# the verdict (in the parent, or on rank 0)
# ---------------------------------------------------------------------------------------
@dataclass
class RunReport:
    run: TPRun
    equivalence: EquivalenceReport
    replicas_ok: bool
    ledger: list[tuple[str, str, str, str, int, int, int, int]]  # rank 0, step 0: (phase, op, group, tag,
    #                                                              calls, bytes, formula calls, formula bytes)
    param_elements: list[int]                                    # every rank
    formula: dict                                                # analysis.tensor_parallel_parameters
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.equivalence.ok and not self.problems

    def step_bytes(self, group: str) -> int:
        """Measured bytes of one step (rank 0, step 0) over the "tp" or "dp" group."""
        return sum(row[5] for row in self.ledger if row[2] == group)

    def __str__(self) -> str:
        r, t, cfg = self.run, self.run.train, self.run.model
        e = torch.empty((), dtype=cfg.dtype).element_size()
        M, b, s = r.micro_batches, t.micro_batch_size, t.seq_length
        lines = [f"=== tp={r.tp} x dp={r.dp} ({r.world} ranks), ZeRO stage {t.zero_stage}, {M} micro-batch(es) of "
                 f"{b} x {s} tokens per DP rank, {t.train_iters} steps, {cfg.params_dtype}, clip_grad {t.clip_grad}",
                 f"[1/3] equivalence with the single-device run on the same global batch ({b * M * r.dp} sequences "
                 f"per step):"]
        lines += ["      " + x for x in str(self.equivalence).splitlines()[:7]]
        lines.append(f"      replicas: the {r.world} ranks reassemble "
                     + ("bit-identical full parameters" if self.replicas_ok else "DIFFERENT parameters"))
        lines.append("[2/3] communication of one step (rank 0, step 0; every rank and step checked):")
        lines.append(f"      formula, TP group per micro-batch: fwd (1 + 2L) x b s h e + 3 x b s e, "
                     f"bwd (2L + 1) x b s h e; L={cfg.num_layers}, b s h e = {b * s * cfg.hidden_size * e:,} bytes")
        for phase, op, group, tag, n, nbytes, fn, fbytes in self.ledger:
            ok = "OK" if (n, nbytes) == (fn, fbytes) else "DIFFERENT"
            lines.append(f"      {phase:<24}{group.upper():<3} {op + ' x' + str(n):<19}{'(' + tag + ')':<12} "
                         f"measured {nbytes:>9,} bytes / formula {fbytes:>9,}: {ok}")
        logits = b * s * cfg.vocab_size * e
        lines.append(f"      the loss moved 3 x b s e = {3 * b * s * e:,} bytes per micro-batch; gathering the "
                     f"logits would move {logits:,} (b s V e)")
        f = self.formula
        lines.append(f"[3/3] parameters per rank, counted on the tensors vs analysis.tensor_parallel_parameters "
                     f"(single device: {f['total']:,}):")
        lines.append(f"      formula: split {f['split']:,} (of which vocabulary padding {f['padding']:,}) + "
                     f"replicated {f['replicated']:,} = {f['per_rank']:,} elements = {f['per_rank'] * e:,} bytes")
        for rank, n in enumerate(self.param_elements):
            lines.append(f"      rank {rank}: {n:,} elements = {n * e:,} bytes: "
                         + ("OK" if n == f["per_rank"] else "DIFFERENT"))
        lines += [f"      problem: {p}" for p in self.problems[:6]]
        if len(self.problems) > 6:
            lines.append(f"      ... and {len(self.problems) - 6} more problems")
        return "\n".join(lines)


def _rows(measured: list[list[Call]], expected: list[list[Call]], names: list[str]) -> list[tuple]:
    rows = []
    for name, got, want in zip(names, measured, expected):
        keys = list(dict.fromkeys([(op, g, tag) for op, g, _, tag in want + got]))
        for op, g, tag in keys:
            mine = [n for o, gg, n, t in got if (o, gg, t) == (op, g, tag)]
            theirs = [n for o, gg, n, t in want if (o, gg, t) == (op, g, tag)]
            rows.append((name, op, g, tag, len(mine), sum(mine), len(theirs), sum(theirs)))
    return rows


def check_run(run: TPRun, per_rank: list[dict]) -> RunReport:
    """Judge one run (per_rank: every rank's train_run record, in rank order)."""
    problems: list[str] = []
    reference = single_device_run(run.model, run.global_batches(), run.train, grad_accum_steps=run.micro_batches)
    # the global loss: the mean over the data-parallel ranks (one TP rank of each speaks)
    dp_losses = [r["losses"] for r in per_rank if r["tp_rank"] == 0]
    losses = [sum(step) / len(dp_losses) for step in zip(*dp_losses)]
    equivalence = compare_runs(reference, RunRecord(losses, per_rank[0]["grads"], per_rank[0]["params"]),
                               run.model.dtype)
    replicas_ok = all(r["fingerprints"] == per_rank[0]["fingerprints"] for r in per_rank)
    if not replicas_ok:
        problems.append("the ranks' reassembled parameters differ: the replicas drifted apart")
    names = phase_names(run.micro_batches)
    for rank, record in enumerate(per_rank):
        expected = expected_ledger(run, record["dp_sync"])
        for step, measured in enumerate(record["ledger"]):
            for name, got, want in zip(names, measured, expected):
                if sorted(got) != sorted(want):
                    problems.append(f"ledger, rank {rank}, step {step}, {name}: measured {Counter(got)}, "
                                    f"formula {Counter(want)}")
    formula = tensor_parallel_parameters(run.model, run.tp)
    elements = [r["param_elements"] for r in per_rank]
    for rank, n in enumerate(elements):
        if n != formula["per_rank"]:
            problems.append(f"parameters, rank {rank}: {n:,} elements, the formula gives {formula['per_rank']:,}")
    rows = _rows(per_rank[0]["ledger"][0], expected_ledger(run, per_rank[0]["dp_sync"]), names)
    return RunReport(run, equivalence, replicas_ok, rows, elements, formula, problems)


def summary_line(reports: list[RunReport]) -> str:
    """The demo's last line: MATCH ... or MISMATCH ..., with the largest differences."""
    worst = {k: max(getattr(r.equivalence, k) for r in reports)
             for k in ("max_loss_diff", "max_grad_diff", "max_param_diff")}
    tol = reports[0].equivalence.tolerance
    diffs = (f"max |dloss| {worst['max_loss_diff']:.1e} (tol {tol.loss:.0e}), max |dgrad| "
             f"{worst['max_grad_diff']:.1e}, max |dparam| {worst['max_param_diff']:.1e} "
             f"(rtol {tol.rtol:.0e}, atol {tol.atol:.0e})")
    layouts = ", ".join(f"tp={r.run.tp} x dp={r.run.dp} (ZeRO {r.run.train.zero_stage})" for r in reports)
    bad = [r for r in reports if not r.ok]
    if bad:
        why = [f"tp={r.run.tp} x dp={r.run.dp}: "
               + " and ".join((["differs from the single-device run"] if not r.equivalence.ok else [])
                              + (["ledger/parameters/replicas differ from the formula"] if r.problems else []))
               for r in bad]
        return f"MISMATCH: {'; '.join(why)}; {diffs}"
    return f"MATCH: {layouts} equal the single-device run: {diffs}; ledger and parameter counts equal the formulas"
