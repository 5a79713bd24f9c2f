"""The figures of chapter 00, computed and measured with minimegatron.analysis.

    python chapters/00_single_device/make_figures.py        # writes figures/*.png

  memory_breakdown.png   where training memory goes: the chapter's demo model (parameters,
                         gradients and Adam states from the formula, activations MEASURED
                         with saved-tensor hooks next to the formula) and a LLaMA-2-7B-shaped
                         model in bf16 with fp32 master weights (formula), against one 80 GB GPU
  flops_breakdown.png    where the FLOPs of a training step go, by matmul, as the sequence
                         grows (7B shapes): the s^2 attention terms overtake the MLP only
                         at long context

Runs in a few seconds on a CPU; the only model it builds is the demo-sized one.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from minimegatron.analysis import (GiB, activation_memory, count_parameters, does_it_fit,  # noqa: E402
                                   flops_per_token_6n, korthikanti_activation_memory,
                                   measure_saved_activation_bytes, narayanan2021_flops_per_iteration,
                                   real_model_config, training_flops, training_memory)
from minimegatron.config import ModelConfig, TrainConfig  # noqa: E402
from minimegatron.model import GPTModel  # noqa: E402
from minimegatron.arguments import PRESETS  # noqa: E402
from minimegatron.optim import learning_rate  # noqa: E402
from minimegatron.viz import new_figure  # noqa: E402

OUT = Path(__file__).resolve().parent / "figures"

# The demo preset (python -m minimegatron.train --preset demo): LLaMA style, float32.
DEMO_MODEL, DEMO_TRAIN = PRESETS["demo"]
# Measured with the written-out attention (exercise 0.1), as the chapter's section 3.3 counts it;
# the default fused kernel ("sdpa") saves less (no s x s matrix, k and v at g heads).
DEMO = ModelConfig.llama(**DEMO_MODEL, attention_backend="naive")
DEMO_B, DEMO_S = DEMO_TRAIN["micro_batch_size"], DEMO_TRAIN["seq_length"]

# LLaMA-2 7B's shapes (minimegatron.analysis.REAL_MODELS: h 4096, L 32, a 32, f 11008,
# V 32000, context 4096), bfloat16. Only described, never allocated.
SEVEN_B, SEVEN_B_S = real_model_config("llama2-7b")
SEVEN_B_B = 1
GPU_BYTES = 80 * GiB     # one "80 GB" A100 or H100 (the package counts GPU memory in GiB)

COLORS = {"parameters": "#4C72B0", "gradients": "#55A868", "fp32 master weights": "#8172B2",
          "Adam exp_avg (m)": "#C44E52", "Adam exp_avg_sq (v)": "#DD8452", "activations": "#937860"}


def demo_memory() -> tuple[dict[str, float], int, int]:
    """Bytes of the demo model's training state; activations measured and from the formula."""
    mem = training_memory(DEMO)                                   # float32 AdamW, 16 B / param
    model = GPTModel(DEMO)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, DEMO.vocab_size, (DEMO_B, DEMO_S), generator=g)
    labels = torch.randint(0, DEMO.vocab_size, (DEMO_B, DEMO_S), generator=g)
    measured = measure_saved_activation_bytes(model, tokens, labels)
    formula = activation_memory(DEMO, DEMO_B, DEMO_S)["total"]
    parts = {"parameters": mem["params"], "gradients": mem["grads"], "Adam exp_avg (m)": mem["exp_avg"],
             "Adam exp_avg_sq (v)": mem["exp_avg_sq"], "activations": measured}
    return parts, measured, formula


def seven_b_memory() -> dict[str, float]:
    """Bytes of a 7B model in bf16 with fp32 master weights (ZeRO's 16 B / param) + activations."""
    mem = training_memory(SEVEN_B, master_weights=True)
    act = activation_memory(SEVEN_B, SEVEN_B_B, SEVEN_B_S)["total"]
    return {"parameters": mem["params"], "gradients": mem["grads"], "fp32 master weights": mem["master_weights"],
            "Adam exp_avg (m)": mem["exp_avg"], "Adam exp_avg_sq (v)": mem["exp_avg_sq"], "activations": act}


def stacked_bar(ax, parts: dict[str, float], scale: float, unit: str) -> None:
    bottom = 0.0
    for name, value in parts.items():
        v = value / scale
        ax.bar([0], [v], bottom=bottom, color=COLORS[name], width=0.55, label=name)
        ax.text(0.33, bottom + v / 2, f"{name}: {v:,.1f} {unit}", va="center", fontsize=8)
        bottom += v
    ax.set_xlim(-0.4, 2.5)
    ax.set_xticks([])
    ax.set_ylabel(unit)
    ax.spines[["top", "right"]].set_visible(False)


def plot_memory() -> None:
    demo_parts, measured, formula = demo_memory()
    big = seven_b_memory()
    n_demo = count_parameters(DEMO)["total"]
    n_big = count_parameters(SEVEN_B)["total"]

    fig, (left, right) = plt.subplots(1, 2, figsize=(9.5, 4.2))
    stacked_bar(left, demo_parts, 2**20, "MiB")
    left.set_title(f"demo model, {n_demo:,} params, fp32 AdamW\n"
                   f"b={DEMO_B}, s={DEMO_S}: activations measured {measured:,} B "
                   f"(formula {formula:,})", fontsize=9)
    stacked_bar(right, big, GiB, "GiB")
    right.axhline(GPU_BYTES / GiB, color="black", ls="--", lw=1)
    right.text(2.45, GPU_BYTES / GiB + 3, "one 80 GiB GPU", ha="right", fontsize=8)
    right.set_title(f"LLaMA-2-7B shapes, {n_big / 1e9:.2f}B params, bf16 + fp32 master\n"
                    f"b={SEVEN_B_B}, s={SEVEN_B_S}: activations from the formula", fontsize=9)
    fig.suptitle("Where training memory goes (minimegatron.analysis)", fontsize=10)
    fig.tight_layout()
    fig.savefig(OUT / "memory_breakdown.png", dpi=100)
    plt.close(fig)


def plot_flops() -> None:
    seqs = [512, 1024, 2048, 4096, 8192, 16384, 32768]
    groups = {"q/k/v + output projections": ("qkv", "proj"), "MLP (SwiGLU)": ("fc1", "fc2"),
              "attention: q k^T and probs v": ("attention_scores", "attention_over_values"), "logits": ("logits",)}
    colors = ["#4C72B0", "#55A868", "#C44E52", "#8172B2"]
    shares = {name: [] for name in groups}
    for s in seqs:
        fwd = training_flops(SEVEN_B, 1, s)["forward"]
        for name, keys in groups.items():
            shares[name].append(100 * sum(fwd[k] for k in keys) / fwd["total"])
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.stackplot(range(len(seqs)), *shares.values(), labels=list(groups), colors=colors, alpha=0.85)
    ax.set_xticks(range(len(seqs)), [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqs])
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("% of the step's matmul FLOPs")
    ax.set_ylim(0, 100)
    ax.set_xlim(0, len(seqs) - 1)
    ax.set_title("7B shapes: the s^2 attention terms grow with context (training_flops)", fontsize=9)
    ax.legend(loc="lower left", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(OUT / "flops_breakdown.png", dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# the figures (drawn from the records the code keeps; the notebook and the tests draw them too)
# ---------------------------------------------------------------------------------------
def plot_memory_breakdown(reports: dict[str, dict] | dict, path: str | None = None, *,
                          device_memory_gib: float | None = None, title: str | None = None,
                          unit: str = "auto"):
    """A stacked bar chart of params / grads / optimizer / activations.

    reports: one analysis.memory_report, or {label: memory_report} for several bars (e.g. the
      ZeRO stages of chapter 01, or several micro-batch sizes).
    path: save a PNG there. device_memory_gib: draw a dashed line at one device's memory.
    unit: "KiB", "MiB", "GiB", "TiB", or "auto" (the largest unit in which the tallest bar
      is at least 1).
    Returns the matplotlib Figure (Agg canvas).
    """
    if "total" in reports:                         # a single report
        reports = {reports.get("model", "model"): reports}
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    if unit == "auto":
        tallest = max(report["total"] for report in reports.values())
        unit = next((u for u in reversed(units) if tallest >= units[u]), "KiB")
    scale = units[unit]

    parts = ("params", "grads", "optimizer", "activations")
    colors = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")
    fig = new_figure(figsize=(3.0 + 1.2 * len(reports), 4.2))
    ax = fig.add_subplot()
    labels = list(reports)
    bottoms = [0.0] * len(labels)
    for part, color in zip(parts, colors):
        heights = [reports[label][part] / scale for label in labels]
        ax.bar(labels, heights, bottom=bottoms, color=color, label=part, width=0.6)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    if device_memory_gib is not None:
        line = device_memory_gib * GiB / scale
        ax.axhline(line, color="black", linestyle="--", linewidth=1, label=f"one device ({device_memory_gib:g} GiB)")
    ax.set_ylabel(unit)
    ax.set_title(title or "training memory per device", fontsize="medium")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small", frameon=False)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


# ---------------------------------------------------------------------------------------
# the numbers the chapter quotes (booktools/measured.py: `make numbers CH=00` records them in
# measured.json; the text's <!--m:key--> markers are checked against it)
# ---------------------------------------------------------------------------------------
RUNS = {"figures": "python chapters/00_single_device/make_figures.py"}

MiB, GB, TB, YEAR = 2**20, 1e9, 1e12, 365.25 * 24 * 3600


def measure(outputs: dict[str, list[str]], results: dict[str, dict | None]) -> dict[str, float]:
    """Every number of sections 3 and 5 that the code computes or measures, by marker key."""
    train = TrainConfig(**DEMO_TRAIN)
    v = {f"lr_step{step}": learning_rate(step, train) for step in (0, 29, (train.train_iters + train.lr_warmup_iters) // 2)}
    n = count_parameters(DEMO)
    layer = n["per_layer"]
    v |= {"params": n["total"], "params_layer": layer["total"], "params_qkv": layer["qkv_weight"],
          "params_proj": layer["proj_weight"], "params_fc1": layer["fc1_weight"], "params_fc2": layer["fc2_weight"],
          "params_norms": layer["norms"], "params_embedding": n["embedding"], "params_final_norm": n["final_norm"],
          "params_non_embedding": n["non_embedding"]}
    state = training_memory(DEMO)["total"]
    v |= {"state_bytes": state, "state_mib": state / MiB}

    _, measured, formula = demo_memory()
    per_layer = activation_memory(DEMO, DEMO_B, DEMO_S)["per_layer"]
    v |= {"activations_measured": measured, "activations_formula": formula, "activations_mib": measured / MiB,
          "activations_per_layer": per_layer["total"], "activations_swiglu_mib": per_layer["activation"] / MiB,
          "activations_softmax_mib": per_layer["softmax_output"] / MiB}
    sdpa = ModelConfig.llama(**DEMO_MODEL)
    sdpa_total = activation_memory(sdpa, DEMO_B, DEMO_S)
    v |= {"sdpa_bytes": sdpa_total["total"], "sdpa_mib": sdpa_total["total"] / MiB,
          "sdpa_per_layer": sdpa_total["per_layer"]["total"]}

    seven = training_memory(SEVEN_B, master_weights=True)["total"]
    v |= {"seven_b_params_b": count_parameters(SEVEN_B)["total"] / 1e9, "seven_b_state_gb": seven / GB,
          "seven_b_state_gib": seven / GiB,
          "seven_b_activations_gib": activation_memory(SEVEN_B, SEVEN_B_B, SEVEN_B_S)["total"] / GiB,
          "seven_b_korthikanti_gib": korthikanti_activation_memory(SEVEN_B, SEVEN_B_B, SEVEN_B_S)["total"] / GiB}

    gpt2_256 = ModelConfig.gpt2(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=257,
                                max_position_embeddings=128)
    v["flops_gpt2_256"] = training_flops(gpt2_256, 8, 128)["total"]
    v["flops_gpt2_256_narayanan72"] = narayanan2021_flops_per_iteration(gpt2_256, 8, 128, recompute=False)
    flops = training_flops(DEMO, DEMO_B, DEMO_S)
    fwd, tokens = flops["forward"], DEMO_B * DEMO_S
    six_n = flops_per_token_6n(DEMO) * tokens
    v |= {"flops_step_g": flops["total"] / 1e9, "flops_forward_m": fwd["total"] / 1e6,
          **{f"flops_{k}_m": fwd[k] / 1e6 for k in ("fc1", "fc2", "qkv", "proj", "logits", "attention_scores")},
          "flops_6n_g": six_n / 1e9,
          "flops_attention_extra_m": 3 * (fwd["attention_scores"] + fwd["attention_over_values"]) / 1e6,
          "flops_logits_extra_m": 3 * fwd["logits"] / 1e6,
          "flops_norms_m": -6 * (DEMO.num_layers * layer["norms"] + n["final_norm"]) * tokens / 1e6}

    gpt3, gpt3_s = real_model_config("gpt3-175b")
    n3 = count_parameters(gpt3)["total"]
    fit = does_it_fit("gpt3-175b")
    korthikanti_layer = korthikanti_activation_memory(gpt3, 1, gpt3_s)["per_layer"]          # bytes
    total_6n = 6 * n3 * 300e9
    exact = training_flops(gpt3, 1, gpt3_s)["total"] / gpt3_s * 300e9
    v |= {"gpt3_params_b": n3 / 1e9, "gpt3_state_tb": 16 * n3 / TB, "gpt3_state_gib": 16 * n3 / GiB,
          "gpt3_state_gpus": 16 * n3 / (80 * GiB), "gpt3_state_gpus_needed": -(-16 * n3 // (80 * GiB)),
          "gpt3_state_gpus_80gb": -(-16 * n3 // (80 * GB)),
          "gpt3_fit_devices": fit["devices_needed"],
          "gpt3_korthikanti_layer_gb": korthikanti_layer / GB,
          "gpt3_korthikanti_gb": 96 * korthikanti_layer / GB, "gpt3_korthikanti_gib": 96 * korthikanti_layer / GiB,
          "gpt3_6n_flops": total_6n, "gpt3_exact_over_6n_pct": 100 * (exact / total_6n - 1),
          "gpt3_years_a100_peak": total_6n / 312e12 / YEAR, "gpt3_years_a100_40pct": total_6n / (0.4 * 312e12) / YEAR,
          "gpt3_years_h100_peak": total_6n / 989e12 / YEAR}
    return {key: float(value) if isinstance(value, float) else int(value) for key, value in v.items()}


@dataclass
class FiguresResults:
    """The run's result: measure() computes every number from the package's functions (the
    figures are drawn from the same), so the run returns its exit status alone."""
    exit_code: int = 0


def main(argv=None) -> FiguresResults:
    plt.switch_backend("Agg")       # a script: no screen (importing this file leaves the backend alone)
    OUT.mkdir(parents=True, exist_ok=True)
    plot_memory()
    plot_flops()
    for path in sorted(OUT.glob("*.png")):
        print(f"{path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}: "
              f"{path.stat().st_size / 1024:.0f} KB")
    return FiguresResults()


if __name__ == "__main__":
    sys.exit(main().exit_code)
