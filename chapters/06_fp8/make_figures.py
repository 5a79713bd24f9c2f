"""The figures of chapter 06 and the numbers the chapter quotes.

    python chapters/06_fp8/make_figures.py       # a few minutes on 2 cores; writes figures/*.png

  precision_loss.png  the same tiny LLaMA-style model (h 64, 2 layers, byte tokens, micro-batch 8 x 64)
                      trained STEPS steps on the book's text (one process, the training loop's own
                      pieces) in fp32, bf16 with float32 main parameters, plain bf16 (no main copies),
                      fp16 with dynamic loss scaling, and FP8 (hybrid) with each of the four recipes over
                      a float32 model: the losses, each run's distance from fp32, and fp16's loss scale
  fp8_scales.png      the delayed recipe's state in one layer (layer 0's linear_fc1) over the same FP8
                      run: the amax of its input and output gradient at each step and the scale the
                      cast used, against the current (tensorwise) recipe's scale for the same tensor

It prints, per run, the mean loss of the last 20 steps and its difference to fp32, fp16's
skipped steps and final scale, and stops with an error (exit 1) if a claim the chapter makes
does not hold.

RUNS and measure() at the end are what `make numbers CH=06` (python -m booktools.measured record
06) reruns and records in measured.json; tests/test_measured.py checks the README's quoted
numbers against it.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from booktools.demo import import_chapter
from booktools.measured import RoundOff, claim
from minimegatron.analysis import adam_bytes_per_parameter
from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.viz import colour, finish_figure, new_figure

ch06 = import_chapter("06")        # chapters/06_fp8/demo.py

OUT = Path(__file__).resolve().parent / "figures"
STEPS, SEQ, BATCH = 300, 64, 8
CONFIGS = {   # name -> (params_dtype, TrainConfig overrides)
    "fp32": ("float32", {}),
    "bf16": ("bfloat16", {"bf16": True}),
    "bf16, no main copies": ("bfloat16", {}),
    "fp16 (loss scaling)": ("float16", {"fp16": True}),
    **{f"FP8 {r}": ("float32", {"fp8_format": "hybrid", "fp8_recipe": r, "fp8_amax_history_len": 16,
                                "fp8_amax_compute_algo": "max"} if r == "delayed" else
                    {"fp8_format": "hybrid", "fp8_recipe": r}) for r in ch06.RECIPES},
}


def train_precision(name: str, steps: int = STEPS) -> dict:
    """One run of CONFIGS[name] on one process: {"losses", "scales" (the loss scale each step
    ran with), "skipped" (steps the scaler skipped), "fc1" (FP8: layer 0's linear_fc1 per step:
    input amax, output-gradient amax, the scales its casts used)}."""
    from minimegatron.data import batch_for_step
    from minimegatron.fp8 import Fp8Gemm
    from minimegatron.optim import learning_rate
    from minimegatron.parallel_state import Layout
    from minimegatron.parallelize import build_model, build_optimizer, unwrap
    from minimegatron.train import build_datasets, train_step

    dtype, overrides = CONFIGS[name]
    model_cfg = ModelConfig.llama(hidden_size=64, num_layers=2, num_attention_heads=4, max_position_embeddings=SEQ,
                                  vocab_size=260, params_dtype=dtype)
    cfg = TrainConfig(seq_length=SEQ, micro_batch_size=BATCH, train_iters=steps, lr_warmup_iters=steps // 10,
                      progress=False, eval_interval=0, **overrides)
    chunks = build_model(model_cfg, cfg, Layout())
    optimizer = build_optimizer(chunks, cfg, Layout())
    data = build_datasets(model_cfg, cfg)[0]
    fc1 = dict(unwrap(chunks[0]).named_modules())["decoder.layers.0.mlp.linear_fc1"].gemm
    out = {"losses": [], "scales": [], "skipped": 0, "skipped_steps": [], "fc1": []}
    for step in range(steps):
        out["scales"].append(optimizer.loss_scale)
        batch = batch_for_step(data, step, BATCH, 0, 1)
        probe = _probe(fc1) if isinstance(fc1, Fp8Gemm) else None
        loss, norm = train_step(chunks, optimizer, [batch], Layout(), learning_rate(step, cfg))
        out["losses"].append(loss)
        out["skipped"] += norm is None
        if norm is None:
            out["skipped_steps"].append(step + 1)
        if probe is not None:
            out["fc1"].append(probe())
    return out


def _probe(gemm):
    """Record what one training step's casts of `gemm` see: the amaxes of the input and the
    output gradient, and the scales their (first) casts used."""
    seen = {}
    real = gemm.cast

    def cast(x, role, scale=None):
        q, used = real(x, role, scale)
        if scale is None and role in ("input", "grad_output") and role not in seen:
            seen[role] = (float(x.detach().abs().max()), float(used.reshape(-1)[0]))
        return q, used
    gemm.cast = cast

    def done():
        del gemm.cast                                  # back to the class's method
        return seen
    return done


def plot_precision_loss(runs: dict[str, dict], path=None, title: str = ""):
    fig = new_figure(figsize=(13.5, 3.6))
    ax_loss, ax_diff, ax_scale = fig.subplots(1, 3)
    base = torch.tensor(runs["fp32"]["losses"])
    window = 20
    for i, (name, r) in enumerate(runs.items()):
        line = colour(i, len(runs))
        losses = torch.tensor(r["losses"])
        ax_loss.plot(range(1, len(losses) + 1), losses, color=line, label=name, linewidth=1)
        smooth = torch.nn.functional.avg_pool1d((losses - base)[None, None], window, stride=1)[0, 0]
        ax_diff.plot(range(window, len(losses) + 1), smooth, color=line, label=name, linewidth=1)
    ax_loss.set(xlabel="step", ylabel="training loss", title="loss")
    ax_loss.set_ylim(top=float(base[10]))
    ax_diff.axhline(0, color="black", linewidth=0.8)
    ax_diff.set(xlabel="step", ylabel="loss - fp32 loss", title=f"difference to fp32 ({window}-step mean)")
    ax_loss.legend(fontsize=7)
    scales = runs["fp16 (loss scaling)"]["scales"]
    ax_scale.plot(range(1, len(scales) + 1), scales, color=colour(3, len(runs)))
    ax_scale.set_yscale("log", base=2)
    ax_scale.set(xlabel="step", ylabel="loss scale", title="fp16's dynamic loss scale")
    return finish_figure(fig, path, title)


def plot_fp8_scales(delayed: list[dict], current: list[dict], path=None, title: str = ""):
    fig = new_figure(figsize=(10, 3.6))
    axes = fig.subplots(1, 2)
    for ax, role, fmt_max in zip(axes, ("input", "grad_output"), (448.0, 57344.0)):
        steps = range(1, len(delayed) + 1)
        room = [fmt_max / d[role][0] for d in delayed]                  # the largest scale that does not clamp
        ax.plot(steps, room, color="black", linewidth=0.8, label="max / amax (this step)")
        ax.plot(steps, [d[role][1] for d in delayed], color=colour(0, 3), label="delayed: the scale used")
        ax.plot(steps, [c[role][1] for c in current], color=colour(2, 3), linestyle="--", label="current: the scale used")
        clamped = [(i, d[role][1]) for i, d in zip(steps, delayed) if d[role][0] * d[role][1] > fmt_max]
        ax.plot([i for i, _ in clamped], [x for _, x in clamped], "x", color="red", markersize=5,
                label=f"delayed saturated ({len(clamped)} steps)")
        ax.set_yscale("log", base=2)
        seen = room[1:] + [d[role][1] for d in delayed[1:]] + [c[role][1] for c in current]
        ax.set_ylim(min(seen) / 2, max(seen) * 2)                         # step 1's scale of 1 (no history) is below
        ax.set(xlabel="step", ylabel="scale", title=f"layer 0 linear_fc1, {role} ({'e4m3' if fmt_max == 448 else 'e5m2'})")
        ax.legend(fontsize=7)
    return finish_figure(fig, path, title)


@dataclass
class Figures:
    exit_code: int = 0
    loss: dict = field(default_factory=dict)        # CONFIGS name -> the mean loss of the last 20 steps (4 decimals)
    diff: dict = field(default_factory=dict)        # CONFIGS name -> that minus fp32's (4 decimals)
    fp16_skipped_steps: list = field(default_factory=list)
    fp16_scale_log2: tuple = ()                     # (first, last)
    delayed_saturated_steps: int = 0


def main(argv=None) -> Figures:
    torch.set_num_threads(1)
    OUT.mkdir(exist_ok=True)
    runs = {name: train_precision(name) for name in CONFIGS}
    base, got = sum(runs["fp32"]["losses"][-20:]) / 20, Figures()
    print(f"== {STEPS} steps, h 64, 2 layers, micro-batch {BATCH} x {SEQ}, the book's text; the mean loss of the last "
          f"20 steps:")
    for name, r in runs.items():
        last = sum(r["losses"][-20:]) / 20
        got.loss[name], got.diff[name] = round(last, 4), round(last - base, 4)
        print(f"  {name:22s} {last:.4f}  ({last - base:+.4f} against fp32)")
    fp16 = runs["fp16 (loss scaling)"]
    got.fp16_skipped_steps = fp16["skipped_steps"]
    got.fp16_scale_log2 = tuple(round(math.log2(fp16["scales"][i])) for i in (0, -1))
    print(f"fp16: {fp16['skipped']} steps skipped (overflow), the scale from 2^{got.fp16_scale_log2[0]} to "
          f"2^{got.fp16_scale_log2[1]}; the steps skipped: {', '.join(map(str, fp16['skipped_steps']))}")
    plot_precision_loss(runs, OUT / "precision_loss.png")
    plot_fp8_scales(runs["FP8 delayed"]["fc1"], runs["FP8 tensorwise"]["fc1"], OUT / "fp8_scales.png")
    got.delayed_saturated_steps = sum(d["input"][0] * d["input"][1] > 448 for d in runs["FP8 delayed"]["fc1"])
    print(f"FP8 delayed, layer 0 linear_fc1: {got.delayed_saturated_steps} of {STEPS} steps cast an input whose amax "
          f"times the scale exceeded 448 (saturated)")
    print(f"figures: {OUT / 'precision_loss.png'}, {OUT / 'fp8_scales.png'}")
    return got


# ---------------------------------------------------------------------------------------
# the numbers the chapter quotes
# ---------------------------------------------------------------------------------------
DEMO = "python chapters/06_fp8/demo.py"
RUNS = {
    "figures": "python chapters/06_fp8/make_figures.py",
    "demo": DEMO,                                                                  # bf16, tp 2 x dp 2, the table
    "fp16": f"{DEMO} --quick --precision fp16 --tp 2 --pp 2 --dp 1",
    "bf16-zero1": f"{DEMO} --quick --zero-stage 1 --tp 1 --dp 4",                # §2: 6 + 12/d
    "fp8-delayed": f"{DEMO} --quick --precision fp8 --fp8-recipe delayed --tp 2 --sp --pp 2 --dp 1",
    "fp8-tensorwise": f"{DEMO} --quick --precision fp8 --fp8-recipe tensorwise --tp 2 --sp --dp 2",
    "fp8-mxfp8": f"{DEMO} --quick --precision fp8 --fp8-recipe mxfp8 --tp 2 --sp --cp 2 --dp 1",
    "fp8-blockwise": f"{DEMO} --quick --precision fp8 --fp8-recipe blockwise --tp 2 --pp 2 --dp 1",
    "fp8-5d": f"{DEMO} --quick --precision fp8 --fp8-recipe tensorwise --tp 2 --sp --cp 2 --pp 2 --ep 2 --dp 2",  # §5
}
MACHINE_DEPENDENT = ()


def measure(outputs: dict[str, list[str]], results: dict[str, dict | None]) -> dict[str, float]:
    v = {}
    for run_id in RUNS:
        if run_id != "figures":
            claim(results[run_id]["verdict"].startswith("MATCH"), f"{run_id} matches one device")
    figures, demo = results["figures"], results["demo"]
    for name in CONFIGS:
        key = name.split(" (")[0].replace(",", "").replace(" ", "_").lower()
        # round-off: 300 steps of 16-bit (or float32) training follow the kernels' summation order
        v[f"loss_{key}"], v[f"diff_{key}"] = RoundOff(figures["loss"][name]), RoundOff(figures["diff"][name])
    steps = figures["fp16_skipped_steps"]
    v["fp16_skipped"] = len(steps)
    v["fp16_scale_first_log2"], v["fp16_scale_last_log2"] = figures["fp16_scale_log2"]
    first = next((i for i, step in enumerate(steps) if step != i + 1), len(steps))    # the run of skips from step 1
    late = steps[first:]
    v["fp16_first_skips"], v["fp16_late_skips"] = first, len(late)
    v |= {f"fp16_late_skip_{i + 1}": step for i, step in enumerate(late)}
    claim(v.get("fp16_scale_last_log2", 16) == 32 - (first - 1) - len(late),
          "the first skip spends the hysteresis, every other one halves the scale")
    v["delayed_saturated_steps"] = figures["delayed_saturated_steps"]
    claim(max(abs(v[k]) for k in v if k.startswith("diff_")) < 0.1, "every precision ends within 0.1 of fp32")
    # memory per parameter, [2/4]
    v["bytes_bf16"] = adam_bytes_per_parameter("bfloat16", True, "float32")["total"]
    v["bytes_fp16"] = adam_bytes_per_parameter("float16", True)["total"]
    v["demo_stage_bytes"], v["demo_stage_params"] = demo["stages"][0]["bytes"], demo["stages"][0]["parameters"]
    zero1 = results["bf16-zero1"]["stages"][0]
    v["zero1_params"], v["zero1_bytes"] = zero1["parameters"], zero1["bytes"]
    v["zero1_per_param"] = v["zero1_bytes"] / v["zero1_params"]
    claim(v["zero1_per_param"] == 6 + 12 / 4, "ZeRO-1 over 4 ranks keeps 6 + 12/4 bytes per parameter")
    v["fp16_final_scale"] = results["fp16"]["loss_scale"]
    v["delayed_amax_calls"] = results["fp8-delayed"]["communication"]["fp8"]["calls"]
    claim(results["fp8-5d"]["inexact"] is None,
          "current scaling at 5D (experts on one micro-batch's ranks) equals one device to float64 summation order")
    # the quantisation table, [4/4] of the demo
    for recipe in ch06.RECIPES:
        for role in ("input", "weight", "grad_output"):
            q = demo["quantisation"][recipe][role]
            v[f"q_{recipe}_{role}_err"] = q["rel_error"]
            v[f"q_{recipe}_{role}_under_pct"] = q["underflow_pct"]
            v[f"q_{recipe}_{role}_sat_pct"] = q["saturated_pct"]
    claim(v["q_delayed_grad_output_err"] > v["q_tensorwise_grad_output_err"],
          "delayed scaling's gradients come back with a larger error than current scaling's")
    claim(all(v[f"q_{r}_{role}_sat_pct"] == 0 for r in ("blockwise", "mxfp8") for role in ("input", "weight", "grad_output")),
          "the blocked recipes clamp nothing")
    claim(v["q_delayed_grad_output_sat_pct"] > 0, "delayed scaling clamps some gradients")
    claim(max(abs(v[f"q_{r}_input_err"] - v["q_tensorwise_input_err"]) for r in ch06.RECIPES) < 0.005,
          "the inputs' error is about the same in every recipe")
    claim(v["fp16_scale_last_log2"] == 16, "after 300 steps the fp16 scale is 2^16")
    claim(v["q_delayed_grad_output_under_pct"] == max(v[f"q_{r}_grad_output_under_pct"] for r in ch06.RECIPES),
          "the most a gradient loses to underflow is the delayed recipe's")
    return v


if __name__ == "__main__":
    sys.exit(main().exit_code)
