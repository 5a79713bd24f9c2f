"""The figures of chapter 05 and the numbers the chapter quotes.

    python chapters/05_ep_moe/make_figures.py       # about a minute on 2 cores; writes figures/*.png

  expert_grid.png    16 ranks as the 5D demo lays them out (tp 2, cp 2, pp 2, dp 2; experts: etp 2,
                     ep 2, expert-dp 2): which ranks share a dense gradient ("dp-cp"), which an
                     expert's ("expert-dp"), and the ep and pp groups (parallel_state.rank_groups)
  dispatchers.png    bytes one rank receives per MoE layer and micro-batch, all-to-all against
                     all-gather, ep = 2 .. 64, from the demo's dispatcher_volumes (T = 4096 tokens,
                     h = 4096, 64 experts, top-2, bf16), checked against the closed forms
                     2 T k h e (ep - 1)/ep and 2 (ep - 1) T h e + (ep - 1) T E (e + 1)
  load_balance.png   the demo's load_balance: the same tiny GPT-MoE trained 60 steps on the text of
                     chapters 00-02 as the frozen corpus holds it (bytes; editing the book does not
                     move the numbers) with no balancing, the auxiliary loss, sigmoid scores, sigmoid
                     scores with the expert bias (measured on one device); it prints the demo's
                     [4/4] lines and what the figure shows beyond them (load_balance_details)
It stops with an error (exit 1) if a number differs from its closed form.

RUNS and measure() at the end are what `make numbers CH=05` (python -m booktools.measured record
05) reruns and records in measured.json: this script, the demo's default run, the runs of the
README's section 8 and the 5D run under torchrun; the numbers the README and the notebook's
markdown quote are checked against it by tests/test_measured.py.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from booktools.demo import import_chapter
from booktools.measured import RoundOff, claim
from minimegatron.analysis import count_parameters, training_flops
from minimegatron.config import ModelConfig
from minimegatron.moe import aux_loss, expert_capacity, topk_routing
from minimegatron.parallel_state import rank_groups
from minimegatron.viz import colour, draw_rank_grid, finish_figure, new_figure

ch05 = import_chapter("05")        # chapters/05_ep_moe/demo.py: the formulas and the runs

OUT = Path(__file__).resolve().parent / "figures"
T, H, E, K, BF16 = 4096, 4096, 64, 2, 2
EP_SIZES = (2, 4, 8, 16, 32, 64)


def fail(message: str) -> None:
    print(f"MISMATCH: {message}", file=sys.stderr)
    sys.exit(1)


# ---------------------------------------------------------------------------------------
# the figures (drawn from the records the code keeps; the notebook and the tests draw them too)
# ---------------------------------------------------------------------------------------
def plot_moe_load_balance(results: dict[str, dict], path: str | os.PathLike | None = None, title: str = ""):
    """Three panels of a mixture's load balance (chapter 05's demo, load_balance): the largest
    expert's tokens over the mean after each training step, per balancing setting (the worst
    layer); the share of the routed pairs each expert got after the last step, in each setting's
    worst layer then (named in the legend), so that the bars show the collapse the left panel
    shows; the fraction of routed pairs a capacity factor drops. results: {setting:
    {"imbalance": [...], "final": [...], "final_layer": i (optional), "dropped": {factor:
    fraction}}}. Returns the Figure (saved to `path` if given)."""
    fig = new_figure(figsize=(13.5, 3.6))
    ax_steps, ax_final, ax_drop = fig.subplots(1, 3)
    n = len(results)
    for i, (name, r) in enumerate(results.items()):
        line = colour(i, max(n, 3))
        ax_steps.plot(range(1, len(r["imbalance"]) + 1), r["imbalance"], color=line, label=name)
        experts = len(r["final"])
        width = 0.8 / n
        layer = f" (layer {r['final_layer']})" if "final_layer" in r else ""
        ax_final.bar([e + (i - (n - 1) / 2) * width for e in range(experts)], r["final"], width=width,
                     color=line, label=name + layer)
        factors = sorted(r["dropped"])
        ax_drop.plot(factors, [r["dropped"][f] for f in factors], marker="o", color=line, label=name)
    ax_steps.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    ax_steps.set(xlabel="training step", ylabel="max / mean tokens per expert",
                 title="imbalance (held-out batch, worst layer)")
    experts = len(next(iter(results.values()))["final"])
    ax_final.axhline(1 / experts, color="black", linestyle="--", linewidth=0.8)
    ax_final.set(xlabel="expert", ylabel="share of routed pairs", title="after the last step (worst layer)")
    ax_final.set_xticks(range(experts))
    ax_final.legend(fontsize=7)
    ax_drop.set(xlabel="capacity factor", ylabel="routed pairs dropped", title="dropped at capacity")
    ax_drop.yaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    ax_steps.legend(fontsize=7)
    return finish_figure(fig, path, title)


def plot_dispatcher_volumes(rows: dict[str, dict[int, float]], path: str | os.PathLike | None = None,
                            title: str = ""):
    """Bytes one rank receives per MoE layer and micro-batch against the expert-parallel size,
    one line per dispatcher (rows: {dispatcher: {ep: bytes}}), log-scaled x. Returns the Figure."""
    fig = new_figure(figsize=(5.4, 3.6))
    ax = fig.subplots()
    for i, (name, by_ep) in enumerate(rows.items()):
        sizes = sorted(by_ep)
        ax.plot(sizes, [by_ep[ep] / 2**20 for ep in sizes], marker="o", color=colour(i, 3), label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(ep) for ep in sizes])
    ax.set(xlabel="expert-parallel size ep", ylabel="MiB received per rank")
    ax.legend(fontsize=8)
    return finish_figure(fig, path, title)


def curve_extremes(r: dict) -> tuple[int, int]:
    """The steps (from 0) where one setting's imbalance curve was lowest, and highest after step 1."""
    curve = r["imbalance"]
    return min(range(len(curve)), key=curve.__getitem__), max(range(1, len(curve)), key=curve.__getitem__)


def load_balance_details(results: dict[str, dict]) -> list[str]:
    """What Figure 5.1 shows beyond the demo's [4/4] lines, one line per setting: where its
    imbalance curve was lowest and highest after step 1, and the middle panel's bars (the worst
    layer after the last step, and its busiest expert's share of the routed pairs)."""
    lines = []
    for name, r in results.items():
        curve, (low, high) = r["imbalance"], curve_extremes(r)
        lines.append(f"      {name:22s} lowest {curve[low]:.2f} at step {low + 1}, highest {curve[high]:.2f} at step "
                     f"{high + 1}; after the last step, layer {r['final_layer']}: largest share {max(r['final']):.1%}")
    return lines


# ---------------------------------------------------------------------------------------
# the numbers the chapter quotes (booktools/measured.py: `make numbers CH=05` reruns RUNS,
# records their printouts and measure()'s values in chapters/05_ep_moe/measured.json, and the
# README's and the notebook's <!--m:key--> and <!--run:id--> markers are checked against it)
# ---------------------------------------------------------------------------------------
DEMO = "python chapters/05_ep_moe/demo.py"
RUNS = {
    "figures": "python chapters/05_ep_moe/make_figures.py",                     # Figures 5.1-5.3
    "demo": DEMO,                                                               # §1, §2.6, §4.4, §6.6, §8
    # §8's table (and §4.4's, §6.6's rows): spawned worlds of tp x cp x pp x dp ranks
    "ep4": f"{DEMO} --quick --ep 4",
    "ep4-allgather": f"{DEMO} --quick --ep 4 --dispatcher allgather",
    "ep3": f"{DEMO} --quick --ep 3 --num-experts 6",
    "capacity": f"{DEMO} --quick --ep 2 --dp 4 --capacity-factor 1.0",
    "expert-bias": f"{DEMO} --quick --ep 2 --expert-bias",
    "tp2-etp1-shared": f"{DEMO} --quick --tp 2 --sp --ep 2 --etp 1 --shared-expert 32",
    "tp2-etp2": f"{DEMO} --quick --tp 2 --sp --ep 2 --etp 2",
    "tp2-etp2-allgather": f"{DEMO} --quick --tp 2 --sp --ep 2 --etp 2 --dispatcher allgather",
    "cp2": f"{DEMO} --quick --cp 2 --ep 2 --expert-bias",
    # §7.2: 5D on 16 ranks under torchrun (about half a minute on 2 cores)
    "5d": "torchrun --standalone --nproc_per_node=16 chapters/05_ep_moe/demo.py --quick --tp 2 --sp --cp 2 --ep 2 "
          "--pp 2 --dp 2",
    # the book's main job, `make demo` with its defaults (the front page, README.md, quotes its
    # report; tests/test_run_report.py checks this is the command make demo runs): 16 ranks,
    # 200 steps and the check against one device (its wall clock: benchmarks/README.md)
    "make-demo": "torchrun --standalone --nproc_per_node=16 -m minimegatron.run_report --check-steps 2 --preset demo "
                 "--num-layers 4 --train-iters 200 --tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 "
                 "--num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --expert-model-parallel-size 2 "
                 "--pipeline-model-parallel-size 2 --grad-accum-steps 4 --micro-batch-size 1 --out-dir runs/demo",
}
TEXTS = ["README.md"]          # besides this chapter's README and notebook: the front page quotes make-demo


GB, MiB = 1e9, 2**20
MIXTRAL_SHAPES = dict(hidden_size=4096, num_layers=32, num_attention_heads=32, num_query_groups=8,
                      ffn_hidden_size=14336, vocab_size=32000, max_position_embeddings=32768)


def verdict(r: dict) -> dict[str, float]:
    """A demo run's rank count and its differences from one device (round-off: machine dependent)."""
    return {"ranks": r["ranks"], **{f"max_{k}": RoundOff(r[k]) for k in ("dloss", "dgrad", "dparam")}}


def dispatch_line(r: dict, stage: int = 0) -> tuple[int, int]:
    """[2/4]'s (routing-independent messages, their bytes) of one stage, per rank and step."""
    return r["dispatch"][stage]["messages"], r["dispatch"][stage]["bytes"]


def balance_lines(balance: dict) -> dict[str, dict]:
    """[4/4]'s line of each setting (ch05.load_balance_lines), at the precision it prints them:
    step 1 and last, and the percent dropped at each capacity factor."""
    return {name: {"first": round(r["imbalance"][0], 2), "last": round(r["imbalance"][-1], 2),
                   "dropped": {float(f): round(100 * x) for f, x in r["dropped"].items()}}
            for name, r in balance.items()}


def balance_details(balance: dict) -> dict[str, dict]:
    """load_balance_details' line of each setting, at the precision it prints them."""
    rows = {}
    for name, r in balance.items():
        low, high = curve_extremes(r)
        rows[name] = {"lowest": round(r["imbalance"][low], 2), "lowest_step": low + 1,
                      "highest": round(r["imbalance"][high], 2), "highest_step": high + 1,
                      "layer": r["final_layer"], "share": round(100 * max(r["final"]), 1)}
    return rows


def dispatch_message_bytes(run) -> int:
    """T k h e: the one "moe-dispatch" all-to-all of a micro-batch and MoE layer (expected_dispatch)."""
    sizes = {size for (_, tag, size) in ch05.expected_dispatch(run) if tag == "moe-dispatch"}
    assert len(sizes) == 1, sizes
    return sizes.pop()


def measure(outputs: dict[str, list[str]], results: dict[str, dict | None]) -> dict[str, float]:
    """Every number of the README and the notebook's markdown that the runs measure or the code
    computes, by marker key; claim() checks the sentences that say in words what the runs show."""
    v = {}
    demo = results["demo"]

    # §1 parameters without FLOPs: Mistral 7B's and Mixtral 8x7B's shapes (and README Q1, notebook §1)
    dense, moe = ModelConfig.llama(**MIXTRAL_SHAPES), ModelConfig.llama(**MIXTRAL_SHAPES, num_experts=8,
                                                                         moe_router_topk=2)
    n_dense, n_moe = count_parameters(dense), count_parameters(moe)
    flops_dense, flops_moe = (training_flops(c, 1, 4096)["total"] / 4096 for c in (dense, moe))
    experts = moe.num_layers * moe.num_experts * n_moe["moe"]["expert"]
    v |= {"mistral_params_b": n_dense["total"] / 1e9, "mistral_active_b": n_dense["active"] / 1e9,
          "mistral_flops_per_token_g": flops_dense / 1e9, "mixtral_params_b": n_moe["total"] / 1e9,
          "mixtral_active_b": n_moe["active"] / 1e9, "mixtral_flops_per_token_g": flops_moe / 1e9,
          "mixtral_params_ratio": n_moe["total"] / n_dense["total"], "mixtral_flops_ratio": flops_moe / flops_dense,
          "mixtral_expert_m": n_moe["moe"]["expert"] / 1e6, "mixtral_experts_b": experts / 1e9,
          "mixtral_shared_b": (n_moe["total"] - experts) / 1e9, "q1_eight_mistrals_b": 8 * n_dense["total"] / 1e9,
          "nb_mixtral_active_pct": 100 * n_moe["active"] / n_moe["total"]}
    # the [3/4] line at --quick: only the FLOPs per token move with s
    quick = results["ep4"]["accounting"]
    v["quick_flops_per_token"] = quick["flops"]
    claim(all(demo["accounting"][k] == quick[k] for k in ("total", "active", "mlp", "megatron_mlp", "router")),
          "with --quick the other numbers of [3/4] are unchanged")

    # §2.6 load balance: the demo's [4/4] lines and Figure 5.1 (this script's runs: the same digits)
    lb, fig = balance_lines(demo["balance"]), balance_details(results["figures"]["balance"])
    claim(lb == balance_lines(results["figures"]["balance"]), "Figure 5.1: the same runs as the printout")
    none, aux, sigmoid, bias = (lb[name] for name in ch05.BALANCING)
    v |= {"lb_none_last": none["last"], "lb_sigmoid_last": sigmoid["last"], "lb_bias_last": bias["last"],
          "lb_aux_first": aux["first"], "lb_aux_last": aux["last"],
          **{f"lb_{key}_drop125": lb[name]["dropped"][1.25] for key, name in zip(("none", "aux", "sigmoid", "bias"),
                                                                                ch05.BALANCING)},
          "fig_aux_lowest": fig["aux loss 1e-2"]["lowest"], "fig_aux_lowest_step": fig["aux loss 1e-2"]["lowest_step"],
          "fig_none_largest_share_pct": fig["no balancing"]["share"]}
    claim(all(r["highest"] >= 3.95 and r["highest_step"] <= 10 for r in fig.values()),
          "within the first ten steps each setting's worse layer comes close to 4")
    claim(min(none["last"], sigmoid["last"]) >= 3.9, "without balancing both routers stay there (close to 4)")
    claim(bias["last"] == min(r["last"] for r in lb.values()), "the expert bias ends the most balanced of the four")
    claim(fig["aux loss 1e-2"]["lowest"] <= aux["last"] < min(none["last"], sigmoid["last"]) - 1.0
          and aux["last"] > bias["last"],
          "the aux loss ends near its lowest point, far from the collapse, less balanced than the expert bias")
    claim(max(bias["dropped"][1.25], aux["dropped"][1.25]) < min(none["dropped"][1.25], sigmoid["dropped"][1.25]),
          "at capacity factor 1.25 the balanced runs drop fewer pairs than the unbalanced ones")
    claim(fig["no balancing"]["share"] >= 49.5, "without balancing one expert gets half of the pairs")

    # §4.4 the dispatcher's messages: the demo (T = 128), --quick at ep 2 and 4 (T = 64), the all-gather
    model = ch05.tiny_moe()
    v["demo_tkhe"] = dispatch_message_bytes(ch05.make_run(model, ep=2, dp=2, seq=64, steps=3))
    v["quick_tkhe"] = dispatch_message_bytes(ch05.make_run(model, ep=2, dp=2, seq=32))
    v["demo_dispatch_messages"], v["demo_dispatch_bytes"] = dispatch_line(demo)
    v["quick_dispatch_messages"], v["quick_dispatch_bytes"] = dispatch_line(results["ep4"])
    claim(dispatch_line(results["expert-bias"]) == dispatch_line(results["ep4"]),
          "--quick: the same routing-independent messages at ep = 2 as at ep = 4")
    v["allgather_messages"], v["allgather_bytes"] = dispatch_line(results["ep4-allgather"])

    # §6.6 memory per rank (line [3/4] of three runs of §8)
    v["tiny_expert_elements"] = count_parameters(model)["moe"]["expert"]
    for key, run_id in (("demo", "demo"), ("ep4", "ep4"), ("tp2_etp2", "tp2-etp2")):
        v |= {f"mem_{key}_{name}": results[run_id]["memory"][0][name] for name in ("experts", "adam", "dense")}

    # §7.1 the 16 ranks' groups, as the table and the text (and README Q6) give them
    groups = rank_groups(16, tp=2, pp=2, cp=2, ep=2, etp=2)
    stage0 = {key: [g for g in gs if max(g) < 8] for key, gs in groups.items()}
    claim(stage0["tp"] == stage0["etp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
          and stage0["cp"] == stage0["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
          and stage0["dp"] == stage0["expert-dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
          and stage0["dp-cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
          and stage0["tp-cp"] == stage0["etp-ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
          and stage0["tp-dp-cp"] == [list(range(8))] and groups["pp"][:2] == [[0, 8], [1, 9]],
          "§7.1's table of the 16 ranks' groups")
    claim(next(g for g in rank_groups(16, tp=2, pp=2, cp=2, ep=4, etp=1)["ep"] if 5 in g) == [4, 5, 6, 7],
          "Q6: rank 5's ep group is [4, 5, 6, 7]")

    # §7.2 the 5D run under torchrun (its wall time is the machine's, recorded like the rest)
    fived = results["5d"]
    run5d = ch05.make_run(ch05.tiny_moe(num_layers=4), tp=2, sp=True, cp=2, pp=2, dp=2, ep=2)
    v |= {"fived_train_s": results["5d"]["seconds"], "fived_tokens_per_rank": fived["tokens_per_rank"],
          "fived_tkhe": dispatch_message_bytes(run5d), "fived_experts_per_rank": fived["memory"][0]["experts"]}
    v["fived_dispatch_messages"], v["fived_dispatch_bytes"] = dispatch_line(fived)
    v["fived_dispatch_bytes_per_layer_mb"] = v["fived_dispatch_bytes"] / (2 * run5d.train.grad_accum_steps)
    claim(dispatch_line(fived, 1) == dispatch_line(fived, 0), "both stages: the same messages")

    # §8 every layout against one device
    for run_id in ("demo", "ep4", "ep4-allgather", "ep3", "capacity", "expert-bias", "tp2-etp1-shared", "tp2-etp2",
                   "tp2-etp2-allgather", "cp2", "5d"):
        key = run_id.replace("-", "_").replace("5d", "fived")
        v |= {f"{key}_{name}": x for name, x in verdict(results[run_id]).items()}
    capacity = ch05.make_run(ch05.tiny_moe(), ep=2, dp=4)                    # the same run, dropless
    dispatched = sum(n * size for (_, tag, size), n in ch05.expected_dispatch(capacity).items() if tag == "moe-dispatch")
    v["capacity_dropless_bytes"] = capacity.world * dispatched
    v["capacity_dispatched_bytes"] = results["capacity"]["dispatch"][0]["dispatched"]
    v["capacity_dropped_pct"] = 100 * (1 - v["capacity_dispatched_bytes"] / v["capacity_dropless_bytes"])

    # README's questions: Q3 (the aux loss by hand), Q7 (the dispatchers at ep = 64, k = 8), Q10 (capacity)
    scores = torch.tensor([0.7, 0.1, 0.1, 0.1], dtype=torch.float64).log().expand(8, 4)   # softmax = (0.7, 0.1, ...)
    to_expert0 = torch.zeros(8, 4, dtype=torch.bool)
    to_expert0[:, 0] = True
    balanced = torch.eye(4, dtype=torch.bool).repeat(2, 1)                                 # 2 tokens per expert
    v |= {"q3_aux": aux_loss(scores, to_expert0, 1, 0.01).item(),
          "q3_aux_balanced": aux_loss(torch.zeros(8, 4, dtype=torch.float64), balanced, 1, 0.01).item()}
    q7 = ch05.dispatcher_volumes(4096, 4096, 64, 8, 64, 2)
    v |= {"q7_alltoall_mb": q7["alltoall"] / 1e6,
          "q7_allgather_rows_gb": (q7["allgather"] - 63 * 4096 * 64 * 3) / GB,          # less the weights and maps
          "q10_capacity": expert_capacity(1024, 8, 2, 1.0)}

    # the notebook's markdown: §4's ledger by hand, §6's 20-step runs, its questions Q1 and Q3
    balance20 = ch05.load_balance(steps=20)                                # the notebook's own call
    for key, name in (("aux", "aux loss 1e-2"), ("bias", "sigmoid + expert bias")):
        curve = balance20[name]["imbalance"]
        v |= {f"nb_{key}_first": curve[0], f"nb_{key}_last": curve[-1]}
        claim(max(curve) >= 3.95 and curve[-1] < max(curve) - 0.5,
              f"notebook §6: the {name} run collapses first, then has begun to come back by step 20")
    v["nb_balanced_highest"] = min(max(balance20[name]["imbalance"])
                                   for name in ("aux loss 1e-2", "sigmoid + expert bias"))
    after, _ = topk_routing(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), 2)
    before, _ = topk_routing(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), 2, pre_softmax=True)
    v |= {"nb_q1_after_1": after[0, 1].item(), "nb_q1_after_2": after[0, 2].item(),
          "nb_q1_before_1": before[0, 1].item(), "nb_q1_before_2": before[0, 2].item(),
          "nb_q1_before_sum": before.sum().item()}
    q3 = ch05.dispatcher_volumes(4096, 4096, 64, 2, 8, 2)
    v |= {"nb_q3_alltoall_mib": q3["alltoall"] / MiB,
          "nb_q3_allgather_rows_mib": (q3["allgather"] - 7 * 4096 * 64 * 3) / MiB}
    return {key: x if isinstance(x, RoundOff) else int(x) if float(x).is_integer() else float(x)
            for key, x in v.items()}




@dataclass
class Figures:
    """What main printed that measure() reads: load_balance's results (Figure 5.1's runs)."""
    exit_code: int = 0
    balance: dict = field(default_factory=dict)


def main(argv=None) -> Figures:
    torch.set_num_threads(1)
    OUT.mkdir(exist_ok=True)
    draw_rank_grid(16, tp=2, cp=2, pp=2, ep=2, keys=("dp-cp", "expert-dp", "ep", "pp"),
                   path=OUT / "expert_grid.png")

    rows = {"all-to-all": {}, "all-gather": {}}
    for ep in EP_SIZES:
        v = ch05.dispatcher_volumes(T, H, E, K, ep, BF16)
        if v["alltoall"] != 2 * T * K * H * BF16 * (ep - 1) / ep or \
                v["allgather"] != 2 * (ep - 1) * T * H * BF16 + (ep - 1) * T * E * (BF16 + 1):
            fail(f"dispatcher_volumes at ep={ep} differs from the closed forms")
        rows["all-to-all"][ep], rows["all-gather"][ep] = v["alltoall"], v["allgather"]
        print(f"ep={ep:3d}: all-to-all {v['alltoall'] / 2**20:8.1f} MiB, all-gather {v['allgather'] / 2**20:8.1f} MiB "
              f"({v['allgather'] / v['alltoall']:.1f}x)")
    plot_dispatcher_volumes(rows, OUT / "dispatchers.png",    # two lines: one is wider than the figure
                            title=f"received per rank, MoE layer and micro-batch\n"
                                  f"T={T}, h={H}, E={E}, top-{K}, bf16, uniform routing")

    results = ch05.load_balance(steps=60)
    print("\n".join(ch05.load_balance_lines(results)))
    print("\n".join(load_balance_details(results)))
    plot_moe_load_balance(results, OUT / "load_balance.png",
                          title="a tiny GPT-MoE (8 experts, top-2) trained 60 steps on chapters 00-02's text, one device")
    print(f"wrote {', '.join(p.name for p in sorted(OUT.glob('*.png')))} in {OUT}")
    return Figures(balance=results)


if __name__ == "__main__":
    sys.exit(main().exit_code)
