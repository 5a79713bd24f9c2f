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

import re
import sys
from pathlib import Path

import torch

from booktools.measured import RoundOff, claim, grab
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


def main() -> int:
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
                    return 1
            print(f"  {name:<22}" + "  ".join(f"s {s}: {m:>12,.0f}" for s, (m, _) in zip(LENGTHS, points)))
            ax.plot(LENGTHS, [f / 2**20 for _, f in points], color=colour(i, len(CASES)), label=f"{name} (formula)")
            ax.scatter(LENGTHS, [m / 2**20 for m, _ in points], color=colour(i, len(CASES)), zorder=3)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length s")
        ax.set_ylabel("MiB one layer keeps for the backward")
        ax.set_title(f"{backend} attention" + (" (the [s, s] scores)" if backend == "naive" else " (flash kernel)"))
        ax.legend(fontsize=8)
    finish_figure(fig, OUT / "recompute_memory.png")
    print(f"wrote {OUT / 'recompute_memory.png'}")
    if tp_memory_table():
        return 1
    return draw_zero_timeline()


def tp_memory_table() -> int:
    """2 ranks: what one micro-batch keeps on a tensor-parallel rank (tp 2, with and without SP)
    for each recompute, measured (testing.saved_activation_bytes_per_rank) against
    analysis.activation_memory, per layer beside Korthikanti et al.'s. Returns 1 on a mismatch."""
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
    for i, (label, name, model, train) in enumerate(cases):
        formula = activation_memory(model, b, s, tp=2, sequence_parallel=train.sequence_parallel, **CASES[name])
        korthikanti = korthikanti_per_layer(name, model, b, s, 2, train.sequence_parallel)
        ranks = sorted({rank[i] for rank in measured})
        if ranks != [formula["total"]]:
            print(f"MISMATCH: {label}: measured {ranks}, activation_memory {formula['total']:,}", file=sys.stderr)
            return 1
        layer = formula["layers"] // model.num_layers
        print(f"  {label:<34} {ranks[0]:>11,} bytes measured = formula; per layer {layer:>9,} "
              f"(Korthikanti {korthikanti:>9,})")
    return 0


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


def draw_zero_timeline() -> int:
    """zero1_overlap_timeline.png: rank 0's step of median length."""
    from booktools.demo import import_chapter
    from minimegatron.launch import spawn
    recorded = spawn(zero_timeline_rank, 2, timeout=300)[0]
    timeline = sorted(recorded, key=lambda t: t.sync_end)[len(recorded) // 2]
    print(f"ZeRO-1 with --overlap-grad-reduce on 2 ranks, rank 0's median step of {len(recorded)}:")
    print(timeline.table())
    print(f"reduce-scatters launched during the backward: {len(timeline.launched_during_backward())} of "
          f"{len(timeline.buckets)}; blocked in finish_grad_sync {1e3 * (timeline.sync_end - timeline.sync_start):.1f} "
          f"ms of {1e3 * timeline.sync_end:.1f} ms")
    plot = import_chapter("01", "make_figures").plot_bucket_timeline
    plot(timeline, OUT / "zero1_overlap_timeline.png", collective="reduce-scatter",
         title=f"ZeRO-1 on 2 ranks, --overlap-grad-reduce: {len(timeline.buckets)} buckets' reduce-scatters")
    print(f"wrote {OUT / 'zero1_overlap_timeline.png'}")
    return 0


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
            claim(outputs[run_id][-1].startswith("MATCH"), f"{run_id} matches")
    demo, figures = outputs["demo"], outputs["figures"]
    for key, name in (("none", "none"), ("selective", "selective core_attn"), ("full", "full, uniform 1")):
        pattern = rf"^  {name} +([\d,]+) bytes measured = formula +[\d,]+; per layer +([\d,]+) \(Korthikanti +([\d,]+)\)"
        v[f"mem_{key}"] = grab(demo, pattern, 1)
        v[f"mem_{key}_layer"] = grab(demo, pattern, 2)
        v[f"mem_{key}_korthikanti"] = grab(demo, pattern, 3)
    v["mem_selective_fraction"] = grab(demo, r"selective keeps ([\d.]+) of it")
    v["mem_full_fraction"] = grab(demo, r"and full ([\d.]+)$")
    v["none_over_korthikanti"] = v["mem_none_layer"] / v["mem_none_korthikanti"]
    claim(v["mem_full_layer"] == v["mem_full_korthikanti"], "full recompute keeps Korthikanti's 2 s b h a layer")
    for key, name in (("none", "none"), ("selective", "selective core_attn"), ("full", "full, uniform 1")):
        v[f"time_{key}_ratio"] = grab(demo, rf"^  {name} +[\d.]+ ms a forward and backward, ([\d.]+) x")
    v["demo_tp_calls"] = grab(demo, r"^  tp +(\d+) calls")
    for backend in ("naive", "sdpa"):
        block = "\n".join(figures[figures.index(next(l for l in figures if l.startswith(backend))):])
        for key, name in (("none", "none"), ("selective", r"selective \(core_attn\)"), ("full", "full")):
            v[f"fig_{backend}_{key}_1024"] = grab(block, rf"^  {name} +.*s 1024: +([\d,]+)")
    claim(v["fig_sdpa_selective_1024"] / v["fig_sdpa_none_1024"] > 0.95,
          "with the fused attention, core_attn recompute saves almost nothing")
    claim(v["fig_naive_selective_1024"] / v["fig_naive_none_1024"] < 0.2,
          "with the naive attention at s 1024, core_attn recompute keeps less than a fifth")
    for sp, layout_key in (("     ", "tp2"), (" + SP", "tp2sp")):
        for key, name in (("none", "none"), ("selective", r"selective \(core_attn\)"), ("full", "full")):
            row = (rf"^  tp 2{re.escape(sp)}  {name} +[\d,]+ bytes measured = formula; per layer +([\d,]+) "
                   rf"\(Korthikanti +([\d,]+)\)")
            v[f"{layout_key}_{key}_layer"] = grab(figures, row, 1)
            v[f"{layout_key}_{key}_korthikanti"] = grab(figures, row, 2)
    claim(v["tp2sp_full_layer"] == v["tp2sp_full_korthikanti"], "full recompute under SP keeps Korthikanti's 2sbh/t")
    v["cp_recompute_calls"] = grab(outputs["selective-sp-cp"], r"^  cp +(\d+) calls")
    v["pack_alone"] = RoundOff(grab(outputs["pack"], r"to each document alone ([\d.e+-]+)"))       # float64 round-off
    v["pack_mixed"] = grab(outputs["pack"], r"without the switches ([\d.e+-]+)\)")
    packing = outputs["packing"]
    v["pack_docs"] = grab(packing, r"split, byte tokens\): (\d+) documents")
    v["pack_median"] = grab(packing, r"median length (\d+)")
    v["pack_padded_rows"] = grab(packing, r"padded ([\d,]+) rows")
    v["pack_padding"] = grab(packing, r"rows \(([\d.]+)% of their tokens padding\)")
    v["pack_packed_rows"] = grab(packing, r"packed ([\d,]+) rows:")
    v["pack_rows_ratio"] = grab(packing, r"([\d.]+) x fewer rows packed")
    v["pack_speedup"] = grab(packing, r"packed / padded: ([\d.]+) x")
    claim(v["pack_speedup"] > 1, "packed rows get through more real tokens per second than padded ones")
    v["tiles_rows"] = grab(packing, r"score tiles over the ([\d,]+) packed rows")
    v["tiles_causal"] = grab(packing, r"per head: causal ([\d,]+)")
    v["tiles_documents"] = grab(packing, r"within documents ([\d,]+)")
    v["tiles_skipped"] = grab(packing, r"within documents [\d,]+ \(([\d.]+)% skipped\)")
    claim(v["tiles_documents"] < v["tiles_causal"], "the document bounds skip tiles on the corpus's packed rows")
    kernels = outputs["kernels"]
    errors = [float(x) for x in __import__("re").findall(r"max \|difference\| ([\d.e+-]+)", "\n".join(kernels))]
    v["kernel_max_error"] = RoundOff(max(errors))                  # float32 round-off
    claim(len(errors) == 9, "nine kernel outputs and gradients are checked")
    v["flash_naive_bytes"] = grab(kernels, r"keeps ([\d,]+) bytes for its backward written out")
    v["flash_bytes"] = grab(kernels, r"written out, ([\d,]+) as FlashAttention-2")
    claim(v["flash_bytes"] == 4 * 4 * 512 * 16 * 4 + 4 * 512 * 4, "FlashAttention keeps q, k, v, out and the lse only")
    for seq in (1024, 2048, 4096):
        row = rf"^    s +{seq}: written out +([\d,]+) bytes, FlashAttention-2 +([\d,]+) \((\d+) x less\)"
        v[f"flash_{seq}_naive"], v[f"flash_{seq}"] = grab(kernels, row, 1), grab(kernels, row, 2)
        v[f"flash_{seq}_ratio"] = grab(kernels, row, 3)
        claim(v[f"flash_{seq}"] == (4 * 4 * 16 * 4 + 4 * 4) * seq, f"at s {seq} too FlashAttention keeps only q, k, v, "
                                                                    f"out and the lse: linear in s")
    claim(v["flash_4096_naive"] / v["flash_naive_bytes"] > 50,
          "the written-out attention grows with s squared (8 x the length, over 50 x the bytes)")
    for vocab, key in ((257, "257"), (128256, "128k")):
        row = rf"over 64 tokens at V {vocab:,}: unfused keeps ([\d,]+) bytes, fused ([\d,]+)"
        v[f"loss_{key}_unfused"], v[f"loss_{key}_fused"] = grab(kernels, row, 1), grab(kernels, row, 2)
    claim(v["loss_128k_fused"] == v["loss_257_fused"] == 64 * 12, "the fused loss keeps 12 bytes a token at any V")
    claim(v["loss_128k_unfused"] >= 64 * 128256 * 4, "the unfused one keeps the [T, V] float32 log-probabilities")
    v.update(measure_speed(outputs))
    v.update(measure_overlap(outputs))
    claim(v["hf_256_eager"] * v["hf_256_bound"] < 1.3, "fusing everything but the GEMMs and attention stays under 1.3x")
    return v


def measure_overlap(outputs: dict[str, list[str]]) -> dict[str, float]:
    """§8's numbers: bench_ddp.py's speed-ups over one rank and blocked shares at 2 ranks, and the
    timeline of the figure."""
    v = {}
    for variant in ("ddp", "zero1", "zero1-overlap", "zero2", "zero2-overlap"):
        key = variant.replace("-", "_")
        row = rf"^\| 2 \| {variant} \| ([\d,]+) \| [\d,]+ \| [\d,]+ \| ([\d.]+) \| ([\d.]+)× \| (\d+)% \|"
        v[f"overlap_{key}_speedup"] = grab(outputs["overlap"], row, 3)
        v[f"overlap_{key}_blocked"] = grab(outputs["overlap"], row, 4)
    claim(v["overlap_zero1_overlap_speedup"] > v["overlap_zero1_speedup"], "the overlaps make ZeRO-1 faster")
    claim(v["overlap_zero2_overlap_speedup"] > v["overlap_zero2_speedup"], "the overlaps make ZeRO-2 faster")
    tp_pp = outputs["overlap-tp-pp"]
    for variant in ("sp", "sp-overlap", "pp", "pp-overlap"):
        key = variant.replace("-", "_")
        row = rf"^\| {variant} \| ([\d,]+) \| [\d,]+ \| [\d,]+ \| ([\d.]+) \| (-|[\d.]+×) \| (-|[\d.]+%, [\d.]+%) \|"
        v[f"{key}_ms"] = grab(tp_pp, row, 2)
        v[f"{key}_median"] = grab(tp_pp, rf"^\| {variant} \| [\d,]+ \| ([\d,]+) \|")
        if variant.endswith("-overlap"):
            v[f"{key}_ratio"] = grab(tp_pp, rf"^\| {variant} \| .* \| ([\d.]+)× \|")
        if variant.startswith("pp"):
            v[f"{key}_wait0"] = grab(tp_pp, rf"^\| {variant} \| .* \| ([\d.]+)%, [\d.]+% \|$")
            v[f"{key}_wait1"] = grab(tp_pp, rf"^\| {variant} \| .* \| [\d.]+%, ([\d.]+)% \|$")
    for key in ("sp", "pp"):
        v[f"{key}_overlap_median_ratio"] = round(v[f"{key}_overlap_median"] / v[f"{key}_median"], 2)
    figures = outputs["figures"]
    v["timeline_launched"] = grab(figures, r"reduce-scatters launched during the backward: (\d+) of")
    v["timeline_buckets"] = grab(figures, r"reduce-scatters launched during the backward: \d+ of (\d+)")
    v["timeline_blocked_ms"] = grab(figures, r"blocked in finish_grad_sync ([\d.]+) ms of")
    v["timeline_step_ms"] = grab(figures, r"blocked in finish_grad_sync [\d.]+ ms of ([\d.]+) ms")
    return v


def measure_speed(outputs: dict[str, list[str]]) -> dict[str, float]:
    """§7's numbers: the case study's profiles and step times, and the comparison with
    transformers."""
    v = {}
    case = outputs["case-study"]
    for preset in ("tiny", "demo"):
        block = "\n".join(case[case.index(next(l for l in case if l.startswith(f"== --preset {preset} "))):])
        block = block.split("\n== ")[0]                                  # this preset's lines only
        for key, name in (("base", "baseline"), ("both", "both")):
            v[f"case_{preset}_{key}_calls"] = grab(block, rf"^\[profile\] {name}: .* a step, ([\d,]+) operator calls")
        for key, name in (("base", "baseline"), ("fused", "fused AdamW"), ("compiled", "compiled layers"),
                          ("both", "both")):
            v[f"case_{preset}_{key}_ms"] = grab(block, rf"^  {name} +([\d.]+) ms")
            v[f"case_{preset}_{key}_x"] = grab(block, rf"^  {name} +[\d.]+ ms +\( *[\d.]+ ms\) +([\d.]+) x the baseline")
        shares = __import__("re").findall(r"matrix products (\d+)% of the time, the optimizer's step (\d+)%", block)
        claim(len(shares) == 2, "two profiles a preset")
        for key, (gemm, optimizer) in zip(("base", "both"), shares):
            v[f"case_{preset}_{key}_gemm"], v[f"case_{preset}_{key}_optimizer"] = float(gemm), float(optimizer)
    v["case_demo_compile_s"] = grab("\n".join(case).split("== --preset demo")[1],
                                    r"built and warmed up compiled layers +in +([\d.]+) s")
    claim(v["case_demo_fused_x"] < 1.1, "the demo preset's fused AdamW alone is within the noise")
    claim(v["case_tiny_both_x"] >= 1.2, "the profile-guided changes make the default command's step at least 20% faster")
    claim(v["case_demo_both_x"] > 1.0, "they make the demo preset's step faster too")
    claim(v["case_demo_base_gemm"] > v["case_tiny_base_gemm"], "the larger preset's step is more matrix products")
    hf = outputs["vs-hf"]
    for seq in (256, 1024):
        block = "\n".join(hf[hf.index(next(l for l in hf if l.startswith(f"== LLaMA") and f"s={seq} " in l)):])
        v[f"hf_{seq}_eager"] = grab(block, r"ratio minimegatron / transformers: ([\d.]+)x")
        v[f"hf_{seq}_compiled"] = grab(block, r"ratio minimegatron \(compiled\) / transformers: ([\d.]+)x")
        v[f"hf_{seq}_compile_speedup"] = grab(block, r"speed-up \(median windows\): minimegatron ([\d.]+)x")
        v[f"hf_{seq}_gemm"] = grab(block, r"matrix products (\d+)%")
        v[f"hf_{seq}_attention"] = grab(block, r"the attention kernel (\d+)%")
        v[f"hf_{seq}_bound"] = grab(block, r"at most ([\d.]+)x faster")
    return v


if __name__ == "__main__":
    sys.exit(main())
