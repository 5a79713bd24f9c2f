"""Chapter 02 demo: tensor parallelism (and TP x DP), proven on tp x dp ranks.

    torchrun --standalone --nproc_per_node=4 chapters/02_tp/demo.py --tp 2 --dp 2
    torchrun --standalone --nproc_per_node=4 chapters/02_tp/demo.py --tp 4
    torchrun --standalone --nproc_per_node=4 chapters/02_tp/demo.py --tp 2 --dp 2 --zero 1
    python chapters/02_tp/demo.py                    # no torchrun: spawns tp x dp ranks (2 x 2) itself
    python chapters/02_tp/demo.py --quick --tp 2 --dp 1 --style gpt2     # a few seconds

This one file is the chapter's experiment and its command line. The notebook and the graders
import it too (`booktools.demo.import_chapter("02")`):

    demo = import_chapter("02")
    run = demo.make_run(demo.tiny_model("llama"), tp=2, dp=2)        # 4 ranks
    per_rank = spawn(demo.train_run, 4, run)
    print(demo.check_run(run, per_rank))   # equivalence, ledger and memory against the formulas

A `TPRun` is one training run on a tp x dp grid of ranks (tp fastest, Megatron's order). Every
rank builds it the way `python -m minimegatron.train --tensor-model-parallel-size` does
(`parallelize.build_model`): the one GPTModel, holding the single-device initial weights, cut
over its tensor-parallel group by `tp.apply_tensor_parallel` (split by heads, MLP columns and
vocabulary rows), then wrapped by chapter 01's data parallelism over its data-parallel group
(bucketed DDP, or ZeRO-1/2 with --zero); and it trains with the training loop's own step,
`train.train_step`. After `--steps` AdamW steps `check_run` judges the run, in the parent (or
on rank 0 under torchrun), against three things computed independently of it:

  [1/3] equivalence: the losses, the first step's gradients and the final parameters, each
        reassembled from the shards under single-device names, against
        `testing.single_device_run` on the same global batch, with the largest differences
        and the tolerance; gradient clipping is active on every step;
  [2/3] communication: the ledger of each phase of a step, by group (TP, DP) and collective,
        against `expected_ledger`, analysis/communication.py's formulas (tensor_parallel_messages
        for the TP group, data_parallel_phases for the DP group; every rank and step checked);
  [3/3] parameters per rank: counted on the tensors, against
        `analysis.tensor_parallel_parameters` (what is split, what is replicated).

The last line starts with MATCH (exit status 0) or MISMATCH (exit status 1); under torchrun
every rank exits with rank 0's verdict.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch

from minimegatron import comm
from minimegatron.analysis import tensor_parallel_parameters
from minimegatron.analysis.communication import data_parallel_phases, grad_norm_messages, tensor_parallel_messages
from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.optim import learning_rate
from minimegatron.parallelize import build_model, build_optimizer, full_model_tensors, unwrap, validate_layout
from minimegatron.testing import (EquivalenceReport, RunRecord, compare_runs, local_microbatch, single_device_run)
from booktools.demo import (Results, Run, add_training_flags, check_at_least_one, demo_parser, import_chapter,
                            model_line, run_demo, verdict_line)
from minimegatron.resume import initialize_layout
from minimegatron.train import before_optimizer_step, train_step

ch00 = import_chapter("00")         # fingerprint: bit-identical replicas

Call = tuple[str, str, int, str]          # (op, "tp" or "dp", bytes, tag)


def tiny_model(style: str = "llama", dtype: str = "float64", **overrides) -> ModelConfig:
    """The chapter's model: h = 32, L = 2, 4 query heads, sequences up to 16, the byte
    vocabulary V = 257 (divisible by no tp > 1: it is padded), in `dtype`. LLaMA style
    (RMSNorm, SwiGLU, RoPE, no biases, untied) has 4 key/value groups, so it splits up to
    tp = 4 (GQA needs whole groups per rank); GPT-2 style (LayerNorm, GELU, learned positions,
    biases, tied embeddings)."""
    base = {"hidden_size": 32, "num_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 16,
            "params_dtype": dtype}
    if style == "llama":
        return ModelConfig.llama(**{**base, "num_query_groups": 4, **overrides}).validate()
    return ModelConfig.gpt2(**{**base, **overrides}).validate()


@dataclass(frozen=True)
class TPRun(Run):
    """One run (booktools.demo.Run): `model` trained on tp x dp ranks with `train` (zero_stage
    picks chapter 01's data-parallel variant; grad_accum_steps = M micro-batches of
    micro_batch_size = b rows of seq_length tokens per data-parallel rank; train_iters = steps)."""

    def name(self) -> str:
        return f"tensor parallelism on tp={self.tp} x dp={self.dp}"

    def local_microbatch(self, batch: dict, m: int, dp_rank: int) -> dict:
        """Micro-batch m of a global batch for data-parallel rank dp_rank (every rank of its
        TP group reads the same rows: testing.local_microbatch)."""
        return local_microbatch(batch, self.train, m, dp_rank, self.dp)


def make_run(model: ModelConfig, tp: int = 2, dp: int = 1, *, zero_stage: int = 0, micro_batches: int = 2,
             micro_batch_size: int = 2, steps: int = 2, clip_grad: float = 0.05, bucket_size: int | None = 4000,
             seed: int = 0) -> TPRun:
    """A validated TPRun (parallelize.validate_layout: ConfigError naming the numbers for a
    layout that does not split: heads, groups or ffn by tp). The demo runs zero_stage 0-2 (its
    ledger formula is chapter 01's for those; ZeRO-3 x TP: tests/test_zero_layouts.py). tp must be
    at least 2 (tp = 1 is chapter 01). AdamW eps 1e-5 in float32 (see testing.py), 1e-8 in
    float64. clip_grad 0.05 is below the tiny model's gradient norm (about 0.5 to 2): every
    step clips, so the global norm (replicated parameters counted once, optim.grads_for_norm)
    is part of what is checked."""
    if tp < 2 or dp < 1:
        raise ValueError(f"tp={tp} must be >= 2 and dp={dp} >= 1 (tp=1 is chapter 01's data parallelism)")
    train = TrainConfig(seq_length=model.max_position_embeddings, micro_batch_size=micro_batch_size,
                        grad_accum_steps=micro_batches, train_iters=steps, lr_warmup_iters=0, clip_grad=clip_grad,
                        adam_eps=1e-5 if model.params_dtype == "float32" else 1e-8, zero_stage=zero_stage,
                        ddp_bucket_size=bucket_size, tensor_model_parallel_size=tp, progress=False,
                        eval_interval=0)
    validate_layout(model, train, tp * dp)
    return TPRun(model, train, dp, seed)


def phase_names(micro_batches: int) -> list[str]:
    """The phases of a step whose communication is recorded separately."""
    return [f"micro-batch {m}" + (" + DP sync" if m == micro_batches - 1 else " (no_sync)")
            for m in range(micro_batches)] + ["optimizer step"]


# ---------------------------------------------------------------------------------------
# on every rank
# ---------------------------------------------------------------------------------------
def train_run(run: TPRun) -> dict:
    """Spawn (or torchrun) target, on every rank of a world of run.tp * run.dp ranks.

    The training loop's own pieces: resume.initialize_layout (the tp x dp groups),
    parallelize.build_model (GPTModel -> tp.apply_tensor_parallel over the TP group -> chapter
    01's data-parallel wrapper over the DP group), parallelize.build_optimizer (its gradient
    norm sums over the TP group, and over the DP group under ZeRO) and train.train_step
    (micro-batches 0..M-2 inside no_sync(), the last one outside, finalize_model_grads, clip,
    AdamW). Every step runs inside one ledger, cut into phases where each micro-batch's
    forward starts (a forward pre-hook) and where the gradients are final
    (train.before_optimizer_step).

    Returns {"tp_rank", "dp_rank", "losses" (this DP rank's loss per step), "ledger"
    [step][phase] -> [(op, "tp"|"dp", bytes, tag)], "param_elements" (elements of this rank's
    parameters), "dp_sync" (analysis.data_parallel_phases on this rank's parameter shapes, see
    expected_ledger), "fingerprints" {name: int} of the final full parameters, "grads"
    (first step, full, DP-averaged) and "params" (final, full) on rank 0 only}.
    """
    import torch.distributed as dist

    if dist.get_world_size() != run.world:
        raise ValueError(f"this run needs tp x dp = {run.tp} x {run.dp} = {run.world} ranks, "
                         f"the world has {dist.get_world_size()}")
    layout = initialize_layout(run.train)
    chunks = build_model(run.model, run.train, layout)                 # [the DP wrapper of the TP model]
    optimizer = build_optimizer(chunks, run.train, layout)
    model = unwrap(chunks[0])                                          # the GPTModel, this rank's shards
    tp_ranks = tuple(dist.get_process_group_ranks(layout.tp_group))

    def calls(records) -> list[Call]:
        return [(r.op, "tp" if r.group_ranks == tp_ranks else "dp", r.nbytes, r.tag) for r in records]

    M, out = run.micro_batches, {"tp_rank": layout.tp_rank, "dp_rank": layout.dp_rank, "losses": [], "ledger": []}
    out["param_elements"] = sum(p.numel() for p in model.parameters())
    e = torch.empty((), dtype=run.model.dtype).element_size()
    out["dp_sync"] = data_parallel_phases(model, run.train, run.dp, e)
    for step, batch in enumerate(run.global_batches()):
        microbatches = [run.local_microbatch(batch, m, layout.dp_rank) for m in range(M)]
        starts, final = [], []              # ledger positions: each forward's start; the grads final

        def on_grads():
            final.append(len(ledger.records))
            if step == 0:                   # collectives cut out of the ledger below
                out["grads"] = full_model_tensors(chunks, layout, grads=True)
            final.append(len(ledger.records))

        with comm.record_communication() as ledger, before_optimizer_step(optimizer, on_grads):
            hook = model.register_forward_pre_hook(lambda module, args: starts.append(len(ledger.records)))
            loss, _ = train_step(chunks, optimizer, microbatches, layout, learning_rate(step, run.train))
            hook.remove()
        bounds = [0] + starts[1:] + [final[0]]
        phases = [calls(ledger.records[a:b]) for a, b in zip(bounds, bounds[1:])]
        out["ledger"].append(phases + [calls(ledger.records[final[1]:])])
        out["losses"].append(loss)
    out["params"] = full_model_tensors(chunks, layout)
    out["fingerprints"] = {n: ch00.fingerprint(t) for n, t in out["params"].items()}
    if dist.get_rank() != 0:
        out["grads"], out["params"] = {}, {}
    return out


# ---------------------------------------------------------------------------------------
# the formulas
# ---------------------------------------------------------------------------------------
def expected_ledger(run: TPRun, dp_sync: list[list[tuple[str, int, str]]]) -> list[list[Call]]:
    """The collectives one rank issues in each phase of a step (`phase_names`), as
    (op, group, bytes, tag): the TP group's from analysis (tensor_parallel_messages per
    micro-batch, grad_norm_messages at the optimizer step), the DP group's `dp_sync`
    (analysis.data_parallel_phases on the shapes of a rank's parameters, a TP shard: train_run
    returns it; the shapes are checked against tensor_parallel_parameters)."""
    e = torch.empty((), dtype=run.model.dtype).element_size()

    def calls(counter: Counter, group: str) -> list[Call]:
        return [(op, group, n, tag) for (op, tag, n), c in counter.items() for _ in range(c)]
    tp = [calls(tensor_parallel_messages(run.model, run.train, 0), "tp")] * run.micro_batches
    tp.append(calls(grad_norm_messages(run.train, e), "tp"))
    return [mine + [(op, "dp", n, tag) for op, n, tag in dp] for mine, dp in zip(tp, dp_sync)]


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
    return verdict_line(reports, lambda r: f"tp={r.run.tp} x dp={r.run.dp} (ZeRO {r.run.train.zero_stage})",
                        "ledger and parameter counts equal the formulas")


# ---------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = demo_parser("02", "Chapter 02: train a tiny model tensor-parallel (x data-parallel) and check it against "
                               "the single-device run, the communication formula and the parameter formula.")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2; 2 or 4 for this model)")
    parser.add_argument("--dp", type=int, default=None,
                        help="data-parallel size (default: world / tp under torchrun, 2 without)")
    parser.add_argument("--zero", type=int, choices=[0, 1, 2], default=0,
                        help="chapter 01's DP variant: 0 bucketed DDP (default), 1 or 2 ZeRO")
    add_training_flags(parser)
    return check_at_least_one(parser, parser.parse_args(argv), "tp", "dp", "micro_batches", "micro_batch_size",
                              "steps")


def build_run(args: argparse.Namespace, dp: int) -> TPRun:
    """The run every rank trains; ConfigError (naming the numbers) for a layout that does not split."""
    sizes = {} if args.quick else dict(hidden_size=64, num_layers=3, max_position_embeddings=32)
    model = tiny_model(args.style, args.dtype, **sizes)
    return make_run(model, args.tp, dp, zero_stage=args.zero, micro_batches=args.micro_batches,
                    micro_batch_size=args.micro_batch_size, steps=args.steps if args.steps is not None else (2 if args.quick else 3))


@dataclass
class TPResults(Results):
    """What the report printed: the largest differences from the single-device run (to the
    printed 2 digits), rank 0's ledger rows of step 0 (phase, op, group, tag, calls, bytes,
    formula calls, formula bytes), every rank's parameter elements and the formula's."""
    max_loss_diff: float = 0.0
    max_grad_diff: float = 0.0
    max_param_diff: float = 0.0
    ledger: list = field(default_factory=list)
    param_elements: list = field(default_factory=list)
    param_elements_formula: int = 0


def report(args, run: TPRun, per_rank: list[dict]) -> TPResults:
    """Check the run, print the report; return its results (verdict: the last line)."""
    print(model_line(run.model))
    print()
    result = check_run(run, per_rank)
    print(result)
    e = result.equivalence
    return TPResults(0, summary_line([result]), *(float(f"{x:.1e}") for x in (e.max_loss_diff, e.max_grad_diff,
                                                                                e.max_param_diff)),
                     [list(row) for row in result.ledger], result.param_elements, result.formula["per_rank"])


def main(argv=None) -> TPResults:
    return run_demo(parse_args(argv), "02", build_run, train_run, report,
                    model_parallel=lambda args: {"tp": args.tp}, spawn_dp=lambda args: args.dp or 2)


if __name__ == "__main__":      # the guard matters: spawned ranks import this file again
    sys.exit(main().exit_code)
