"""Chapter 06 demo: the one model trained in bf16, fp16 or FP8 on tp x cp x pp x dp (x ep) ranks,
proven against one device in the same precision.

    python chapters/06_fp8/demo.py                                    # spawns 4 ranks: bf16, tp 2 x dp 2
    python chapters/06_fp8/demo.py --precision fp16 --tp 2 --pp 2 --quick
    python chapters/06_fp8/demo.py --precision fp8 --fp8-recipe delayed --tp 2 --sp --pp 2
    torchrun --standalone --nproc_per_node=8 chapters/06_fp8/demo.py --precision fp8 --fp8-recipe mxfp8 --tp 2 --sp --cp 2 --dp 2

This file is the chapter's experiment and its command line; make_figures.py, the notebook and
the graders run it from Python (`import_chapter("06")`). Every rank builds its model as the
training loop does (parallelize.build_model: ... -> FP8 -> the data-parallel wrapper, whose
float32 main_grad buffer mixed precision needs even at dp 1) and its optimizer (float32 main
parameters, fp16's loss scaler), and runs train.train_step (testing.train_layout). The report:

  [1/4] equivalence against testing.single_device_run in the same precision: bf16 and fp16
        models within their rows of testing.TOLERANCES (AdamW eps 1e-3: tests/test_precision.py
        says why); FP8 in a float64 model, whose layouts then agree to summation order (the
        casts see the same numbers), or, where a layout's casts may use other scales (README
        §5), within fp8_layout_tolerance (testing.cast_layout_tolerance's derivation);
  [2/4] memory: the bytes each rank keeps from step to step (parameters, the gradient buffer,
        the float32 main parameters, AdamW's moments; analysis.memory.held_state_bytes) against
        rank_parameters x the bytes per parameter of the precision (18 for bf16 with float32
        main gradients: Megatron's theoretical_memory_usage);
  [3/4] communication of one step from the ledger, every dimension against
        analysis.step_communication (run_report.communication_checks): the gradient reductions
        in the gradient dtype, the sequence-parallel gathers in the activations' dtype, the loss
        in float32, FP8's amax reductions;
  [4/4] quantisation (one process, a model trained for a few steps on the book's text): per
        recipe and tensor role, the relative error of the FP8 copy, the non-zero values that
        underflow to 0 and those that saturate;

and ends with a line starting MATCH (exit 0) or MISMATCH (exit 1). An --fp8-* flag makes the run
FP8 when --precision is not given, and is refused (exit 2) beside another --precision.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import torch

from booktools.demo import (Results, Run, busiest_rank_communication, check_at_least_one, communication_report,
                            demo_parser, run_demo, verdict_line)
from minimegatron.analysis import count_parameters, rank_parameters
from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.parallelize import validate_layout
from minimegatron.run_report import KEYS_OF_THIS_RANK, held_bytes_per_parameter, records_by_dimension
from minimegatron.testing import (EquivalenceReport, RunRecord, Tolerance, cast_layout_tolerance, compare_runs,
                                  one_device_config, single_device_run, train_layout)

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
FP8_FLAGS = ("fp8_recipe", "fp8_format")           # flags that only an FP8 run reads


def fp8_layout_tolerance(run: "PrecisionRun", reference: RunRecord) -> Tolerance:
    """The tolerance of an FP8 layout that cannot equal one device bit for bit (README §5): some
    casts use another scale than one device's. testing.cast_layout_tolerance derives it from
    the FP8 grids (e4m3 forward, 2^-4; the gradients e5m2, 2^-3, under hybrid), the 4 cast
    GEMMs a layer on the backward path, the step's tokens (micro_batch_size x micro-batches x
    dp x seq), the vocabulary, AdamW's lr and steps, and the reference's largest first-step
    gradient."""
    t = run.train
    tokens = t.micro_batch_size * t.grad_accum_steps * run.dp * t.seq_length
    largest = max(g.abs().max().item() for g in reference.grads.values())
    return cast_layout_tolerance("e4m3", tokens, run.model.vocab_size, t, largest,
                                 gradient_grid="e5m2" if t.fp8_format == "hybrid" else "e4m3",
                                 cast_gemms=4 * run.model.num_layers)


@dataclass(frozen=True)
class PrecisionRun(Run):
    precision: str = "bf16"

    def name(self) -> str:
        parts = [f"tp={self.tp}" + (" + SP" if self.sp else "")] + [f"{k}={getattr(self, k)}" for k in ("cp", "pp")
                                                                    if getattr(self, k) > 1]
        if self.train.expert_model_parallel_size > 1:
            parts.append(f"ep={self.train.expert_model_parallel_size}")
        what = self.precision + (f" ({self.train.fp8_recipe}, {self.train.fp8_format})" if self.precision == "fp8" else "")
        return f"{what}: " + " x ".join(parts + [f"dp={self.dp}"])


def model_dtype(precision: str) -> str:
    """bf16 and fp16 train 16-bit models; fp32 and FP8 runs are checked in float64 (FP8's casts
    then see the same numbers on every layout)."""
    return {"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float64")


def tiny_model(precision: str, hidden: int = 32, layers: int = 2, experts: int | None = None,
               style: str = "llama") -> ModelConfig:
    return getattr(ModelConfig, style)(hidden_size=hidden, num_layers=layers, num_attention_heads=4,
                                       num_query_groups=2, ffn_hidden_size=2 * hidden, vocab_size=64,
                                       max_position_embeddings=128, params_dtype=model_dtype(precision),
                                       **({"num_experts": experts, "moe_router_topk": 2} if experts else {}))


def inexact_fp8(precision: str, recipe: str, tp: int, cp: int, dp: int, ep: int, etp: int | None = None,
                experts: bool | None = None) -> str | None:
    """Why an FP8 layout cannot equal one device bit for bit (README §5), or None when it can.
    `experts`: the model has routed experts (by default: ep > 1, as the demo's models do);
    `etp` defaults to tp. An expert's tokens are one micro-batch's, as on one device, exactly
    when its etp x ep ranks are the tp x cp ranks of one replica (Megatron's rank order lays
    both out fastest-first from the same ranks): then one scale per tensor is the same."""
    if precision != "fp8":
        return None
    etp, experts = etp or tp, ep > 1 if experts is None else experts
    reasons = ([f"delayed scaling over {dp} data-parallel replicas"] * (recipe == "delayed" and dp > 1) +
               [f"delayed scaling over {cp} context-parallel ranks"] * (recipe == "delayed" and cp > 1))
    if recipe == "blockwise" and cp > 1:
        reasons.append(f"blockwise's 128-token blocks of the weight gradient cut by {cp} context-parallel ranks' "
                       f"chunks")
    if experts and recipe in ("tensorwise", "delayed") and ep * etp != tp * cp:
        reasons.append(f"routed experts on ep x etp = {ep * etp} ranks, not the tp x cp = {tp * cp} ranks of one "
                       f"micro-batch's tokens")
    elif experts and recipe in ("blockwise", "mxfp8") and ep > 1:
        reasons.append(f"routed experts fed by the {ep} ranks of their expert-parallel group (their tokens, "
                       f"which the weight gradient's blocks run along, in another order)")
    return "; ".join(reasons) or None


def make_run(model: ModelConfig, precision: str, tp: int = 1, cp: int = 1, pp: int = 1, dp: int = 1, *,
             sp: bool = False, ep: int = 1, fp8_recipe: str = "delayed", fp8_format: str = "hybrid",
             micro_batches: int = 2, steps: int = 3, seq: int = 32, zero_stage: int = 0) -> PrecisionRun:
    """A validated PrecisionRun (ConfigError naming the numbers before any process starts).
    AdamW eps 1e-3 for 16-bit models (a near-zero gradient's 16-bit rounding would otherwise
    flip a whole lr-sized step: tests/test_precision.py), the usual 1e-8 otherwise."""
    fp8 = dict(fp8_format=fp8_format, fp8_recipe=fp8_recipe, fp8_amax_history_len=4, fp8_amax_compute_algo="max")
    train = TrainConfig(seq_length=seq, micro_batch_size=2, grad_accum_steps=micro_batches, train_iters=steps,
                        lr=1e-2, lr_warmup_iters=0, clip_grad=1.0, progress=False, eval_interval=0,
                        adam_eps=1e-3 if precision in ("bf16", "fp16") or inexact_fp8(precision, fp8_recipe, tp, cp, dp, ep,
                                                                                            experts=model.num_experts is not None)
                        else 1e-8,
                        bf16=precision == "bf16", fp16=precision == "fp16",
                        initial_loss_scale=2.0 ** 12 if precision == "fp16" else 2.0 ** 32, loss_scale_window=2,
                        tensor_model_parallel_size=tp, context_parallel_size=cp, pipeline_model_parallel_size=pp,
                        sequence_parallel=sp, expert_model_parallel_size=ep, zero_stage=zero_stage,
                        **(fp8 if precision == "fp8" else {}))
    validate_layout(model, train, tp * cp * pp * dp)
    return PrecisionRun(model, train, dp, precision=precision)


# ---------------------------------------------------------------------------------------
# on every rank
# ---------------------------------------------------------------------------------------
def train_run(run: PrecisionRun) -> dict:
    """Spawn (or torchrun) target: testing.train_layout's record, plus what run_report reads of a
    rank ("pp_rank", "ep_group", "records" by dimension), the parameters it holds
    ("held_parameters": dense, experts), the bytes it keeps ("held": analysis.memory.held_state_bytes) and
    the loss scale it ended with."""
    from minimegatron.dp import unwrap
    from minimegatron.parallel_state import get_group_ranks
    from minimegatron.analysis.memory import held_state_bytes, local_parameter_counts

    out, chunks, layout, optimizer = train_layout(run.model, run.train, run.dp, run.global_batches())
    groups = {k: get_group_ranks(k) for k in KEYS_OF_THIS_RANK} if layout.world > 1 else {}
    out.pop("microbatches")
    out.update({"ep_group": groups.get("ep", []), "held_parameters": local_parameter_counts(chunks),
                "records": records_by_dimension(out.pop("records"), groups), "held": held_state_bytes(chunks, optimizer),
                "loss_scale": optimizer.loss_scale, "dtype": str(next(unwrap(chunks[0]).parameters()).dtype)})
    return out


# ---------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------
@dataclass
class RunReport:
    run: PrecisionRun
    equivalence: EquivalenceReport
    lines: list[str]
    problems: list[str]
    values: dict = field(default_factory=dict)      # what PrecisionResults keeps of the lines' numbers

    @property
    def ok(self) -> bool:
        return self.equivalence.ok and not self.problems


def kept_bytes_formula(run: PrecisionRun, n: int) -> tuple[int, str]:
    """(bytes a rank keeps for its n parameters, how): without ZeRO n x the precision's bytes per
    parameter; with ZeRO-1 (Megatron's distributed optimizer) the parameters and gradients whole,
    the main parameters and AdamW's moments 1/d of them, d = dp x cp (Megatron's 6 + 12/d for
    bf16), when the shards divide evenly (as the demo's model does)."""
    t = run.train
    if not t.zero_stage:
        per = held_bytes_per_parameter(run.model, t)
        return n * per, f"{n:,} x {per}"
    params, grads, main, moments = _bytes_each(run.model, t)
    d = run.dp * run.cp
    return n * (params + grads) + (main + moments) * n // d, f"{n:,} x ({params} + {grads}) + {n:,} x {main + moments} / {d}"


def check_run(run: PrecisionRun, per_rank: list[dict]) -> RunReport:
    t, problems, lines, values = run.train, [], [], {"stages": [], "inexact": None, "loss_scale": None}
    reference = single_device_run(run.model, run.global_batches(), one_device_config(run.train),
                                  grad_accum_steps=t.grad_accum_steps * run.dp)
    mine = per_rank[0]
    why = inexact_fp8(run.precision, t.fp8_recipe, run.tp, run.cp, run.dp, t.expert_model_parallel_size, t.etp,
                      run.model.num_experts is not None)
    values["inexact"] = why
    equivalence = compare_runs(reference, RunRecord(mine["losses"], mine["grads"], mine["params"]), run.model.dtype,
                               fp8_layout_tolerance(run, reference) if why else None)
    lines.append(f"[1/4] equivalence with one device in {run.precision}, parameters {mine['dtype']}, over "
                 f"{len(mine['losses'])} steps (tolerance: " + (
                     f"fp8_layout_tolerance (testing.cast_layout_tolerance: one FP8 step of the coarsest grid "
                     f"over the step's tokens, AdamW's lr a step), AdamW eps 1e-3: this layout cannot equal one "
                     f"device bit for bit, README §5: {why}" if why
                     else f"the {run.model.params_dtype} row of testing.TOLERANCES") + "):")
    lines += ["  " + line for line in str(equivalence).splitlines()]
    if t.fp16:
        values["loss_scale"] = mine["loss_scale"]
        lines.append(f"  fp16 loss scale after the run: {mine['loss_scale']:g} (from {t.initial_loss_scale:g}, doubling "
                     f"after every {t.loss_scale_window} clean steps; the same on every rank: "
                     f"{len({r['loss_scale'] for r in per_rank}) == 1})")
    per_parameter = held_bytes_per_parameter(run.model, t)
    zero = f", ZeRO-{t.zero_stage}: main parameters and moments over dp x cp = {run.dp * run.cp}" if t.zero_stage else ""
    lines.append(f"[2/4] memory each rank keeps from step to step, against rank_parameters x {per_parameter} bytes "
                 f"(parameters, gradients, main parameters, AdamW's moments: "
                 f"{' + '.join(str(v) for v in _bytes_each(run.model, t))}{zero}):")
    for stage in range(run.pp):
        r = next(r for r in per_rank if r["pp_rank"] == stage)
        n = sum(rank_parameters(run.model, t, stage).values())
        if r["held_parameters"] != rank_parameters(run.model, t, stage):
            problems.append(f"stage {stage} holds {r['held_parameters']} parameters, rank_parameters says "
                            f"{rank_parameters(run.model, t, stage)}")
        held = r["held"]
        measured = sum(held.values())
        formula, how = kept_bytes_formula(run, n)
        values["stages"].append({"parameters": n, "bytes": measured, "formula": formula})
        lines.append(f"  stage {stage}: {n:,} parameters: {held['parameters']:,} + {held['gradients']:,} + "
                     f"{held['main_parameters']:,} + {held['optimizer']:,} = {measured:,} bytes; formula "
                     f"{how} = {formula:,}: {'equal' if measured == formula else 'DIFFERENT'}")
        if measured != formula:
            problems.append(f"stage {stage} keeps {measured:,} bytes, the formula {formula:,}")
    comm_lines, comm_problems = communication_report(run.model, t, per_rank)
    lines += ["[3/4] one step's communication per dimension (the busiest rank), against analysis.step_communication:",
              *comm_lines]
    problems += comm_problems
    values["communication"] = busiest_rank_communication(per_rank)     # what communication_report printed
    if any(r["losses"] != per_rank[0]["losses"] for r in per_rank):
        problems.append("the ranks report different losses")
    return RunReport(run, equivalence, lines, problems, values)


def _bytes_each(model: ModelConfig, cfg: TrainConfig) -> list[int]:
    from minimegatron.analysis import adam_bytes_per_parameter
    each = adam_bytes_per_parameter(model.dtype, cfg.bf16 or cfg.fp16, cfg.main_grads_dtype)
    return [each["params"], each["grads"], each["master_weights"], each["exp_avg"] + each["exp_avg_sq"]]


# ---------------------------------------------------------------------------------------
# quantisation on real tensors (one process)
# ---------------------------------------------------------------------------------------
def quantisation_table(steps: int = 30, seq: int = 64) -> dict:
    """{recipe: {role: {"rel_error", "underflow", "saturated"}}}: a float32 LLaMA-style model
    (h 64, 2 layers) trained for `steps` AdamW steps on the book's text in FP8 with each recipe
    (hybrid formats), every scale-setting cast of the last 10 steps measured (fp8/linear.py's
    stats): the relative error |x_fp8 - x| / |x|, the fraction of non-zero elements that became
    0, and the fraction of elements at the format's largest value."""
    from minimegatron.data import batch_for_step
    from minimegatron.fp8 import Fp8Gemm
    from minimegatron.parallel_state import Layout
    from minimegatron.parallelize import build_model, build_optimizer
    from minimegatron.optim import learning_rate
    from minimegatron.train import build_datasets, train_step

    out = {}
    for recipe in RECIPES:
        model_cfg = ModelConfig.llama(hidden_size=64, num_layers=2, num_attention_heads=4, max_position_embeddings=seq,
                                      vocab_size=260)
        cfg = TrainConfig(seq_length=seq, micro_batch_size=4, train_iters=steps, lr_warmup_iters=3, progress=False,
                          eval_interval=0, fp8_format="hybrid", fp8_recipe=recipe)
        torch.manual_seed(0)
        chunks = build_model(model_cfg, cfg, Layout())
        optimizer = build_optimizer(chunks, cfg, Layout())
        data = build_datasets(model_cfg, cfg)[0]
        gemms = [m.gemm for m in chunks[0].modules() if isinstance(getattr(m, "gemm", None), Fp8Gemm)]
        stats: dict = {}
        for step in range(steps):
            if step == steps - 10:
                for g in gemms:
                    g.stats = stats
            batch = batch_for_step(data, step, cfg.micro_batch_size, 0, 1)
            train_step(chunks, optimizer, [batch], Layout(), learning_rate(step, cfg))
        out[recipe] = {role: {"rel_error": s["rel_error"] / s["casts"], "underflow": s["underflow"] / s["elements"],
                              "saturated": s["saturated"] / s["elements"]} for role, s in sorted(stats.items())}
    return out


def quantisation_lines(table: dict, steps: int = 30) -> list[str]:
    """The demo's [4/4] lines for quantisation_table(steps)'s result."""
    lines = [f"[4/4] FP8 copies of real training tensors (h 64, 2 layers, the book's text; the last 10 of {steps} "
             f"steps, hybrid: e4m3 forward, e5m2 output gradients):",
             f"  {'recipe':<11}{'role':<13}{'rel. error':>11}{'underflow':>11}{'saturated':>11}"]
    for recipe, roles in table.items():
        for role, s in roles.items():
            lines.append(f"  {recipe:<11}{role:<13}{s['rel_error']:>11.4f}{s['underflow']:>10.3%}{s['saturated']:>11.4%}")
    return lines


# ---------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = demo_parser("06", "Chapter 06: train the tiny model in bf16, fp16 or FP8 under any layout and check it "
                               "against one device in the same precision, the memory and communication formulas, and "
                               "show FP8's quantisation errors.")
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="default bf16, or fp8 when an --fp8-* flag is given")
    parser.add_argument("--fp8-recipe", choices=RECIPES, default=None, help="FP8 only (default delayed)")
    parser.add_argument("--fp8-format", choices=["hybrid", "e4m3"], default=None,
                        help="FP8 only: hybrid (e4m3 forward, e5m2 gradients; the default) or e4m3 throughout")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp > 1)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size: > 1 gives the model 4 experts per layer")
    parser.add_argument("--dp", type=int, default=None, help="data-parallel replicas (default: world / (tp cp pp) "
                                                            "under torchrun, else 2)")
    parser.add_argument("--zero-stage", type=int, choices=[0, 1], default=0,
                        help="1: ZeRO-1 (Megatron's distributed optimizer): main parameters and moments sharded")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="AdamW steps (default 3, or 2 with --quick)")
    parser.add_argument("--quick", action="store_true", help="2 steps, no quantisation table (what the tests run)")
    args = parser.parse_args(argv)
    given = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in FP8_FLAGS if getattr(args, k) is not None]
    if args.precision is None:
        args.precision = "fp8" if given else "bf16"
    elif given and args.precision != "fp8":
        parser.error(f"{' and '.join(given)} would be ignored: --precision {args.precision} casts nothing to FP8 "
                     f"(use --precision fp8, or drop the flag)")
    args.fp8_recipe, args.fp8_format = args.fp8_recipe or "delayed", args.fp8_format or "hybrid"
    return check_at_least_one(parser, args, "tp", "cp", "pp", "ep", "dp", "micro_batches", "steps")


def build_run(args: argparse.Namespace, dp: int) -> PrecisionRun:
    """The run every rank trains; ConfigError naming the numbers if it cannot. For the blocked
    FP8 recipes the model is wide enough that every shard holds whole blocks (MXFP8: 32, h 64;
    blockwise: 128, h 256), and the sequence long enough that a context-parallel chunk does."""
    if args.ep > 1 and args.tp > 1 and not args.sp:
        raise ConfigError(f"--ep {args.ep} with --tp {args.tp} needs --sp (chapter 05: each tp rank routes its own "
                          f"s/tp tokens)")
    hidden = {"mxfp8": 64, "blockwise": 256}.get(args.fp8_recipe, 32) if args.precision == "fp8" else 32
    seq = {"mxfp8": 64 * args.cp, "blockwise": 64}.get(args.fp8_recipe, 32) if args.precision == "fp8" else 32
    model = tiny_model(args.precision, hidden, layers=2 * args.pp, experts=4 if args.ep > 1 else None)
    return make_run(model, args.precision, args.tp, args.cp, args.pp, dp, sp=args.sp, ep=args.ep,
                    fp8_recipe=args.fp8_recipe, fp8_format=args.fp8_format, micro_batches=args.micro_batches,
                    zero_stage=args.zero_stage,
                    steps=args.steps if args.steps is not None else (2 if args.quick else 3), seq=seq)


@dataclass
class PrecisionResults(Results):
    stages: list = field(default_factory=list)      # [2/4] per stage: parameters, bytes kept, the formula's bytes
    loss_scale: float | None = None                 # fp16: the loss scale after the run
    communication: dict = field(default_factory=dict)   # [3/4] dimension -> calls, bytes of the busiest rank
    inexact: str | None = None                      # [1/4] why the layout cannot equal one device bit for bit
    quantisation: dict | None = None                # [4/4] recipe -> role -> the printed (rounded) numbers


def report(args, run: PrecisionRun, per_rank: list[dict]) -> PrecisionResults:
    result = check_run(run, per_rank)
    print(f"model: {run.model.normalization}/{run.model.activation}, h={run.model.hidden_size} "
          f"L={run.model.num_layers}, {count_parameters(run.model)['total']:,} parameters, {run.model.params_dtype}")
    print("\n".join(result.lines))
    quantisation = None
    if not args.quick:
        table = quantisation_table()
        print("\n".join(quantisation_lines(table)))
        quantisation = {recipe: {role: {"rel_error": round(s["rel_error"], 4), "underflow_pct": round(100 * s["underflow"], 3),
                                        "saturated_pct": round(100 * s["saturated"], 4)} for role, s in roles.items()}
                        for recipe, roles in table.items()}
    claim = "every rank keeps the bytes and moves the messages the formulas say"
    return PrecisionResults(verdict=verdict_line([result], lambda r: r.run.name(), claim), quantisation=quantisation,
                            **result.values)


def main(argv=None) -> PrecisionResults:
    return run_demo(parse_args(argv), "06", build_run, train_run, report,
                    model_parallel=lambda args: {"tp": args.tp, "cp": args.cp, "pp": args.pp},
                    spawn_dp=lambda args: args.dp if args.dp is not None else 2)


if __name__ == "__main__":      # the guard matters: spawned ranks import this file again
    sys.exit(main().exit_code)
