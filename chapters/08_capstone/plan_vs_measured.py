"""The planner against measured runs: what `python -m minimegatron.plan` predicts for a layout,
set against what the training loop measures when it runs that layout on this machine.

    python chapters/08_capstone/plan_vs_measured.py        # spawns 4 ranks: seven layouts, under a minute

Each layout trains a small LLaMA-style model (GPT-2-style for two, a mixture of experts for one) for 2 steps
with the training command's own `train()` in one world of 4 ranks. Each rank reports (run_report's
summary, what `make demo` prints) what its last step handed to the collectives per dimension,
the bytes it kept from step to step, and the activations it held at its peak. The planner
knows none of that; it gets the model and the layout, as on a real cluster:

  bytes    plan.stage_messages for the rank's stage against the comm ledger's records, per
           dimension, on every rank: equal to the byte (how many messages may differ: the run
           cuts a reduction into buckets, the planner counts one). The dispatcher's
           routing-dependent messages (moe-combine, the etp gather and reduce-scatter of the
           received rows, ...) the planner takes as balanced routing makes them, so they are
           compared summed over the ranks, where routing cancels (every row one rank sends,
           one rank receives): equal. But for the etp all-gathers and reduce-scatters of the
           received rows, which pad each rank's rows to the largest of its etp group (gloo
           takes equal sizes only; the ledger counts the padded shard): there the balanced
           count is a lower bound, and the check allows 10% more. The loss's and gradient
           norm's scalars it leaves out;
  memory   plan.rank_memory for the rank's stage: the state (parameters, gradients, the
           float32 main copy, AdamW's moments) and the activations at the peak, each within 10%
           of what the rank held (analysis.memory.held_state_bytes: the tensors' own sizes; the saved-
           tensor hooks of pp.timeline.StepRecord).

It ends with a line starting AGREE (exit 0) or DISAGREE (exit 1).
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter

from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.launch import spawn
from minimegatron.parallelize import validate_layout
from minimegatron.plan.rank_memory import rank_memory
from minimegatron.plan.step_time import stage_messages
from minimegatron.run_report import DIMENSION_ORDER

from demo import layout                                   # chapters/08_capstone/demo.py: "tp=2 sp dp=2" -> fields

MODEL = ModelConfig.llama(hidden_size=64, num_layers=4, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=128,
                          vocab_size=257, max_position_embeddings=64)
MOE = dataclasses.replace(MODEL, num_experts=4, moe_router_topk=2)
GPT2 = ModelConfig.gpt2(hidden_size=64, num_layers=4, num_attention_heads=8, vocab_size=257, max_position_embeddings=64)
BASE = TrainConfig(seq_length=64, micro_batch_size=2, grad_accum_steps=4, train_iters=2, lr_warmup_iters=0,
                   eval_interval=0, progress=False, out_dir="runs/plan_vs_measured")
# every layout has 4 ranks, dp = 4 / (tp cp pp); the global batch stays 8 sequences
LAYOUTS = [("tp=2 sp dp=2 zero=1 bf16", MODEL), ("pp=2 v=2 cp=2", MODEL), ("pp=2 tp=2 sp", MODEL),
           ("tp=2 dp=2 zero=3", MODEL), ("dp=4 zero=3", GPT2), ("cp=2 dp=2 zero=2", GPT2),
           ("ep=2 tp=2 sp dp=2 zero=1", MOE)]
TOLERANCE = 0.10
ROUTING = ("moe-dispatch", "moe-combine", "moe-dispatch-bwd", "moe-combine-bwd", "moe-etp", "moe-etp-bwd")
UNPLANNED = ("loss and norm", "other")


def train_config(spec: str) -> TrainConfig:
    """'tp=2 sp dp=2 zero=1 bf16' -> that layout of 4 ranks (dp = 4 / (tp cp pp)), as the demo reads it."""
    return dataclasses.replace(BASE, **layout(spec))


def model_config(spec: str, model: ModelConfig) -> ModelConfig:
    return dataclasses.replace(model, params_dtype="bfloat16") if "bf16" in spec.split() else model


def measure_in_turn(runs: list[tuple[ModelConfig, TrainConfig]]) -> list[dict]:
    """On each rank: train each (model, layout) and return run_report's summary of the last step."""
    from minimegatron.run_report import _summary
    from minimegatron.train import train
    return [_summary(cfg, train(model, cfg), 4) for model, cfg in runs]


def _bytes(counter: Counter) -> int:
    return sum(n * calls for (_, _, n), calls in counter.items())


def compare(model: ModelConfig, cfg: TrainConfig, ranks: list[dict]) -> tuple[list[str], int, dict]:
    """The report's lines for one layout, how many of its checks failed, and their numbers:
    {"bytes": {dim: equal on every rank}, "etp_padding_pct", "off_pct": {"state", "activations"},
    "mean_over_ranks": whether the activations' is the mean over the ranks}."""
    failed, routed, planned_routed = 0, Counter(), Counter()
    found = {"bytes": {}, "off_pct": {}, "etp_padding_pct": None, "mean_over_ranks": False}
    dims: dict[str, list[tuple[int, int, int, int]]] = {}     # dim -> per rank (bytes, calls) measured, planned
    worst: dict[str, list] = {}
    for got in ranks:
        planned = stage_messages(model, cfg, 4, got["pp_rank"])
        for dim in set(planned) | set(got["records"]) - set(UNPLANNED):
            want = Counter({k: c for k, c in planned.get(dim, Counter()).items() if k[1] not in ROUTING})
            mine = Counter({k: c for k, c in got["records"].get(dim, Counter()).items()
                            if k[1].removeprefix("recompute ") not in ROUTING})
            routed[dim] += _bytes(got["records"].get(dim, Counter())) - _bytes(mine)
            planned_routed[dim] += _bytes(planned.get(dim, Counter())) - _bytes(want)
            dims.setdefault(dim, []).append((_bytes(mine), sum(mine.values()), _bytes(want), sum(want.values())))
        memory = rank_memory(model, cfg, 4, got["pp_rank"])
        # a mixture: what one rank's experts save depends on its routing; the mean over the ranks and
        # micro-batches does not (every row a rank sends, one rank receives), nor does the planner's
        activations = sum(got["saved"]) // max(1, len(got["saved"])) if model.num_experts else got["peak_bytes"]
        measured = {"state": sum(got["held"].values()), "activations": activations}
        planned = {"state": memory["params"] + memory["grads"] + memory["optimizer"],
                   "activations": memory["activations"]}
        for key in measured:
            if measured[key]:
                worst.setdefault(key, []).append((measured[key], planned[key]))
    lines = []
    for dim in sorted(dims, key=lambda d: DIMENSION_ORDER.index(d) if d in DIMENSION_ORDER else 99):
        pairs = dims[dim]
        same = all(a == c for a, _, c, _ in pairs)
        failed += not same
        found["bytes"][dim] = same
        busiest = max(pairs)
        lines.append(f"  {dim:<11} measured {busiest[0]:>10,} bytes in {busiest[1]:>3} calls, planned {busiest[2]:>10,} "
                     f"in {busiest[3]:>3}: {'= on all 4 ranks' if same else 'DIFFERS'}")
        if routed[dim] or planned_routed[dim]:
            got, want = routed[dim], planned_routed[dim]
            if dim == "etp":      # gloo gathers equal sizes: each rank's rows padded to its etp group's largest
                ok = want <= got <= (1 + TOLERANCE) * want
                found["etp_padding_pct"] = round(100 * (got / want - 1), 1)
                verdict = (f"{got / want - 1:.1%} more: uneven rows are padded to the etp group's largest "
                           f"(comm.all_gather, reduce-scatter alike), {'within' if ok else 'NOT within'} "
                           f"{TOLERANCE:.0%}")
            else:
                ok, verdict = got == want, "equal" if got == want else "DIFFERS"
            failed += not ok
            lines.append(f"  {'':<11} routing-dependent: {got:>10,} bytes summed over the 4 ranks, planned "
                         f"{want:>10,}: {verdict}")
    for key in ("state", "activations"):
        if key not in worst:
            failed += 1
            lines.append(f"  {key:<11} NOT measured: no rank recorded any")
            continue
        pairs = worst[key]
        if model.num_experts and key == "activations":          # the mean over the ranks (above)
            pairs = [(sum(a for a, _ in pairs) // len(pairs), sum(b for _, b in pairs) // len(pairs))]
        off, measured, planned = max((abs(b / a - 1), a, b) for a, b in pairs)
        ok = off <= TOLERANCE
        failed += not ok
        found["off_pct"][key] = round(100 * off, 1)
        found["mean_over_ranks"] |= len(pairs) == 1 and key == "activations"
        where = "the mean over the ranks" if len(pairs) == 1 else "the worst rank"
        lines.append(f"  {key:<11} measured {measured:>10,} bytes, planned {planned:>10,}: {off:.1%} off at "
                     f"{where}, {'within' if ok else 'NOT within'} {TOLERANCE:.0%}")
    return lines, failed, found


@dataclasses.dataclass
class PlanVsMeasured:
    exit_code: int = 0
    layouts: dict = dataclasses.field(default_factory=dict)      # spec -> compare()'s numbers, "failed"


def main(argv=None) -> PlanVsMeasured:
    runs = [(model_config(spec, model), train_config(spec)) for spec, model in LAYOUTS]
    for model, cfg in runs:                               # a layout that cannot run: said before spawning
        validate_layout(model, cfg, 4)
    print(f"The planner (minimegatron.plan) against {len(runs)} layouts run here: LLaMA-style, GPT-2-style and "
          f"MoE models of hidden {MODEL.hidden_size}, {MODEL.num_layers} layers, sequences of {BASE.seq_length}, 8 a "
          f"step; 4 ranks, 2 steps each (the last one measured)", flush=True)
    gathered = spawn(measure_in_turn, 4, runs, timeout=900)
    failed, got = 0, PlanVsMeasured()
    for i, ((spec, _), (model, cfg)) in enumerate(zip(LAYOUTS, runs)):
        lines, bad, found = compare(model, cfg, [rank[i] for rank in gathered])
        failed += bad
        got.layouts[spec] = {**found, "failed": bad}
        kind = "MoE: 4 experts, top-2" if model.num_experts else "GPT-2" if model.position_embedding_type != "rope" else "LLaMA"
        print(f"{spec} ({kind}):")
        print("\n".join(lines))
    print(("AGREE: every planned byte was measured (the etp gathers' padding aside), and memory within "
           f"{TOLERANCE:.0%}") if not failed else f"DISAGREE: {failed} checks failed")
    got.exit_code = 1 if failed else 0
    return got


if __name__ == "__main__":
    sys.exit(main().exit_code)
