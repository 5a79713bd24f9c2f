"""The figure of chapter 07 and the numbers the chapter quotes.

    python chapters/07_kernels/make_figures.py       # about a minute on 2 cores; writes figures/*.png

  zero1_overlap_timeline.png  ZeRO-1 on 2 ranks with --overlap-grad-reduce (bench_ddp.py's model,
                        buckets of 500,000 elements): rank 0's median step, the backward and each
                        bucket's reduce-scatter from its launch to the end of its wait

  recompute_memory.png  the bytes one transformer layer keeps for the backward against the
                        sequence length s = 128 ... 1024, one process, a 4-layer GPT-2-style bf16
                        model (h 64, a 4, micro-batch 1, dropout 0.1), for no recompute, selective
                        (core_attn) and full recompute: measured with saved-tensor hooks (points)
                        on analysis.activation_memory (lines), with the naive attention (left: its
                        [s, s] scores, Korthikanti et al.'s 5 a s^2 b) and the fused one (right:
                        sdpa, whose flash kernel keeps no [s, s] matrix, so core_attn buys nothing)

It prints the per-layer bytes at each length and stops with an error (exit 1) if a measured
point is not its formula, or a claim the chapter makes does not hold.

RUNS and measure() at the end are what `make numbers CH=07` (python -m booktools.measured record
07) reruns and records in measured.json; tests/test_measured.py checks the README's quoted
numbers against it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from booktools.measured import RoundOff, claim
from minimegatron.analysis import activation_memory, measure_saved_activation_bytes
from minimegatron.config import ModelConfig
from minimegatron.model import GPTModel
from minimegatron.recompute import apply_recompute
from minimegatron.viz import colour, finish_figure, new_figure

OUT = Path(__file__).resolve().parent / "figures"
LENGTHS = (128, 256, 512, 1024)
CASES = {   # name -> TrainConfig's recompute fields
    "none": {},
    "selective (core_attn)": dict(recompute_granularity="selective", recompute_modules=("core_attn",)),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


def per_layer_bytes(backend: str, seq: int, recompute: dict) -> tuple[float, float]:
    """(measured, formula) bytes per layer: the whole model's saved bytes less what
    activation_memory counts outside the layers, over the 4 layers."""
    cfg = ModelConfig.gpt2(hidden_size=64, num_layers=4, num_attention_heads=4, vocab_size=256,
                           max_position_embeddings=max(LENGTHS), params_dtype="bfloat16", hidden_dropout=0.1,
                           attention_dropout=0.1 if backend == "naive" else 0.0, attention_backend=backend)
    model = apply_recompute(GPTModel(cfg), recompute.get("recompute_granularity"), recompute.get("recompute_method"),
                            recompute.get("recompute_num_layers"),
                            recompute.get("recompute_modules", ("core_attn",))).train()
    tokens, labels = torch.randint(0, 256, (1, seq)), torch.randint(0, 256, (1, seq))
    formula = activation_memory(cfg, 1, seq, **recompute)
    outside = formula["outside_layers"]["total"]
    measured = measure_saved_activation_bytes(model, tokens, labels)
    return (measured - outside) / cfg.num_layers, formula["layers"] / cfg.num_layers


@dataclass
class FigureResults:
    """What main printed: bytes a layer keeps, {backend: {case: [measured at each of LENGTHS]}};
    tp_memory_table's rows ({sp, case, measured, per_layer, korthikanti}); the timeline's
    {launched, buckets, blocked_ms, step_ms}."""
    exit_code: int = 0
    layer_bytes: dict = field(default_factory=dict)
    tp_rows: list = field(default_factory=list)
    timeline: dict = field(default_factory=dict)


def main(argv=None) -> FigureResults:
    out = FigureResults()
    torch.manual_seed(0)
    OUT.mkdir(exist_ok=True)
    fig = new_figure(figsize=(11, 4.2))
    axes = fig.subplots(1, 2)
    for ax, backend in zip(axes, ("naive", "sdpa")):
        print(f"{backend} attention: bytes one layer keeps for the backward (measured = formula)")
        for i, (name, recompute) in enumerate(CASES.items()):
            points = [per_layer_bytes(backend, s, recompute) for s in LENGTHS]
            for s, (measured, formula) in zip(LENGTHS, points):
                if measured != formula:
                    print(f"MISMATCH: {backend}, {name}, s {s}: measured {measured:,.0f} bytes a layer, "
                          f"activation_memory {formula:,.0f}", file=sys.stderr)
                    out.exit_code = 1
                    return out
            out.layer_bytes.setdefault(backend, {})[name] = [m for m, _ in points]
            print(f"  {name:<22}" + "  ".join(f"s {s}: {m:>12,.0f}" for s, (m, _) in zip(LENGTHS, points)))
            look = dict(color=colour(i, len(CASES)), marker="os^"[i], markersize=9 - i, mfc="none" if i else None)
            ax.plot(LENGTHS, [f / 2**20 for _, f in points], ls=("-", "--", ":")[i], color=look["color"])
            ax.plot(LENGTHS, [m / 2**20 for m, _ in points], ls="none", label=name, zorder=3, **look)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length s")
        ax.set_ylabel("MiB one layer keeps for the backward")
        ax.set_title(f"{backend} attention" + (" (the [s, s] scores)" if backend == "naive" else " (flash kernel)"))
        ax.legend(fontsize=8, title="markers: measured; lines: the formula", title_fontsize=8)
    finish_figure(fig, OUT / "recompute_memory.png")
    print(f"wrote {OUT / 'recompute_memory.png'}")
    out.tp_rows = tp_memory_table()
    if out.tp_rows is None:
        out.exit_code = 1
        return out
    out.timeline = draw_zero_timeline()
    return out


def tp_memory_table() -> list[dict] | None:
    """2 ranks: what one micro-batch keeps on a tensor-parallel rank (tp 2, with and without SP)
    for each recompute, measured (testing.saved_activation_bytes_per_rank) against
    analysis.activation_memory, per layer beside Korthikanti et al.'s. Returns the rows
    ({sp, case, measured, per_layer, korthikanti}), None on a mismatch."""
    import dataclasses

    from minimegatron.analysis import activation_memory, korthikanti_activation_memory
    from minimegatron.config import TrainConfig
    from minimegatron.launch import spawn
    from minimegatron.testing import saved_activation_bytes_per_rank

    cfg = ModelConfig.gpt2(hidden_size=64, num_layers=4, num_attention_heads=4, vocab_size=256,
                           max_position_embeddings=256, params_dtype="bfloat16", hidden_dropout=0.1,
                           attention_dropout=0.1, attention_backend="naive")
    b, s = 1, 256
    cases = []
    for sp in (False, True):
        for name, recompute in CASES.items():
            model = dataclasses.replace(cfg, attention_dropout=0.0) if "selective" in name else cfg
            train = TrainConfig(seq_length=s, micro_batch_size=b, tensor_model_parallel_size=2, sequence_parallel=sp,
                                bf16=True, progress=False, **recompute)
            cases.append((f"tp 2{' + SP' if sp else '     '}  {name}", name, model, train))
    measured = spawn(saved_activation_bytes_per_rank, 2, [(m, t, b, s) for _, _, m, t in cases], timeout=300)
    print("on each of 2 tensor-parallel ranks (GPT-2 style, bf16, h 64, 4 layers, s 256, naive attention, "
          "dropout 0.1; selective without attention dropout, as Megatron's core_attn):")
    rows = []
    for i, (label, name, model, train) in enumerate(cases):
        formula = activation_memory(model, b, s, tp=2, sequence_parallel=train.sequence_parallel, **CASES[name])
        korthikanti = korthikanti_per_layer(name, model, b, s, 2, train.sequence_parallel)
        ranks = sorted({rank[i] for rank in measured})
        if ranks != [formula["total"]]:
            print(f"MISMATCH: {label}: measured {ranks}, activation_memory {formula['total']:,}", file=sys.stderr)
            return None
        layer = formula["layers"] // model.num_layers
        rows.append(dict(sp=train.sequence_parallel, case=name, measured=ranks[0], per_layer=layer,
                         korthikanti=korthikanti))
        print(f"  {label:<34} {ranks[0]:>11,} bytes measured = formula; per layer {layer:>9,} "
              f"(Korthikanti {korthikanti:>9,})")
    return rows


def korthikanti_per_layer(recompute: str, cfg: ModelConfig, b: int, s: int, t: int, sp: bool) -> int:
    """Korthikanti et al.'s bytes per layer and rank (16-bit): none as korthikanti_activation_memory;
    selective (their attention core recomputed) without the 5 a s^2 b / t term, 34 s b h / t with
    SP and (10 + 24 / t) s b h without; full, the layer input, 2 s b h (/ t with SP)."""
    from minimegatron.analysis import korthikanti_activation_memory
    sbh = s * b * cfg.hidden_size
    if recompute == "none":
        return korthikanti_activation_memory(cfg, b, s, tp=t, sequence_parallel=sp)["per_layer"]
    if recompute == "full":
        return 2 * sbh // (t if sp else 1)
    return 34 * sbh // t if sp else 10 * sbh + 24 * sbh // t


# ZeRO-1 with --overlap-grad-reduce on 2 ranks: bench_ddp.py's model and buckets
TIMELINE_MODEL = dict(hidden_size=256, num_layers=4, num_attention_heads=8, num_query_groups=2, vocab_size=257,
                      max_position_embeddings=128)
TIMELINE_BUCKET, TIMELINE_S, TIMELINE_B, TIMELINE_STEPS = 500_000, 128, 4, 5


def zero_timeline_rank() -> list:
    """Spawn target: ZeRO-1 with overlap_grad_reduce and overlap_param_gather, the timelines of
    TIMELINE_STEPS steps (after 2 of warm-up) of this rank."""
    import torch.distributed as dist

    from minimegatron.config import TrainConfig
    from minimegatron.dp import ZeroDataParallel
    from minimegatron.optim import NormGroup, Optimizer
    from minimegatron.parallel_state import Layout
    from minimegatron.train import train_step
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = Layout(world=world, rank=rank, dp=world, dp_rank=rank, dp_group=dist.group.WORLD)
    x = torch.randint(0, 257, (TIMELINE_B, TIMELINE_S + 1), generator=torch.Generator().manual_seed(100 + rank))
    batch = {"tokens": x[:, :-1], "labels": x[:, 1:]}
    cfg = TrainConfig(seq_length=TIMELINE_S, micro_batch_size=TIMELINE_B, lr=1e-4, progress=False)
    zero = ZeroDataParallel(GPTModel(ModelConfig.llama(**TIMELINE_MODEL)), layout.dp_group, stage=1,
                            bucket_size=TIMELINE_BUCKET, overlap_grad_reduce=True, overlap_param_gather=True)
    optimizer = Optimizer([zero], cfg, [NormGroup(groups=(layout.dp_group,))])
    recorded = []
    for step in range(2 + TIMELINE_STEPS):
        train_step([zero], optimizer, [batch], layout, 1e-4)
        if step >= 2:
            recorded.append(zero.timeline)
    return recorded


def draw_zero_timeline() -> dict:
    """zero1_overlap_timeline.png: rank 0's step of median length; returns its {launched,
    buckets, blocked_ms, step_ms}."""
    from booktools.demo import import_chapter
    from minimegatron.launch import spawn
    recorded = spawn(zero_timeline_rank, 2, timeout=300)[0]
    timeline = sorted(recorded, key=lambda t: t.sync_end)[len(recorded) // 2]
    found = dict(launched=len(timeline.launched_during_backward()), buckets=len(timeline.buckets),
                 blocked_ms=1e3 * (timeline.sync_end - timeline.sync_start), step_ms=1e3 * timeline.sync_end)
    print(f"ZeRO-1 with --overlap-grad-reduce on 2 ranks, rank 0's median step of {len(recorded)}:")
    print(timeline.table())
    print(f"reduce-scatters launched during the backward: {found['launched']} of {found['buckets']}; blocked in "
          f"finish_grad_sync {found['blocked_ms']:.1f} ms of {found['step_ms']:.1f} ms")
    plot = import_chapter("01", "make_figures").plot_bucket_timeline
    plot(timeline, OUT / "zero1_overlap_timeline.png", collective="reduce-scatter",
         title=f"ZeRO-1 on 2 ranks, --overlap-grad-reduce: {len(timeline.buckets)} buckets' reduce-scatters")
    print(f"wrote {OUT / 'zero1_overlap_timeline.png'}")
    return found


DEMO = "python chapters/07_kernels/demo.py"
RUNS = {
    "figures": "python chapters/07_kernels/make_figures.py",
    "demo": DEMO,                                                              # full, tp 2 x dp 2, with timing
    "selective-sp-cp": f"{DEMO} --quick --recompute selective --recompute-modules core_attn mlp --tp 2 --sp --cp 2 "
                       f"--dp 1",
    "block-pp": f"{DEMO} --quick --recompute full --recompute-method block --tp 2 --sp --pp 2 --dp 1",
    "moe": f"{DEMO} --quick --recompute selective --recompute-modules moe --tp 2 --sp --ep 2 --dp 2",
    "pack": f"{DEMO} --quick --pack --recompute selective --tp 2 --sp --dp 2",                  # §5
    "packing": "python benchmarks/bench_packing.py",                                           # §5, timed
    "kernels": f"{DEMO} --kernels triton --recompute full --tp 2 --sp --dp 2",                # §6, timed
    "compile": f"{DEMO} --quick --kernels compile --tp 2 --sp --dp 2",                        # §7
    "case-study": "python benchmarks/bench_case_study.py",                                     # §7, timed
    # §7, timed; needs transformers (pip install -r requirements-bench.txt)
    "vs-hf": "python benchmarks/bench_vs_hf.py --compile --repeats 5",
    "overlap": "python benchmarks/bench_ddp.py --ranks 1 2 --variants ddp zero1 zero1-overlap zero2 zero2-overlap "
               "--repeats 6",                                                                  # §8, timed
    "overlap-tp-pp": "python benchmarks/bench_overlap.py --repeats 7",                         # §8, timed
}
MACHINE_DEPENDENT = ()


def measure(outputs: dict[str, list[str]], results: dict[str, dict | None]) -> dict[str, float]:
    v = {}
    for run_id in RUNS:
        if run_id not in ("figures", "packing", "case-study", "vs-hf", "overlap", "overlap-tp-pp"):
            claim(results[run_id]["verdict"].startswith("MATCH"), f"{run_id} matches")
    demo, figures = results["demo"], results["figures"]
    memory = {row["name"]: row for row in demo["memory"]}
    for key, name in (("none", "none"), ("selective", "selective core_attn"), ("full", "full, uniform 1")):
        v[f"mem_{key}"] = memory[name]["measured"]
        v[f"mem_{key}_layer"] = round(memory[name]["per_layer"])
        v[f"mem_{key}_korthikanti"] = round(memory[name]["korthikanti"])
    v["mem_selective_fraction"] = round(memory["selective core_attn"]["per_layer"] / memory["none"]["per_layer"], 2)
    v["mem_full_fraction"] = round(memory["full, uniform 1"]["per_layer"] / memory["none"]["per_layer"], 3)
    v["none_over_korthikanti"] = v["mem_none_layer"] / v["mem_none_korthikanti"]
    claim(v["mem_full_layer"] == v["mem_full_korthikanti"], "full recompute keeps Korthikanti's 2 s b h a layer")
    for key, ms in zip(("none", "selective", "full"), demo["times_ms"]):
        v[f"time_{key}_ratio"] = round(ms / demo["times_ms"][0], 2)
    v["demo_tp_calls"] = demo["calls"]["tp"]
    for backend in ("naive", "sdpa"):
        for key, name in (("none", "none"), ("selective", "selective (core_attn)"), ("full", "full")):
            v[f"fig_{backend}_{key}_1024"] = round(figures["layer_bytes"][backend][name][LENGTHS.index(1024)])
    claim(v["fig_sdpa_selective_1024"] / v["fig_sdpa_none_1024"] > 0.95,
          "with the fused attention, core_attn recompute saves almost nothing")
    claim(v["fig_naive_selective_1024"] / v["fig_naive_none_1024"] < 0.2,
          "with the naive attention at s 1024, core_attn recompute keeps less than a fifth")
    for row in figures["tp_rows"]:
        key = f"{'tp2sp' if row['sp'] else 'tp2'}_{row['case'].split()[0]}"
        v[f"{key}_layer"], v[f"{key}_korthikanti"] = row["per_layer"], row["korthikanti"]
    claim(v["tp2sp_full_layer"] == v["tp2sp_full_korthikanti"], "full recompute under SP keeps Korthikanti's 2sbh/t")
    v["cp_recompute_calls"] = results["selective-sp-cp"]["calls"]["cp"]
    pack = results["pack"]["packed"]
    v["pack_alone"] = RoundOff(float(f"{pack['packed']:.1e}"))       # float64 round-off, as printed
    v["pack_mixed"] = float(f"{pack['mixed']:.1e}")
    v.update(measure_packing(results["packing"]))
    kernels = results["kernels"]
    errors = [float(f"{error:.1e}") for _, error, _ in kernels["kernel_errors"]]
    v["kernel_max_error"] = RoundOff(max(errors))                  # float32 round-off
    claim(len(errors) == 9, "nine kernel outputs and gradients are checked")
    attention = {row["seq"]: row for row in kernels["attention_bytes"]}
    v["flash_naive_bytes"], v["flash_bytes"] = attention[512]["naive"], attention[512]["flash"]
    claim(v["flash_bytes"] == 4 * 4 * 512 * 16 * 4 + 4 * 512 * 4, "FlashAttention keeps q, k, v, out and the lse only")
    for seq in (1024, 2048, 4096):
        v[f"flash_{seq}_naive"], v[f"flash_{seq}"] = attention[seq]["naive"], attention[seq]["flash"]
        v[f"flash_{seq}_ratio"] = round(attention[seq]["naive"] / attention[seq]["flash"])
        claim(v[f"flash_{seq}"] == (4 * 4 * 16 * 4 + 4 * 4) * seq, f"at s {seq} too FlashAttention keeps only q, k, v, "
                                                                    f"out and the lse: linear in s")
    claim(v["flash_4096_naive"] / v["flash_naive_bytes"] > 50,
          "the written-out attention grows with s squared (8 x the length, over 50 x the bytes)")
    loss = {row["vocab"]: row for row in kernels["loss_bytes"]}
    for vocab, key in ((257, "257"), (128256, "128k")):
        v[f"loss_{key}_unfused"], v[f"loss_{key}_fused"] = loss[vocab]["unfused"], loss[vocab]["fused"]
    claim(v["loss_128k_fused"] == v["loss_257_fused"] == 64 * 12, "the fused loss keeps 12 bytes a token at any V")
    claim(v["loss_128k_unfused"] >= 64 * 128256 * 4, "the unfused one keeps the [T, V] float32 log-probabilities")
    v.update(measure_speed(results))
    v.update(measure_overlap(results))
    claim(v["hf_256_eager"] * v["hf_256_bound"] < 1.3, "fusing everything but the GEMMs and attention stays under 1.3x")
    return v


def measure_packing(packing: dict) -> dict[str, float]:
    """§5's numbers: bench_packing.py's counts of the corpus's rows and tiles, and its speed-up."""
    c, tiles = packing["counts"], packing["tiles"]
    v = {"pack_docs": c["documents"], "pack_median": round(c["median_length"]), "pack_padded_rows": c["padded_rows"],
         "pack_padding": round(100 * c["padding"], 1), "pack_packed_rows": c["packed_rows"],
         "pack_rows_ratio": round(c["padded_rows"] / c["packed_rows"], 2),
         "pack_speedup": round(packing["rates"]["packed"] / packing["rates"]["padded"], 2),
         "tiles_rows": tiles["rows"], "tiles_causal": tiles["causal"], "tiles_documents": tiles["documents"],
         "tiles_skipped": round(100 * (1 - tiles["documents"] / tiles["causal"]), 1)}
    claim(v["pack_speedup"] > 1, "packed rows get through more real tokens per second than padded ones")
    claim(v["tiles_documents"] < v["tiles_causal"], "the document bounds skip tiles on the corpus's packed rows")
    return v


def measure_overlap(results: dict[str, dict]) -> dict[str, float]:
    """§8's numbers: bench_ddp.py's speed-ups over one rank and blocked shares at 2 ranks,
    bench_overlap.py's rows, and the timeline of the figure."""
    v = {}
    for row in results["overlap"]["rows"]:
        if row["ranks"] == 2:
            key = row["variant"].replace("-", "_")
            v[f"overlap_{key}_speedup"] = round(row["speedup"], 2)
            v[f"overlap_{key}_blocked"] = round(100 * row["comm"])
    claim(v["overlap_zero1_overlap_speedup"] > v["overlap_zero1_speedup"], "the overlaps make ZeRO-1 faster")
    claim(v["overlap_zero2_overlap_speedup"] > v["overlap_zero2_speedup"], "the overlaps make ZeRO-2 faster")
    for row in results["overlap-tp-pp"]["rows"]:
        key = row["variant"].replace("-", "_")
        v[f"{key}_ms"], v[f"{key}_median"] = round(row["ms_best"], 1), round(row["median"])
        if row["ratio"] is not None:
            v[f"{key}_ratio"] = round(row["ratio"], 3)
        if row["waits"]:
            v[f"{key}_wait0"], v[f"{key}_wait1"] = (round(100 * w, 1) for w in row["waits"])
    for key in ("sp", "pp"):
        v[f"{key}_overlap_median_ratio"] = round(v[f"{key}_overlap_median"] / v[f"{key}_median"], 2)
    timeline = results["figures"]["timeline"]
    v["timeline_launched"], v["timeline_buckets"] = timeline["launched"], timeline["buckets"]
    v["timeline_blocked_ms"], v["timeline_step_ms"] = round(timeline["blocked_ms"], 1), round(timeline["step_ms"], 1)
    return v


def measure_speed(results: dict[str, dict]) -> dict[str, float]:
    """§7's numbers: the case study's profiles and step times, and the comparison with
    transformers."""
    v = {}
    for preset, case in results["case-study"]["presets"].items():
        for key, name in (("base", "baseline"), ("both", "both")):
            profile = case["profiles"][name]
            v[f"case_{preset}_{key}_calls"] = round(profile["calls"])
            v[f"case_{preset}_{key}_gemm"] = float(round(100 * profile["gemm"]))
            v[f"case_{preset}_{key}_optimizer"] = float(round(100 * profile["optimizer"]))
        for key, name in (("base", "baseline"), ("fused", "fused AdamW"), ("compiled", "compiled layers"),
                          ("both", "both")):
            v[f"case_{preset}_{key}_ms"] = round(case["median_ms"][name], 2)
            v[f"case_{preset}_{key}_x"] = round(case["speedup"][name], 2)
    v["case_demo_compile_s"] = round(results["case-study"]["presets"]["demo"]["built_s"]["compiled layers"], 1)
    claim(v["case_demo_fused_x"] < 1.1, "the demo preset's fused AdamW alone is within the noise")
    claim(v["case_tiny_both_x"] >= 1.2, "the profile-guided changes make the default command's step at least 20% faster")
    claim(v["case_demo_both_x"] > 1.0, "they make the demo preset's step faster too")
    claim(v["case_demo_base_gemm"] > v["case_tiny_base_gemm"], "the larger preset's step is more matrix products")
    for run in results["vs-hf"]["seqs"]:
        seq, (eager, compiled, _), shares = run["seq"], run["pairs"], run["shares"]
        v[f"hf_{seq}_eager"] = round(eager["ratio_median"], 2)
        v[f"hf_{seq}_compiled"] = round(compiled["ratio_median"], 2)
        v[f"hf_{seq}_compile_speedup"] = round(run["compile_speedup"]["minimegatron"], 2)
        v[f"hf_{seq}_gemm"], v[f"hf_{seq}_attention"] = round(100 * shares["gemm"]), round(100 * shares["attention"])
        v[f"hf_{seq}_bound"] = round(1 / (1 - shares["rest"]), 2)
    return v


if __name__ == "__main__":
    sys.exit(main().exit_code)
