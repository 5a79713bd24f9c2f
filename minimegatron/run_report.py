"""What the training entry shows about its own run: the layout, the rank grid, and what each
dimension of the grid moves in one step (measured, from comm's ledger).

    torchrun --nproc_per_node=16 -m minimegatron.run_report [--check-steps K] <minimegatron.train's flags>
    python -m minimegatron.run_report --preset tiny        # one process: the report, the check trivially
                                                           # MATCH (the Makefile's demo target runs the first)

Before training (rank 0): `layout_lines`, a table of each dimension's size and what it cuts,
with the chapter that explains it, and `rank_grid_lines`, the ranks as a small text picture
(each row a pipeline stage; [a b] a tensor-parallel group; the context-parallel and data-
parallel coordinates as column heads; the expert-parallel groups of the first stage below).

After training (rank 0), from every rank's summary: one optimizer step's collectives summed per
dimension of the grid (`dimension_of` says which dimension a record belongs to, by its tag or
its group) and checked against analysis/communication.py's formulas (`communication_checks`);
each rank's parameters against `rank_parameters` and the bytes it holds from step to step
(parameters, gradients, AdamW's moments) against 4 x e x those; the activations one micro-batch
saves against one process's, and the micro-batches each stage holds at its peak against its
schedule (`activation_lines`); the pipeline bubble against (p-1)/(vm+p-1); the throughput; and
summary.png. Then, with --check-steps K (default 2), the book's promise for this very layout:
K steps in float64 on these ranks against one process, MATCH or MISMATCH
(`check_against_one_device`). The exit status is 1 when a formula does not hold or the check
says MISMATCH.

Bytes are comm's convention (comm/ledger.py): what a rank hands to the call (the shard of an
all-gather, the full input of a reduce-scatter, the tensor of a send).
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from . import train
from .analysis import (ROUTING_DEPENDENT, adam_bytes_per_parameter, count_parameters, gradient_element_size,
                       measure_saved_activation_bytes, rank_parameters, step_communication)
from .comm import all_reduce
from .comm.ledger import CommRecord
from .config import ModelConfig, TrainConfig
from .data import batch_for_step
from .model import GPTModel
from .parallel_state import get_group_ranks, get_layout, rank_coordinates, rank_groups
from .pp.schedules import num_warmup_microbatches
from .pp.timeline import StepRecord, bubble_fraction
from .testing import RunRecord, compare_runs, single_device_run, train_layout
from .viz import plot_run_summary

__all__ = ["layout_lines", "rank_grid_lines", "dimension_of", "DIMENSION_ORDER", "records_by_dimension",
           "communication_checks", "report_lines", "activation_lines", "in_flight_formula", "check_against_one_device",
           "main"]

ORDER = "tp-cp-ep-dp-pp"          # Megatron's default order string, the one parallel_state builds


def _sizes(cfg: TrainConfig, world: int) -> dict[str, int]:
    tp, cp, pp = cfg.tensor_model_parallel_size, cfg.context_parallel_size, cfg.pipeline_model_parallel_size
    ep, etp = cfg.expert_model_parallel_size, cfg.etp
    return dict(tp=tp, cp=cp, pp=pp, dp=world // (tp * cp * pp), ep=ep, etp=etp, expert_dp=world // (etp * ep * pp))


def layout_lines(model_cfg: ModelConfig, cfg: TrainConfig, world: int) -> list[str]:
    """The layout table: one row per dimension, its size, what it cuts in this run (the numbers
    of this model and batch), and the chapter that explains it."""
    n = _sizes(cfg, world)
    L, s = model_cfg.num_layers, cfg.seq_length
    a, g = model_cfg.num_attention_heads, model_cfg.query_groups
    M, b = cfg.grad_accum_steps, cfg.micro_batch_size
    sp = " + SP" if cfg.sequence_parallel else ""
    rows = [(f"tp{sp}", n["tp"],
             f"every weight matrix, 1/{n['tp']} per rank ({a // n['tp']} of {a} heads, {g // n['tp']} of {g} KV groups)"
             + (f"; SP: the norms and residuals between them, {s // n['cp'] // n['tp']} tokens per rank"
                if cfg.sequence_parallel else ""),
             "02 §2" + (", 04 §2" if cfg.sequence_parallel else "")),
            ("cp", n["cp"],
             f"every sequence: {s} tokens in {2 * n['cp']} chunks of {s // (2 * n['cp'])}, 2 per rank (zig-zag), "
             f"attention by {cfg.cp_comm_type}" if n["cp"] > 1 else "-",
             "04 §4" if cfg.cp_comm_type == "p2p" else "04 §6")]
    if model_cfg.num_experts is not None:
        E, k = model_cfg.num_experts, model_cfg.moe_router_topk
        rows += [("ep", n["ep"], f"the {E} experts of each MoE layer: {E // n['ep']} per rank; top-{k} routing, "
                                 f"{cfg.moe_token_dispatcher_type} dispatcher", "05 §4"),
                 ("etp", n["etp"], f"each expert's matrices, 1/{n['etp']} per rank" if n["etp"] > 1 else "-", "05 §5")]
    rows += [("dp", n["dp"], f"the batch: {b} x {M} sequences per replica per step of {b * M * n['dp']}; dense "
                             f"gradients averaged over dp x cp = {n['dp'] * n['cp']} ranks"
                             + (f", ZeRO-{cfg.zero_stage}" if cfg.zero_stage else "") if n["dp"] * n["cp"] > 1 else "-",
              "01 §5" if cfg.zero_stage else "01 §3")]
    if model_cfg.num_experts is not None:
        rows += [("expert-dp", n["expert_dp"], f"the experts' gradients, averaged over {n['expert_dp']} ranks that "
                                               f"hold the same experts" if n["expert_dp"] > 1 else "-", "05 §6")]
    v = cfg.num_virtual_stages_per_pipeline_rank
    rows += [("pp", n["pp"], f"the {L} layers: {L // n['pp']} per stage" + (f" in {v} chunks" if v > 1 else "") +
              f"; {cfg.pipeline_schedule} over {M} micro-batches" if n["pp"] > 1 else "-", "03 §3")]
    width = max(len(r[0]) for r in rows)
    sizes = " x ".join(f"{k} {n[k]}" for k in ("tp", "cp", "dp", "pp"))
    experts = (f"; experts: etp {n['etp']} x ep {n['ep']} x expert-dp {n['expert_dp']} x pp {n['pp']}"
               if model_cfg.num_experts is not None else "")
    return [f"layout: {world} rank{'s' * (world > 1)} = {sizes}{experts} (Megatron's order {ORDER}, tp fastest)",
            f"  {'dim':<{width}} {'size':>4}  {'chapter':<13}what it cuts",
            *(f"  {name:<{width}} {size:>4}  {chapter:<13}{what}" for name, size, what, chapter in rows)]


def rank_grid_lines(cfg: TrainConfig, world: int) -> list[str]:
    """The ranks as a text picture: one row per pipeline stage, one column per (dp, cp)
    coordinate, [a b] the ranks of a tensor-parallel group; then the expert-parallel groups of
    stage 0 (ranks that exchange tokens) when ep > 1."""
    n = _sizes(cfg, world)
    kw = dict(tp=n["tp"], pp=n["pp"], cp=n["cp"], ep=n["ep"], etp=n["etp"], order=ORDER)
    cells: dict[tuple[int, int, int], list[int]] = defaultdict(list)
    for r, c in enumerate(rank_coordinates(r, world, **kw) for r in range(world)):
        cells[(c["pp_rank"], c["dp_rank"], c["cp_rank"])].append(r)
    cols = [(d, c) for d in range(n["dp"]) for c in range(n["cp"])]
    text = {key: "[" + " ".join(map(str, ranks)) + "]" for key, ranks in cells.items()}
    width = max(max(len(t) for t in text.values()), len("dp 0 cp 0"))
    lines = [f"rank grid (chapter 05 §7): rows are pipeline stages, [ ] a tensor-parallel group of {n['tp']}"]
    lines.append(("          " + " ".join(f"{f'dp {d} cp {c}' if n['cp'] > 1 else f'dp {d}':<{width}}"
                                         for d, c in cols)).rstrip())
    for stage in range(n["pp"]):
        lines.append((f"  stage {stage} " + " ".join(f"{text[(stage, d, c)]:<{width}}" for d, c in cols)).rstrip())
    if n["ep"] > 1:
        groups = rank_groups(world, **kw)
        first = {pipeline[0] for pipeline in groups["pp"]}
        ep_groups = [gr for gr in groups["ep"] if gr[0] in first]
        lines.append("  expert-parallel groups of stage 0 (the ranks that exchange tokens): "
                     + " ".join("[" + " ".join(map(str, gr)) + "]" for gr in ep_groups))
    return lines


# ---------------------------------------------------------------------------------------
# communication per dimension
# ---------------------------------------------------------------------------------------
DIMENSION_ORDER = ("tp", "cp", "ep", "etp", "dp", "expert-dp", "pp", "embedding", "fp8", "loss and norm")
# the tags that say their dimension: the reported loss and the gradient norm, one-scale FP8 casts
# agreeing on their amax (fp8/linear.py), the gradient reductions (the experts' own buckets:
# dp/ddp.py), a mixture's counts over its token set (tp x cp) or its stage
DIMENSION_OF_TAG = {"loss": "loss and norm", "grad-norm": "loss and norm", "found-inf": "loss and norm",
                    "fp8-amax": "fp8", "embedding-grads": "embedding", "expert-grads": "expert-dp", "grads": "dp",
                    "params": "dp", "moe-aux": "ep", "moe-bias": "ep"}


def dimension_of(record: CommRecord, groups: dict[str, list[int]]) -> str:
    """Which dimension of the grid a collective of this rank belongs to: by its tag where the
    tag says (the pipeline's p2p, the MoE dispatcher's messages, the gradient reductions, the
    reported loss and the gradient norm), else by the group it ran on (`groups`: this rank's
    group of each key of parallel_state, as global ranks)."""
    # a recomputed forward's messages (chapter 07) belong where the first forward's do
    tag, ranks = (record.tag or "").removeprefix("recompute "), list(record.group_ranks)
    if tag in DIMENSION_OF_TAG:
        return DIMENSION_OF_TAG[tag]
    if tag.startswith("pp-"):
        return "pp"
    if tag.startswith("moe-"):
        return "etp" if tag.startswith("moe-etp") or ranks == groups.get("etp") != groups.get("ep") else "ep"
    return next((name for key, name in (("tp", "tp"), ("cp", "cp"), ("dp-cp", "dp"), ("pp", "pp"))
                 if ranks == groups.get(key)), "other")


def records_by_dimension(records: list[CommRecord], groups: dict[str, list[int]]) -> dict[str, Counter]:
    """{dimension: Counter{(op, tag, bytes): calls}} of one rank's records (dimension_of)."""
    out: dict[str, Counter] = {}
    for r in records:
        out.setdefault(dimension_of(r, groups), Counter())[(r.op, r.tag or "", r.nbytes)] += 1
    return out


# what each line of the report is checked against, and where the book explains it
EXPLAINED = {"tp": "02 §4, 04 §2", "cp": "04 §4, §6", "ep": "05 §4", "etp": "05 §5", "dp": "01 §3",
             "expert-dp": "05 §6", "pp": "03 §2", "embedding": "03 §6", "fp8": "06 §5", "loss and norm": "02 §7"}


def _bytes(records: dict[str, Counter], dim: str, tags=None, op=None) -> int:
    """Bytes in one rank's `records` (records_by_dimension) on `dim`, of the `tags` and the `op` where given."""
    return sum(b * n for (o, tag, b), n in records.get(dim, Counter()).items()
               if (tags is None or tag in tags) and op in (None, o))


def communication_checks(model_cfg: ModelConfig, cfg: TrainConfig, gathered: list[dict]) -> dict[str, list[str]]:
    """{dimension: the differences found, [] for none} over every rank's summary (`_summary`):
    the records of analysis.step_communication exactly, the gradient reductions' bytes against
    the rank's parameters by analysis.rank_parameters, and for the dispatcher's routing-dependent messages the sums that
    must agree (each ep group combines the rows it dispatched; a rank's dispatch backward moves
    what its combine moved; an etp reduce-scatter takes etp times what its all-gather gave)."""
    g, n = gradient_element_size(model_cfg, cfg), _sizes(cfg, len(gathered))
    found: dict[str, list[str]] = defaultdict(list)
    for rank, r in enumerate(gathered):
        got, formula = r["records"], rank_parameters(model_cfg, cfg, r["pp_rank"])
        for dim, want in step_communication(model_cfg, cfg, len(gathered), r["pp_rank"]).items():
            mine = Counter({k: c for k, c in got.get(dim, Counter()).items()
                            if k[1].removeprefix("recompute ") not in ROUTING_DEPENDENT
                            and k[1] not in ("grads", "expert-grads")})
            found[dim] += [] if want is None or mine == want else [f"rank {rank}: unexpected {dict(mine - want)}, "
                                                                   f"missing {dict(want - mine)}"]
        if cfg.zero_stage == 0:
            for dim, tag, kind in (("dp", "grads", "dense"), ("expert-dp", "expert-grads", "experts")):
                size = n["dp"] * n["cp"] if dim == "dp" else n["expert_dp"]
                if size > 1 and formula[kind]:
                    moved, want = _bytes(got, dim, (tag,)), formula[kind] * g
                    found[dim] += [] if moved == want else [f"rank {rank}: {moved:,} bytes, its gradients {want:,}"]
        if _bytes(got, "ep", ("moe-dispatch-bwd",)) != _bytes(got, "ep", ("moe-combine",)):
            found["ep"].append(f"rank {rank}: its dispatch's backward moved other bytes than its combine")
        for tag in ("moe-etp", "moe-etp-bwd"):
            gathered_in, scattered = (_bytes(got, "etp", (tag,), op) for op in ("all_gather", "reduce_scatter"))
            if scattered != n["etp"] * gathered_in:
                found["etp"].append(f"rank {rank}: {tag} reduce-scatters {scattered:,} bytes, etp x all-gathered "
                                    f"{n['etp'] * gathered_in:,}")
    for group in {tuple(r["ep_group"]) for r in gathered if len(r["ep_group"]) > 1}:
        sent, back = (sum(_bytes(gathered[m]["records"], "ep", (tag,)) for m in group)
                      for tag in ("moe-dispatch", "moe-combine"))
        if sent != back:
            found["ep"].append(f"ep group {list(group)}: {sent:,} bytes dispatched, {back:,} combined")
    return found


def report_lines(model_cfg: ModelConfig, cfg: TrainConfig, gathered: list[dict]) -> tuple[list[str], int]:
    """What rank 0 prints after training, and how many checks failed: one step's communication
    per dimension against the formulas, the parameters and the state bytes of every rank
    against rank_parameters, the pipeline bubble."""
    world, n = len(gathered), _sizes(cfg, len(gathered))
    checks = communication_checks(model_cfg, cfg, gathered)
    failed = sum(bool(v) for v in checks.values())
    lines = ["communication of one optimizer step on each rank, per dimension (the busiest rank's calls and bytes "
             "handed to the collectives), against the formulas of analysis/communication.py:"]
    dims = [d for d in (*DIMENSION_ORDER, "other") if any(d in r["records"] for r in gathered) or d in checks]
    if not dims:
        lines.append("  none: one rank")
    for dim in dims:
        busiest = max((r["records"] for r in gathered), key=lambda records: _bytes(records, dim))
        if dim not in checks:
            verdict = "no formula: the reported loss and the gradient norm" if dim == "loss and norm" else "no formula"
        elif checks[dim]:
            verdict = f"DIFFERS on {len(checks[dim])} ranks or groups, e.g. {checks[dim][0]}"
        elif dim in ("cp", "ep") and step_communication(model_cfg, cfg, world, 0).get(dim, 1) is None:
            verdict = "not computed for this comm type"
        else:
            verdict = f"= formula on all {world} ranks"
        lines.append(f"  {dim:<14}{sum(busiest.get(dim, Counter()).values()):>5} calls {_bytes(busiest, dim):>12,} "
                     f"bytes  {verdict}  (chapter {EXPLAINED.get(dim, '-')})")
    per_parameter = held_bytes_per_parameter(model_cfg, cfg)
    wrong = [i for i, r in enumerate(gathered) if not _holds_its_parameters(model_cfg, cfg, r, n)]
    failed += bool(wrong)
    lines.append("parameters each rank holds: " + (f"= formula on all {world} ranks" if not wrong else
                 f"DIFFERS on ranks {wrong}") + ": " +
                 ", ".join(f"stage {s} {r['params']['dense']:,} + {r['params']['experts']:,}"
                           for s, r in sorted({r['pp_rank']: r for r in gathered}.items())) +
                 (f" (ZeRO-3: a 1/{n['dp'] * n['cp']} shard of each unit, padded to whole shards; "
                  f"chapter 01 §5.5)" if cfg.zero_stage == 3 else ""))
    if cfg.zero_stage == 0:
        state = [sum(r["held"].values()) for r in gathered]
        formula = [per_parameter * sum(rank_parameters(model_cfg, cfg, r["pp_rank"]).values()) for r in gathered]
        off = [i for i in range(world) if state[i] != formula[i]]
        failed += bool(off)
        worst = max(range(world), key=lambda i: state[i])
        held = "parameters, gradients, " + ("float32 main parameters, " if cfg.bf16 or cfg.fp16 else "")
        lines.append(f"memory held from step to step ({held}AdamW's two moments): " +
                     (f"= formula on all {world} ranks" if not off else f"DIFFERS on ranks {off}") +
                     f", the most {state[worst]:,} bytes on rank {worst} (chapter 00 §3, 01 §5)")
    if n["pp"] > 1:
        v, M = cfg.num_virtual_stages_per_pipeline_rank, cfg.grad_accum_steps
        formula = bubble_fraction(cfg.pipeline_schedule, n["pp"], M, v)["idle"]
        idle = measured_idle(gathered)
        lines.append(f"pipeline bubble: (p-1)/(vm+p-1) = {formula:.3f} of a step idle for uniform stages (chapter 03 "
                     f"§4); measured in the last step, stage by stage: " +
                     ", ".join(f"{idle[s]:.2f}" for s in sorted(idle)) +
                     " (wall clock; the ranks share this machine's cores)")
    return lines, failed


def _holds_its_parameters(model_cfg: ModelConfig, cfg: TrainConfig, r: dict, n: dict) -> bool:
    """Whether a rank's parameter counts are analysis.rank_parameters': exactly, or under ZeRO-3
    (dp/fsdp.py: each unit, the embedding, every layer and the head, cut into D = dp x cp
    shards, the last padded) D times its shards less the padding, under D elements a unit."""
    formula = rank_parameters(model_cfg, cfg, r["pp_rank"])
    if cfg.zero_stage != 3:
        return r["params"] == formula
    shards, units = n["dp"] * n["cp"], model_cfg.num_layers + 2
    padding = shards * sum(r["params"].values()) - sum(formula.values())
    return 0 <= padding < shards * units


ACTIVATION_TOLERANCE = 0.10


def in_flight_formula(cfg: TrainConfig, pp_size: int, pp_rank: int) -> int:
    """Micro-batch chunks a stage holds at its peak: its schedule's warm-up forwards plus the
    steady state's one (GPipe: every micro-batch; without a pipeline: one)."""
    if pp_size == 1:
        return 1
    v, m = cfg.num_virtual_stages_per_pipeline_rank, cfg.grad_accum_steps
    return min(num_warmup_microbatches(cfg.pipeline_schedule, pp_size, pp_rank, m, v) + 1, v * m)


def activation_lines(cfg: TrainConfig, gathered: list[dict], one_device: int) -> tuple[list[str], int]:
    """The activations (what autograd saves for backward) against their formulas, and how many
    checks failed:
      - one micro-batch, summed over every rank, against dp x what one process saves for the
        same micro-batch (`one_device`, measured with the same hooks): tp and cp cut every
        sequence and pp the layers, so the sum equals dp x one device but for what no
        dimension cuts (the token ids and labels on every tp rank, RoPE's tables, per-rank
        scalars); within ACTIVATION_TOLERANCE. Under tp without sequence parallelism every tp
        rank keeps the whole [b, s, h] tensors outside attention and the MLP: the sum is
        reported, not compared;
      - the micro-batches each stage holds at its peak: `in_flight_formula`, exactly;
    and the peak bytes each rank held (micro-batches held x their bytes)."""
    world, n = len(gathered), _sizes(cfg, len(gathered))
    total = sum(r["saved"][0] for r in gathered)
    ratio = total / (n["dp"] * one_device)
    within = abs(ratio - 1) <= ACTIVATION_TOLERANCE
    copies = n["tp"] > 1 and not cfg.sequence_parallel     # each tp rank keeps the whole [b, s, h] tensors
    failed = int(not within and not copies)
    verdict = (f"not compared: without sequence parallelism every tp rank keeps its own copy of the [b, s, h] "
               f"tensors outside attention and the MLP, which SP cuts; chapter 04 §2.7" if copies else
               f"{'within' if within else 'NOT within'} {ACTIVATION_TOLERANCE:.0%}: tp and cp cut every sequence "
               f"and pp the layers, but not the token ids and labels each tp rank holds; chapter 00 §3.3, 04 §2.7")
    held = {r["pp_rank"]: r["peak_in_flight"] for r in gathered}
    off = [i for i, r in enumerate(gathered) if r["peak_in_flight"] != in_flight_formula(cfg, n["pp"], r["pp_rank"])]
    failed += bool(off)
    peak = max(range(world), key=lambda i: gathered[i]["peak_bytes"])
    return [f"activations saved for backward, one micro-batch summed over the {world} ranks: {total:,} bytes = "
            f"{ratio:.3f} x dp ({n['dp']}) x one process's {one_device:,} for the same micro-batch (measured; "
            f"{verdict})",
            ("micro-batches held at the peak, stage by stage: " + ", ".join(f"{held[k]}" for k in sorted(held)) +
             (f" = the schedule's warm-up + 1 on all {world} ranks" if not off else f" DIFFERS on ranks {off}") +
             " (chapter 03 §5)" if n["pp"] > 1 else "micro-batches held at the peak: 1 (no pipeline: each backward "
             "runs before the next forward)" + ("" if not off else f" DIFFERS on ranks {off}")) +
            f"; the most held: {gathered[peak]['peak_bytes']:,} bytes on rank {peak}"], failed


def check_against_one_device(model_cfg: ModelConfig, cfg: TrainConfig, world: int, steps: int):
    """The book's promise for this very layout: train `steps` steps of the same model in float64
    on the same ranks and the same data (the run's own first global batches), and on one
    process; compare losses, first-step gradients and final parameters (testing.compare_runs).
    A bf16, fp16 or FP8 run is checked without its rounding (float64 throughout): what is
    checked here is the layout. Each precision against one device in that precision, and where
    a layout and one device cannot agree bit for bit, is chapter 06's (its demo, tests/test_fp8.py).
    Collective over every rank; returns rank 0's EquivalenceReport (None elsewhere)."""
    model64 = replace(model_cfg, params_dtype="float64")      # the layout checked; a 16-bit run's rounding left out
    check = replace(cfg, train_iters=steps, lr_warmup_iters=0, eval_interval=0, save_dir=None, load_dir=None,
                    progress=False, bf16=False, fp16=False, loss_scale=None, grad_reduce_in_bf16=False,
                    accumulate_allreduce_grads_in_fp32=False, fp8_format=None)
    dp = _sizes(cfg, world)["dp"]
    train_ds, _ = train.build_datasets(model64, check)
    per_step = cfg.micro_batch_size * cfg.grad_accum_steps * dp                 # the global batch
    batches = [batch_for_step(train_ds, step, per_step, 0, 1) for step in range(steps)]
    out, _, layout, _ = train_layout(model64, check, dp, batches)
    if layout.rank != 0:
        return None
    reference = single_device_run(model64, batches, check, grad_accum_steps=cfg.grad_accum_steps * dp)
    return compare_runs(reference, RunRecord(out["losses"], out["grads"], out["params"]), torch.float64)


# ---------------------------------------------------------------------------------------
# the entry: python -m minimegatron.run_report [--check-steps K] <minimegatron.train's flags>
# ---------------------------------------------------------------------------------------
KEYS_OF_THIS_RANK = ("tp", "cp", "dp", "pp", "dp-cp", "embedding", "ep", "etp", "expert-dp")


def held_bytes_per_parameter(model_cfg: ModelConfig, cfg: TrainConfig) -> int:
    """Bytes a rank keeps per parameter it holds, without ZeRO (analysis.adam_bytes_per_parameter):
    4 x e in one precision; bf16 with float32 main parameters and gradients 2 + 4 + 4 + 8 = 18
    (Megatron's theoretical_memory_usage); fp16 2 + 2 + 4 + 8 = 16."""
    return adam_bytes_per_parameter(model_cfg.dtype, cfg.bf16 or cfg.fp16, cfg.main_grads_dtype)["total"]


def expectation_lines(model_cfg: ModelConfig, cfg: TrainConfig) -> list[str]:
    """What the formulas expect before anything is built: the model's parameters, total and
    active, and what one rank of each pipeline stage holds (rank_parameters) and keeps in
    memory from step to step (held_bytes_per_parameter each, without ZeRO)."""
    counts, per_parameter = count_parameters(model_cfg), held_bytes_per_parameter(model_cfg, cfg)
    lines = [f"parameters: {counts['total']:,} ({counts['active']:,} active per token); one rank holds (formula, "
             f"chapter 02 §5, 05 §1):"]
    for stage in range(cfg.pipeline_model_parallel_size):
        held = rank_parameters(model_cfg, cfg, stage)
        each = f"{per_parameter}" if cfg.bf16 or cfg.fp16 else f"4 x {model_cfg.dtype.itemsize}"
        memory = (f", {per_parameter * sum(held.values()):,} bytes held from step to step ({each} per parameter)"
                  if cfg.zero_stage == 0 else "")
        lines.append(f"  stage {stage}: {held['dense']:,} dense" +
                     (f" + {held['experts']:,} expert" if held["experts"] else "") + f" parameters{memory}")
    return lines


def _before(model_cfg: ModelConfig, cfg: TrainConfig, world: int) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("\n".join(layout_lines(model_cfg, cfg, world) + rank_grid_lines(cfg, world) +
                        expectation_lines(model_cfg, cfg)), flush=True)


def one_device_saved_bytes(model_cfg: ModelConfig, cfg: TrainConfig) -> int:
    """What one process saves for backward in one forward of the whole model on the run's first
    micro-batch (micro_batch_size whole sequences), dropout as in training (model.train())."""
    batch = batch_for_step(train.build_datasets(model_cfg, cfg)[0], 0, cfg.micro_batch_size, 0, 1)
    return measure_saved_activation_bytes(GPTModel(model_cfg), batch["tokens"], batch["labels"])


def _summary(cfg: TrainConfig, result, world: int) -> dict:
    """What this rank sends to rank 0 for the report."""
    groups = {k: get_group_ranks(k) for k in KEYS_OF_THIS_RANK} if world > 1 else {}
    record = (result.pipeline_records or [StepRecord()])[-1]       # empty when no step ran (nothing left to train)
    return {"pp_rank": get_layout().pp_rank if world > 1 else 0, "ep_group": groups.get("ep", []),
            "pp_group": groups.get("pp", []), "params": result.local_parameters, "held": result.held_bytes,
            "records": records_by_dimension(result.last_step_communication, groups),
            # the last step's forwards and backwards on the machine's clock (perf_counter is one
            # clock for every process of a machine: pp.timeline.StepRecord)
            "compute": [(i.start + record.t0, i.end + record.t0) for i in record.intervals if i.op in ("F", "B")],
            # what each micro-batch's forward saved for its backward (all of its chunks), and the
            # most held at once
            "saved": [sum(n for (m, _), n in record.saved_bytes.items() if m == mb)
                      for mb in sorted({m for m, _ in record.saved_bytes})],
            "peak_in_flight": record.peak_in_flight, "peak_bytes": record.peak_bytes}


def measured_idle(gathered: list[dict]) -> dict[int, float]:
    """{stage: the fraction of the last step it did not compute}, averaged over the pipelines:
    1 - (its forwards and backwards) / (its pipeline's makespan, first start to last end)."""
    by_stage: dict[int, list[float]] = defaultdict(list)
    for group in {tuple(r["pp_group"]) for r in gathered if r["compute"]}:
        spans = [t for m in group for t in gathered[m]["compute"]]
        makespan = max(end for _, end in spans) - min(start for start, _ in spans)
        for m in group:
            busy = sum(end - start for start, end in gathered[m]["compute"])
            by_stage[gathered[m]["pp_rank"]].append(1 - busy / makespan)
    return {stage: sum(v) / len(v) for stage, v in sorted(by_stage.items())}


def _after(model_cfg: ModelConfig, cfg: TrainConfig, result, check_steps: int) -> int:
    """On every rank: each rank's summary gathered to rank 0, which prints the report and
    draws summary.png; then the check against one device. Returns the exit status, the same
    on every rank: 1 for MISMATCH or a formula that does not hold."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    mine = _summary(cfg, result, world)
    gathered = [mine] if world == 1 else [None] * world
    if world > 1:   # torch.distributed.gather_object: plumbing for the report, in no ledger
        dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    failed = 0
    if rank == 0:
        lines, failed = report_lines(model_cfg, cfg, gathered)
        saved, wrong = activation_lines(cfg, gathered, one_device_saved_bytes(model_cfg, cfg))
        lines += saved
        failed += wrong
        n = _sizes(cfg, world)
        tokens = cfg.seq_length * cfg.micro_batch_size * cfg.grad_accum_steps * n["dp"] * len(result.losses)
        lines.append(f"throughput: {tokens / max(result.seconds, 1e-9):,.0f} tokens/s over {len(result.losses)} steps "
                     f"(this machine's wall clock; the ranks share its cores)")
        busiest = {d: max(_bytes(r["records"], d) for r in gathered)
                   for d in DIMENSION_ORDER if any(d in r["records"] for r in gathered)}
        path = Path(cfg.out_dir) / "summary.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        plot_run_summary(result.losses, result.eval_losses, world,
                         {k: n[k] for k in ("tp", "pp", "cp", "ep", "etp")}, busiest, path)
        lines.append(f"summary: {path} (the loss, the rank grid, the bytes per dimension)")
        print("\n".join(lines), flush=True)
    status = torch.tensor([failed], dtype=torch.int64)
    if check_steps:
        report = check_against_one_device(model_cfg, cfg, world, check_steps)
        if report is not None:
            print(f"the first {check_steps} step{'s' * (check_steps > 1)} of this layout in float64, against one "
                  f"process (every chapter's demo prints the same verdict):\n{report}", flush=True)
            status += int(not report.ok)
    if world > 1:                       # the same exit status on every rank
        all_reduce(status, None, op="max", tag="check")
    return int(status.item() > 0)


def main(argv=None) -> int:
    """`python -m minimegatron.run_report [--check-steps K] <minimegatron.train's flags>`:
    minimegatron.train with the report before and after (make demo)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--check-steps", type=int, default=2)
    own, rest = parser.parse_known_args(argv)                       # None: sys.argv[1:]
    if own.check_steps < 0:
        print(f"error: --check-steps {own.check_steps} must be >= 0 (0: no check against one device)")
        return 2
    return train.main(rest, before=_before,
                      after=lambda m, c, result: _after(m, c, result, own.check_steps))


if __name__ == "__main__":
    raise SystemExit(main())
