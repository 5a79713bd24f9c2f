"""The figures of chapter 04 and the numbers the chapter quotes.

    python chapters/04_sp_cp/make_figures.py        # a minute or a few on 2 cores; writes figures/*.png
    python chapters/04_sp_cp/make_figures.py --formulas-only   # seconds: the first three figures only
    make numbers CH=04          # reruns RUNS (this script and the demo commands the chapter quotes),
                                # records their printouts and measure()'s values in measured.json

From the formulas alone (no process started):
  sp_regions.png     one layer under sequence parallelism: its sequence-parallel and
                     tensor-parallel regions and the collectives between them (a diagram)
  load_balance.png   unmasked causal scores per cp rank (cp.causal_work_per_rank), contiguous
                     against zig-zag, cp = 2, 4, 8 at s = 4096; checked against the closed forms
                     of the chapter's section 5, with c = s/(2cp) one chunk: W_r = 2 c^2 (2r + 1) + c
                     (contiguous) and c^2 (2cp - 1) + c (c + 1) (zig-zag), and the sum s (s + 1) / 2
  cp_comm_types.png  bytes each rank sends per attention layer, forward and backward, and the
                     communication steps (a collective call or a ring hop, a send with its
                     receive), for the four cp_comm_types and cp = 2, 4, 8, from the
                     demo's expected_ledger (its message list, which the demo checks against
                     the ledger of real runs) turned into bytes on the wire with comm.ring_traffic;
                     checked against the closed forms of the chapter's section 6.4
Measured (saved-tensor hooks, analysis.measure_saved_activation_bytes; spawned gloo worlds of
2 and 4 ranks built by parallelize.build_model, as the training loop builds them):
  activations.png    left: the GPT-2 style tiny model (float64, b 2, s 64), bytes one rank saves
                     for one micro-batch under TP and TP + SP, tp = 1, 2, 4, as a fraction of
                     the single device, with 1/tp and Korthikanti et al.'s ratios for its shapes;
                     right: the LLaMA style tiny model (float32, b 1, s 4096, sdpa) under CP,
                     cp = 1, 2, 4, per rank against the single device / cp
It also prints the attention memory of the naive core against the flash (sdpa) core at s = 1024
on one device, and the same under cp = 2 (the CP attention recomputes its scores with either
backend). It stops with an error (exit 1) if a number differs from its closed form, or a
measured fraction is further than the stated margin from the ideal cut.

RUNS and measure() at the end are the chapter's record (booktools/measured.py): every number the
README and the notebook's markdown quote, read off these printouts or computed with the same
functions, by the key of its <!--m:key--> marker.
"""

from __future__ import annotations

import importlib
import os
import shlex
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from booktools.demo import import_chapter
from booktools.measured import RoundOff, claim
from minimegatron import comm
from minimegatron.analysis.activations import korthikanti_activation_memory, measure_saved_activation_bytes
from minimegatron.analysis.communication import context_parallel_messages
from minimegatron.config import ConfigError, ModelConfig
from minimegatron.cp import (block_pairs, causal_work_per_rank, cp_chunk_ids, get_batch_on_this_cp_rank,
                             merge_attention)
from minimegatron.cp.attention import hierarchical_sizes
from minimegatron.launch import spawn
from minimegatron.model import GPTModel
from minimegatron.parallel_state import rank_groups
from minimegatron.parallelize import build_model, unwrap
from minimegatron.pp import stage_layers
from minimegatron.resume import initialize_layout
from minimegatron.viz import colour, finish_figure, new_figure

ch04 = import_chapter("04")        # chapters/04_sp_cp/demo.py: the runs and their formulas

OUT = Path(__file__).resolve().parent / "figures"
SEQ = 4096
CP_SIZES = (2, 4, 8)


def fail(message: str) -> None:
    print(f"MISMATCH: {message}", file=sys.stderr)
    raise SystemExit(1)


# ---------------------------------------------------------------------------------------
# 1. load balance (formulas)
# ---------------------------------------------------------------------------------------
def load_balance_section() -> None:
    print(f"== causal attention work per cp rank, s = {SEQ} (unmasked score entries per head and sequence)")
    work = {}
    for cp in CP_SIZES:
        contiguous, zigzag = causal_work_per_rank(SEQ, cp, False), causal_work_per_rank(SEQ, cp, True)
        c = SEQ // (2 * cp)                                                       # one chunk
        want_contiguous = [2 * c * c * (2 * r + 1) + c for r in range(cp)]      # 2 c^2 (2r + 1) + c
        want_zigzag = [c * c * (2 * cp - 1) + c * (c + 1)] * cp
        if contiguous != want_contiguous or zigzag != want_zigzag:
            fail(f"cp={cp}: causal_work_per_rank {contiguous} / {zigzag}, "
                 f"closed forms {want_contiguous} / {want_zigzag}")
        for name, w in (("contiguous", contiguous), ("zig-zag", zigzag)):
            if sum(w) != SEQ * (SEQ + 1) // 2:
                fail(f"cp={cp} {name}: total {sum(w)} != s (s + 1) / 2 = {SEQ * (SEQ + 1) // 2}")
        ratio = max(contiguous) / (sum(contiguous) / cp)
        formula = (4 * cp * c - 2 * c + 1) / (2 * cp * c + 1)
        if abs(ratio - formula) > 1e-12:
            fail(f"cp={cp}: contiguous max/mean {ratio}, formula {formula}")
        print(f"  cp={cp}: contiguous max/mean {ratio:.5f} (limit 2 - 1/cp = {2 - 1 / cp:.5f}), first/last "
              f"{contiguous[0] / contiguous[-1]:.4f}; zig-zag {max(zigzag) / (sum(zigzag) / cp):.5f}")
        demo = ch04.load_balance((cp,), SEQ)[0]
        if abs(demo[1] - ratio) > 1e-12 or demo[2] != 1.0:
            fail(f"cp={cp}: the demo's load_balance {demo} differs")
        work[cp] = {"contiguous": contiguous, "zig-zag": zigzag}
    plot_cp_load_balance(work, OUT / "load_balance.png",
                         title=f"causal attention work per rank, s = {SEQ}: contiguous split vs zig-zag")


# ---------------------------------------------------------------------------------------
# 2. the four cp_comm_types (formulas)
# ---------------------------------------------------------------------------------------
def comm_model():
    """MHA-free GQA shapes that let every comm type run up to cp = 8: a = 16, g = 8, d = 4."""
    return ch04.tiny_model("llama", "float32", hidden_size=64, num_attention_heads=16, num_query_groups=8,
                           max_position_embeddings=64)


def cp_layer_traffic(comm_type: str, cp: int, seq: int = 64) -> dict:
    """Bytes one rank sends per attention layer and micro-batch (ring algorithms for the
    collectives, comm.ring_traffic), forward and backward, and the number of communication
    steps (a collective call, or a ring hop: its send, the recv being the other end), from the
    formula the demo checks (analysis.context_parallel_messages, which expected_ledger uses)."""
    run = ch04.make_run(comm_model(), cp=cp, cp_comm_type=comm_type, seq=seq, micro_batch_size=1, micro_batches=1)
    cfg, e = run.model, 4
    local = seq // cp                       # the rank's s/cp tokens, two chunks
    kv = local * cfg.query_groups * cfg.kv_channels * e
    q = local * cfg.num_attention_heads * cfg.kv_channels * e
    calls = context_parallel_messages(cfg, run.train)
    a2a = hierarchical_sizes(cp, comm_type)[0] if comm_type == "a2a+p2p" else cp
    out = {"fwd": 0.0, "bwd": 0.0, "steps": 0, "kv": kv, "q": q, "x": seq * cfg.hidden_size * e}
    for (op, tag, nbytes), count in calls.items():
        if op == "recv":
            continue                        # a recv is the other end of a send: one step per hop
        n = a2a if op == "all_to_all" else cp
        out["fwd" if tag == "fwd" else "bwd"] += count * comm.ring_traffic(
            comm.CommRecord(op, tuple(range(n)), nbytes, None, ()))
        out["steps"] += count
    # the expected_ledger of the whole run holds exactly these messages per layer and micro-batch
    ledger = ch04.expected_ledger(run)
    per_layer = {k: v // cfg.num_layers for k, v in ledger.items()}
    if calls != Counter(per_layer):
        fail(f"{comm_type} cp={cp}: context_parallel_messages {calls} is not expected_ledger / layers {per_layer}")
    return out


def closed_form(comm_type: str, cp: int, kv: int, q: int) -> tuple[float, float, int]:
    """Section 6.4's table: forward bytes, backward bytes, communication steps per layer (fwd + bwd)."""
    if comm_type == "p2p":
        return 2 * (cp - 1) * kv, 4 * (cp - 1) * kv, 2 * (cp - 1)
    if comm_type == "all_gather":
        return 2 * (cp - 1) * kv, 2 * (cp - 1) * kv + 2 * (cp - 1) * kv, 6
    a, p = (cp, 1) if comm_type == "a2a" else hierarchical_sizes(cp, comm_type)
    a2a = (a - 1) / a * (2 * q + 2 * kv)
    return a2a + 2 * (p - 1) * kv, a2a + 4 * (p - 1) * kv, 8 + 2 * (p - 1)


def comm_types_section() -> None:
    cfg = comm_model()
    print(f"\n== cp_comm_types: bytes sent per rank and attention layer, in units of b s h e (the whole [b, s, h] "
          f"activation); a = {cfg.num_attention_heads}, g = {cfg.query_groups}, d = {cfg.kv_channels}, h = "
          f"{cfg.hidden_size}; a2a+p2p with all-to-all groups of 2")
    rows = {}
    for comm_type in ch04.CP_COMM_TYPES:
        rows[comm_type] = {}
        for cp in CP_SIZES:
            got = cp_layer_traffic(comm_type, cp)
            want = closed_form(comm_type, cp, got["kv"], got["q"])
            if abs(got["fwd"] - want[0]) > 1e-6 or abs(got["bwd"] - want[1]) > 1e-6 or got["steps"] != want[2]:
                fail(f"{comm_type} cp={cp}: from the ledger formulas {got}, section 6.4 {want}")
            x = got["x"]
            rows[comm_type][cp] = {"fwd": got["fwd"] / x, "bwd": got["bwd"] / x, "steps": got["steps"]}
            print(f"  {comm_type:<10} cp={cp}: forward {got['fwd'] / x:.4f}, backward {got['bwd'] / x:.4f} b s h e; "
                  f"{got['steps']} communication steps")
    plot_cp_comm_types(rows, OUT / "cp_comm_types.png", unit="b s h e",
                       title=f"per attention layer and rank, from the demo's expected_ledger "
                             f"(a = {cfg.num_attention_heads}, "
                             f"g = {cfg.query_groups}, h = {cfg.hidden_size}; a2a+p2p: [2, cp/2])")


# ---------------------------------------------------------------------------------------
# 3. activation memory (measured)
# ---------------------------------------------------------------------------------------
def saved_bytes_on_rank(model_cfg, train, tokens: torch.Tensor, labels: torch.Tensor) -> dict:
    """Spawn target: build this rank's model as the training loop does (parallelize.build_model)
    and return {"tp_rank", "cp_rank", "saved": bytes autograd saves for the micro-batch
    (tokens, labels) cut to this rank's tokens, "saved_without_sp": the same model built
    without sequence parallelism (tp > 1), else None}."""
    from minimegatron.config import TrainConfig

    layout = initialize_layout(train)
    batch = get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels}, layout.cp, layout.cp_rank)
    out = {"tp_rank": layout.tp_rank, "cp_rank": layout.cp_rank, "saved_without_sp": None}
    model = unwrap(build_model(model_cfg, train, layout)[0])
    out["saved"] = measure_saved_activation_bytes(model, batch["tokens"], batch["labels"], batch["position_ids"])
    if layout.tp > 1 and train.sequence_parallel:
        plain = TrainConfig(**{**train.__dict__, "sequence_parallel": False})
        model = unwrap(build_model(model_cfg, plain, layout)[0])
        out["saved_without_sp"] = measure_saved_activation_bytes(model, batch["tokens"], batch["labels"],
                                                                 batch["position_ids"])
    return out


def random_batch(cfg, b: int, s: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g)
    return ids[:, :-1].clone(), ids[:, 1:].clone()


def ratio_korthikanti(cfg, b: int, s: int, t: int, sp: bool) -> float:
    return (korthikanti_activation_memory(cfg, b, s, tp=t, sequence_parallel=sp)["per_layer"]
            / korthikanti_activation_memory(cfg, b, s)["per_layer"])


def tp_memory_section(me, found: dict) -> dict:
    cfg, b, s = ch04.tiny_model("gpt2", "float64"), 2, 64
    tokens, labels = random_batch(cfg, b, s)
    single = measure_saved_activation_bytes(GPTModel(cfg), tokens, labels)
    print(f"\n== activations saved for one micro-batch (GPT-2 style tiny model, float64, b = {b}, s = {s}, "
          f"no dropout); "
          f"single device {single:,} bytes")
    panel = {"tp": [1], "measured_tp": [1.0], "measured_sp": [1.0], "korthikanti_tp": [1.0], "korthikanti_sp": [1.0],
             "label": f"TP and TP + SP (GPT-2 style tiny model, s = {s})"}
    found["single"] = single
    for tp in (2, 4):
        run = ch04.make_run(cfg, tp=tp, sp=True, seq=s, micro_batch_size=b, micro_batches=1)
        per_rank = spawn(me.saved_bytes_on_rank, tp, cfg, run.train, tokens, labels, timeout=300)
        sp_bytes, tp_bytes = per_rank[0]["saved"], per_rank[0]["saved_without_sp"]
        if len({r["saved"] for r in per_rank}) != 1:
            fail(f"tp={tp}: the ranks save different bytes {[r['saved'] for r in per_rank]}")
        k_tp, k_sp = ratio_korthikanti(cfg, b, s, tp, False), ratio_korthikanti(cfg, b, s, tp, True)
        print(f"  tp={tp}: TP {tp_bytes:,} B ({tp_bytes / single:.3f} of one device), TP+SP {sp_bytes:,} B "
              f"({sp_bytes / single:.3f}; 1/tp = {1 / tp:.3f}); SP saves {1 - sp_bytes / tp_bytes:.1%}. "
              f"Korthikanti's ratios for these shapes: TP {k_tp:.3f}, TP+SP {k_sp:.3f}")
        if not sp_bytes < tp_bytes < single:
            fail(f"tp={tp}: expected TP+SP < TP < one device, got {sp_bytes}, {tp_bytes}, {single}")
        if abs(sp_bytes / single - 1 / tp) > 0.02:
            fail(f"tp={tp}: TP+SP saves {sp_bytes / single:.4f} of one device, not 1/tp = {1 / tp:.4f} (margin 0.02)")
        found |= {f"tp{tp}": tp_bytes, f"tp{tp}_sp": sp_bytes}
        for key, value in (("tp", tp), ("measured_tp", tp_bytes / single), ("measured_sp", sp_bytes / single),
                           ("korthikanti_tp", k_tp), ("korthikanti_sp", k_sp)):
            panel[key].append(value)
    return panel


def cp_memory_section(me) -> dict:
    cfg, b = ch04.tiny_model("llama", "float32", max_position_embeddings=SEQ), 1
    tokens, labels = random_batch(cfg, b, SEQ)
    single = measure_saved_activation_bytes(GPTModel(cfg), tokens, labels)
    print(f"\n== CP at s = {SEQ} (LLaMA style tiny model, float32, b = 1, sdpa): single device {single:,} bytes")
    panel = {"cp": [1], "measured": [single], "single": single,
             "label": f"CP at s = {SEQ} (LLaMA style tiny model, float32)"}
    for cp in (2, 4):
        run = ch04.make_run(cfg, cp=cp, seq=SEQ, micro_batch_size=b, micro_batches=1)
        per_rank = spawn(me.saved_bytes_on_rank, cp, cfg, run.train, tokens, labels, timeout=300)
        saved = [r["saved"] for r in per_rank]
        print(f"  cp={cp}: per rank {saved[0]:,} B = 1/{single / saved[0]:.3f} of one device (1/cp = 1/{cp})")
        if len(set(saved)) != 1:
            fail(f"cp={cp}: the ranks save different bytes {saved}")
        if abs(saved[0] * cp / single - 1) > 0.05:
            fail(f"cp={cp}: {saved[0]} bytes per rank, not within 5% of one device / cp = {single / cp:.0f}")
        panel["cp"].append(cp)
        panel["measured"].append(saved[0])
    return panel


def naive_vs_sdpa_section(me) -> dict:
    s, b = 1024, 1
    print(f"\n== the attention core's saved bytes, naive against sdpa (flash), s = {s}, float32, b = 1")
    results = {}
    for backend in ("naive", "sdpa"):
        cfg = ch04.tiny_model("llama", "float32", max_position_embeddings=s, attention_backend=backend)
        tokens, labels = random_batch(cfg, b, s)
        one = measure_saved_activation_bytes(GPTModel(cfg), tokens, labels)
        run = ch04.make_run(cfg, cp=2, seq=s, micro_batch_size=b, micro_batches=1)
        two = spawn(me.saved_bytes_on_rank, 2, cfg, run.train, tokens, labels, timeout=300)[0]["saved"]
        results[backend] = (one, two)
    (n1, n2), (f1, f2) = results["naive"], results["sdpa"]
    cfg = ch04.tiny_model("llama", "float32")
    scores = cfg.num_layers * b * cfg.num_attention_heads * s * s * 4       # one fp32 [b, a, s, s] per layer
    print(f"  one device: naive {n1:,} B, sdpa {f1:,} B, difference {n1 - f1:,} B = "
          f"{(n1 - f1) / scores:.2f} x L b a s^2 x 4 bytes")
    print(f"  cp = 2, per rank: naive {n2:,} B, sdpa {f2:,} B (the CP attention saves q, out, lse and one K/V "
          f"block whatever the backend)")
    if not n1 > f1 + scores:
        fail(f"the naive core should save more than one [b, a, s, s] fp32 tensor per layer over sdpa: {n1} vs {f1}")
    if n2 != f2:
        fail(f"under cp = 2 naive ({n2}) and sdpa ({f2}) should save the same bytes")
    return {"naive_one": n1, "sdpa_one": f1, "naive_cp2": n2, "sdpa_cp2": f2}


# ---------------------------------------------------------------------------------------
# the figures (drawn from the records the code keeps; the notebook and the tests draw them too)
# ---------------------------------------------------------------------------------------
def plot_cp_load_balance(work: dict[int, dict[str, list[int]]], path: str | os.PathLike | None = None,
                         title: str = ""):
    """Causal attention work per context-parallel rank (cp.causal_work_per_rank): one panel per
    cp size, a pair of bars per rank (contiguous split, zig-zag split), each in units of the
    mean over the ranks, with the mean (1) dashed. work: {cp: {"contiguous": [W_0, ...],
    "zig-zag": [W_0, ...]}}. Returns the Figure (saved to `path` if given)."""
    sizes = sorted(work)
    fig = new_figure(figsize=(3.6 * len(sizes) + 0.6, 3.4))
    axes = fig.subplots(1, len(sizes), sharey=True, squeeze=False)[0]
    colors = {"contiguous": "#C44E52", "zig-zag": "#4C72B0"}
    for ax, cp in zip(axes, sizes):
        width = 0.4
        for i, (name, per_rank) in enumerate(work[cp].items()):
            mean = sum(per_rank) / len(per_rank)
            xs = [r + (i - 0.5) * width for r in range(cp)]
            ax.bar(xs, [w / mean for w in per_rank], width=width, color=colors.get(name, colour(i, 2)),
                   label=f"{name} (max/mean {max(per_rank) / mean:.3f})")
        ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
        ax.set_xticks(range(cp), [str(r) for r in range(cp)])
        ax.set_xlabel("cp rank")
        ax.set_title(f"cp = {cp}", fontsize="medium")
        ax.legend(fontsize=7, loc="upper left")
    axes[0].set_ylabel("unmasked scores / mean")
    return finish_figure(fig, path, title)


def plot_cp_comm_types(rows: dict[str, dict[int, dict[str, float]]], path: str | os.PathLike | None = None,
                       unit: str = "bytes", title: str = ""):
    """The context-parallel communication types side by side as cp grows: three panels, bytes
    sent per rank and layer in the forward, the same in the backward, and the number of
    communication steps (forward + backward). rows: {comm_type: {cp: {"fwd": bytes, "bwd":
    bytes, "steps": n}}}; `unit` labels the byte axes. Returns the Figure."""
    fig = new_figure(figsize=(13, 3.8))
    axes = fig.subplots(1, 3)
    markers = "osD^v"
    for i, (name, by_cp) in enumerate(rows.items()):
        cps = sorted(by_cp)
        for ax, key in zip(axes, ("fwd", "bwd", "steps")):
            ax.plot(cps, [by_cp[c][key] for c in cps], marker=markers[i % len(markers)], color=colour(i, len(rows)),
                    label=name)
    for ax, label in zip(axes, (f"forward: sent per rank and layer ({unit})",
                                f"backward: sent per rank and layer ({unit})",
                                "communication steps per layer (fwd + bwd)")):
        ax.set_title(label, fontsize="medium")
        ax.set_xlabel("cp")
        ax.grid(alpha=0.3)
        ax.set_xticks(sorted({c for by_cp in rows.values() for c in by_cp}))
    axes[0].legend(fontsize=8)
    return finish_figure(fig, path, title)


def plot_sp_cp_activations(tp_panel: dict, cp_panel: dict, path: str | os.PathLike | None = None):
    """Activation bytes per rank, measured, against the ideal cut and the paper's formulas.

    tp_panel: {"tp": [t, ...], "measured_tp": [...], "measured_sp": [...] (bytes per rank /
      single-device bytes), "korthikanti_tp": [...], "korthikanti_sp": [...] (the same
      ratios from the formulas), "label": str}.
    cp_panel: {"cp": [c, ...], "measured": [bytes per rank], "single": bytes on one device,
      "label": str}.
    Left: fractions of the single device against tp, with 1/tp dashed; right: MiB per rank
    against cp, with single / cp dashed. Returns the Figure."""
    fig = new_figure(figsize=(11, 4))
    left, right = fig.subplots(1, 2)
    t = tp_panel["tp"]
    left.plot(t, [1 / x for x in t], "k--", linewidth=0.8, label="1 / tp")
    left.plot(t, tp_panel["korthikanti_tp"], "-", color="#C44E52", alpha=0.6, label="Korthikanti TP formula")
    left.plot(t, tp_panel["korthikanti_sp"], "-", color="#4C72B0", alpha=0.6, label="Korthikanti TP+SP formula")
    left.plot(t, tp_panel["measured_tp"], "o", color="#C44E52", label="measured, TP")
    left.plot(t, tp_panel["measured_sp"], "s", color="#4C72B0", label="measured, TP + SP")
    left.set_xticks(t)
    left.set_xlabel("tp")
    left.set_ylabel("saved activations per rank / one device")
    left.set_ylim(0, 1.05)
    left.set_title(tp_panel.get("label", ""), fontsize="medium")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    c, mib = cp_panel["cp"], 2 ** 20
    right.plot(c, [cp_panel["single"] / x / mib for x in c], "k--", linewidth=0.8, label="one device / cp")
    right.plot(c, [m / mib for m in cp_panel["measured"]], "o-", color="#55A868", label="measured per rank")
    right.set_xticks(c)
    right.set_xlabel("cp")
    right.set_ylabel("saved activations per rank (MiB)")
    right.set_ylim(0, None)
    right.set_title(cp_panel.get("label", ""), fontsize="medium")
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    return finish_figure(fig, path)


def draw_sequence_parallel_regions(path: str | os.PathLike | None = None):
    """A diagram of one transformer layer under sequence parallelism (Korthikanti et al. 2022;
    tp/layers.py): the sequence-parallel regions ([b, s/tp, h], this rank's tokens: norms,
    dropout, residual adds) and the tensor-parallel regions ([b, s, .../tp], all tokens, this
    rank's heads or MLP columns), with the collective at each boundary (forward, and in
    brackets backward). Returns the Figure (saved to `path` if given)."""
    import matplotlib.patches as patches

    fig = new_figure(figsize=(14, 3.6))
    ax = fig.add_subplot()
    ax.set_xlim(0, 14)
    ax.set_ylim(0, 3.6)
    ax.axis("off")
    sp_colour, tp_colour = "#dbe9f6", "#fde0c5"
    # (x, width, label, region)
    boxes = [(0.1, 1.5, "LayerNorm\ninput_layernorm", "sp"),
             (2.6, 2.4, "linear_qkv (column)\ncore attention\n(a/tp heads)", "tp"),
             (5.2, 1.3, "linear_proj\n(row)", "tp"), (7.3, 1.9, "+ bias, dropout,\nresidual;\npre_mlp_layernorm", "sp"),
             (10.2, 1.9, "linear_fc1 (column)\nactivation", "tp"), (12.3, 1.3, "linear_fc2\n(row)", "tp")]
    for x, w, label, region in boxes:
        ax.add_patch(patches.FancyBboxPatch((x, 1.2), w, 1.2, boxstyle="round,pad=0.05",
                                            facecolor=sp_colour if region == "sp" else tp_colour, edgecolor="black"))
        ax.text(x + w / 2, 1.8, label, ha="center", va="center", fontsize=8)
    arrows = [(1.65, 2.55, "all-gather\n(bwd: reduce-scatter;\nre-gather of the shard)"),
              (5.0, 5.15, ""), (6.55, 7.25, "reduce-scatter\n(bwd: all-gather)"),
              (9.25, 10.15, "all-gather\n(bwd: reduce-scatter;\nre-gather of the shard)"),
              (12.15, 12.25, ""), (13.65, 13.95, "")]
    for x0, x1, label in arrows:
        ax.annotate("", xy=(x1, 1.8), xytext=(x0, 1.8), arrowprops=dict(arrowstyle="->", lw=1.2))
        if label:
            ax.text((x0 + x1) / 2, 0.8, label, ha="center", va="center", fontsize=7.5, color="#7f2704")
    ax.text(13.8, 0.8, "reduce-scatter\n(bwd: all-gather)", ha="center", va="center", fontsize=7.5, color="#7f2704")
    handles = [patches.Patch(facecolor=sp_colour, edgecolor="black",
                             label="sequence-parallel region: [b, s/tp, h], this rank's tokens, whole in h"),
               patches.Patch(facecolor=tp_colour, edgecolor="black",
                             label="tensor-parallel region: all s tokens, a/tp heads or f/tp MLP columns")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1.02), ncol=2, fontsize=8, frameon=False)
    return finish_figure(fig, path)


# ---------------------------------------------------------------------------------------
# the chapter's recorded runs and the numbers its text quotes (booktools/measured.py)
# ---------------------------------------------------------------------------------------
DEMO = "python chapters/04_sp_cp/demo.py"
RUNS = {
    "figures": "python chapters/04_sp_cp/make_figures.py",                 # §2.7, §3, §5, §6.4's figure
    # §2.5, §2.6: SP against one device, and its ledgers
    "tp2": f"{DEMO} --tp 2",
    "tp2-sp": f"{DEMO} --tp 2 --sp",
    "tp2-sp-gpt2": f"{DEMO} --tp 2 --sp --style gpt2",
    "tp2-sp-gpt2-fp32": f"{DEMO} --tp 2 --sp --style gpt2 --dtype float32",
    "tp4-sp-gpt2": f"{DEMO} --tp 4 --sp --style gpt2",
    # §6.4: the four cp_comm_types
    "cp2": f"{DEMO} --cp 2",
    "cp2-all_gather": f"{DEMO} --cp 2 --cp-comm-type all_gather",
    "cp2-a2a": f"{DEMO} --cp 2 --cp-comm-type a2a",
    "cp4": f"{DEMO} --cp 4",
    "cp4-all_gather": f"{DEMO} --cp 4 --cp-comm-type all_gather",
    "cp4-a2a-p2p": f"{DEMO} --cp 4 --cp-comm-type a2a+p2p",
    "cp3-seq48": f"{DEMO} --cp 3 --seq 48",
    "cp2-fp32": f"{DEMO} --cp 2 --dtype float32",
    # §7.3: composed with TP, PP and DP
    "tp2-sp-cp2": f"{DEMO} --tp 2 --sp --cp 2",
    "cp2-dp2": f"{DEMO} --cp 2 --dp 2",
    "4d": f"{DEMO} --tp 2 --sp --cp 2 --pp 2 --dp 2 --quick",
}


def sent_per_rank(totals: dict[str, int], cp: int, all_to_all_size: int) -> float:
    """What a CP run's ledger totals put on the wire per rank (comm.ring_traffic: the factor
    is linear in the bytes, so the totals per op will do; a send is sent once, a recv not)."""
    size = {"all_to_all": all_to_all_size}
    return sum(comm.ring_traffic(comm.CommRecord(op, tuple(range(size.get(op, cp))), nbytes, None, ()))
               for op, nbytes in totals.items() if op != "messages")


def demo_run(command: str):
    """The SeqRun a recorded demo command trains (the demo's own parse_args and build_run)."""
    args = ch04.parse_args(shlex.split(command)[2:])
    return ch04.build_run(args, args.dp or 1)


def measure_demo_runs(outputs: dict[str, list[str]], results: dict[str, dict]) -> dict[str, float]:
    """Every demo run's quoted values (the demo's SeqResults), as "<run>.<name>": the
    differences from one device ([1/4], round-off), the ledger of stage 0 ([2/4]: messages,
    bytes handed in per op, communication steps, bytes sent per rank; SP: the bytes on the
    wire against TP's), the activations ([3/4]) and the seconds of training (machine-dependent)."""
    v = {}
    for run_id, command in RUNS.items():
        if run_id == "figures":
            continue
        r, run = results[run_id], demo_run(command)
        want = ch04.expected_ledger(run)
        stage0 = r["ledger"][0]
        totals = {"messages": stage0["messages"], **stage0["bytes"]}
        claim(sum(want.values()) == totals["messages"], f"{command} holds the formula's messages")
        v |= {f"{run_id}.{k}": RoundOff(r[k]) for k in ("dloss", "dgrad", "dparam")}
        v |= {f"{run_id}.{op}": x for op, x in totals.items()}
        if run.cp > 1 and run.tp == 1 and run.pp == 1:         # §6.4's table: the CP messages alone
            v[f"{run_id}.steps"] = sum(n for (op, _, _), n in want.items() if op != "recv")   # a ring hop: 2
            hierarchical = hierarchical_sizes(run.cp, run.comm_type)[0] if run.comm_type == "a2a+p2p" else run.cp
            v[f"{run_id}.sent"] = sent_per_rank(totals, run.cp, hierarchical)
        if run.sp:
            wire = r["wire"]
            v |= {f"{run_id}.wire_sp": wire["sp"], f"{run_id}.wire_tp": wire["tp"],
                  f"{run_id}.wire_regather": wire["regather"]}
            if run.model.position_embedding_type == "learned_absolute":
                v[f"{run_id}.wire_embedding"] = wire["embedding"]
        memory = r["memory"]
        v |= {f"{run_id}.mem_rank": memory["parallel"], f"{run_id}.mem_single": memory["single"]}
        v[f"{run_id}.mem_ratio"] = v[f"{run_id}.mem_single"] / v[f"{run_id}.mem_rank"]
        if run.tp > 1:
            v[f"{run_id}.mem_without_sp"] = memory["without_sp"]
            v[f"{run_id}.sp_saves_pct"] = 100 * (1 - v[f"{run_id}.mem_rank"] / v[f"{run_id}.mem_without_sp"])
        if run.tp > 1 and run.cp == 1:                          # the paper's count, per layer (no CP in it)
            v[f"{run_id}.korthikanti_saves_pct"] = 100 * (1 - memory["korthikanti_sp"] / memory["korthikanti_tp"])
    v["4d.seconds"] = results["4d"]["seconds"]          # the one training time §7.3 quotes (machine-dependent)
    return v


def measure(outputs: dict[str, list[str]], results: dict[str, dict | None]) -> dict[str, float]:
    """Every number of the README and the notebook's markdown that the code computes or the
    runs measure, by marker key."""
    figures = results["figures"]
    v = measure_demo_runs(outputs, results) | measure_questions()

    # §1, §12 Q4 (and the notebook's section 1): Korthikanti's count at GPT-3's shapes, t = 8
    gpt3 = ModelConfig.gpt2(hidden_size=12288, num_attention_heads=96, num_layers=96, ffn_hidden_size=4 * 12288,
                            vocab_size=50257, max_position_embeddings=2048)
    sbh = 2048 * 12288
    tp8, sp8 = (korthikanti_activation_memory(gpt3, 1, 2048, tp=8, sequence_parallel=sp)["per_layer"]
                for sp in (False, True))
    v |= {"gpt3.tp_sbh": tp8 / sbh, "gpt3.replicated_pct": 100 * 10 * sbh / tp8, "gpt3.tp_mb": tp8 / 1e6,
          "gpt3.sp_mb": sp8 / 1e6, "gpt3.sp_less_pct": 100 * (1 - sp8 / tp8)}

    # §2.6: where the 57 messages of --tp 2 --sp come from (the formula the ledger equals)
    for run_id in ("tp2-sp", "tp2-sp-gpt2"):
        want = ch04.expected_ledger(demo_run(RUNS[run_id]))
        for op in ("all_gather", "reduce_scatter", "all_reduce"):
            v[f"{run_id}.{op}_calls"] = sum(n for (o, _, _), n in want.items() if o == op)
        v[f"{run_id}.sp_grads_bytes"] = next(b for (_, tag, b) in want if tag == "sp-grads")
    loss = Counter({k: n for k, n in ch04.expected_ledger(demo_run(RUNS["tp2-sp"])).items()
                    if k[0] == "all_reduce" and k[1] == "fwd"})             # under SP only the loss all-reduces
    v["tp2-sp.loss_wire"] = ch04.wire_bytes(loss, 2)
    claim(abs(v["tp2-sp.wire_regather"] / v["tp2-sp.wire_sp"] - 0.25) < 0.01, "the re-gathers add a quarter")

    # §2.7: make_figures' TP and TP + SP activations, and Korthikanti's fractions for its shapes
    v["tp_memory.single"] = figures["tp_memory"]["single"]
    cfg = ch04.tiny_model("gpt2", "float64")
    for tp in (2, 4):
        tp_bytes, sp_bytes = figures["tp_memory"][f"tp{tp}"], figures["tp_memory"][f"tp{tp}_sp"]
        v |= {f"tp_memory.tp{tp}": tp_bytes, f"tp_memory.tp{tp}_fraction": tp_bytes / v["tp_memory.single"],
              f"tp_memory.tp{tp}_sp": sp_bytes, f"tp_memory.tp{tp}_sp_fraction": sp_bytes / v["tp_memory.single"],
              f"tp_memory.tp{tp}_sp_saves_pct": 100 * (1 - sp_bytes / tp_bytes),
              f"korthikanti.tp{tp}": ratio_korthikanti(cfg, 2, 64, tp, False),
              f"korthikanti.tp{tp}_sp": ratio_korthikanti(cfg, 2, 64, tp, True)}
        claim(abs(v[f"tp_memory.tp{tp}_sp_fraction"] * tp - 1) < 0.01, "with SP a rank holds 1/tp to within 1%")

    # §3: make_figures' CP activations at s = 4096, and the naive core against sdpa at s = 1024
    v["cp_memory.single"] = figures["cp_memory"]["single"]
    for cp in (2, 4):
        v[f"cp_memory.cp{cp}"] = figures["cp_memory"][f"cp{cp}"]
        v[f"cp_memory.cp{cp}_ratio"] = v["cp_memory.single"] / v[f"cp_memory.cp{cp}"]
    v |= {f"core.{k}": x for k, x in figures["core"].items()}
    llama = ch04.tiny_model("llama", "float32")
    v["core.scores_bytes"] = llama.num_layers * 1 * llama.num_attention_heads * 1024 * 1024 * 4   # L b a s^2 fp32
    v["core.difference"] = v["core.naive_one"] - v["core.sdpa_one"]
    v["core.difference_over_scores"] = v["core.difference"] / v["core.scores_bytes"]

    # §5: the causal work per rank at s = 4096, counted, and the closed form of the contiguous max/mean
    for cp in CP_SIZES:
        contiguous, zigzag = causal_work_per_rank(SEQ, cp, False), causal_work_per_rank(SEQ, cp, True)
        c = SEQ // (2 * cp)
        claim(len(set(zigzag)) == 1, "zig-zag gives every rank the same work")
        v |= {f"balance.cp{cp}.formula": (4 * cp * c - 2 * c + 1) / (2 * cp * c + 1),
              f"balance.cp{cp}.first": contiguous[0], f"balance.cp{cp}.last": contiguous[-1],
              f"balance.cp{cp}.counted": max(contiguous) / (sum(contiguous) / cp),
              f"balance.cp{cp}.zigzag": zigzag[0], f"balance.cp{cp}.zigzag_ratio": max(zigzag) / (sum(zigzag) / cp)}

    # §6.4: the table's bytes for the demo's runs (4 attention calls: 2 layers x 2 micro-batches)
    for run_id in ("cp2", "cp2-all_gather", "cp2-a2a", "cp4", "cp4-all_gather", "cp4-a2a-p2p", "cp3-seq48",
                   "cp2-fp32", "4d"):
        run = demo_run(RUNS[run_id])
        t, m = run.train, run.model
        e = torch.empty((), dtype=m.dtype).element_size()
        s_r = t.seq_length // run.cp
        kv = t.micro_batch_size * (m.query_groups // run.tp) * s_r * m.kv_channels * e
        q = t.micro_batch_size * (m.num_attention_heads // run.tp) * s_r * m.kv_channels * e
        fwd, bwd, _ = closed_form(run.comm_type, run.cp, kv, q)
        v |= {f"{run_id}.kv": kv, f"{run_id}.kv_times_cp": kv * run.cp,
              f"{run_id}.table": (fwd + bwd) * len(stage_layers(m.num_layers, run.pp, 0)) * t.grad_accum_steps}
    try:
        demo_run(f"{DEMO} --cp 4 --cp-comm-type a2a")
        claim(False, "--cp 4 --cp-comm-type a2a is refused")
    except ConfigError as error:
        claim("--cp 4" in str(error) and "2 key/value groups" in str(error), "the error names both numbers")
    # ... and the ring against the all-to-all, forward bytes cp g / (a + g) (§6.4, the notebook's section 7)
    ratio = {(a, g): [cp * g / (a + g) for cp in range(2, 9)] for a, g in ((32, 8), (32, 32))}
    v["ring_a2a.gqa_ring_less_below"] = next(cp for cp, r in zip(range(2, 9), ratio[32, 8]) if r >= 1)
    v["ring_a2a.mha_a2a_less_from"] = next(cp for cp, r in zip(range(2, 9), ratio[32, 32]) if r > 1)

    # §7.1 and §12 Q9: the groups of rank 13 and rank 6 on 16 ranks, tp = cp = dp = pp = 2
    groups = rank_groups(16, tp=2, pp=2, cp=2)
    def group_of(kind: str, rank: int) -> list[int]:
        return next(g for g in groups[kind] if rank in g)
    claim([group_of(k, 13) for k in ("tp", "cp", "dp", "dp-cp", "pp", "tp-cp")]
          == [[12, 13], [13, 15], [9, 13], [9, 11, 13, 15], [5, 13], [12, 13, 14, 15]], "rank 13's groups")
    claim(group_of("dp-cp", 6) == [0, 2, 4, 6] and group_of("cp", 6) == [4, 6]
          and group_of("tp-cp", 6) == [4, 5, 6, 7] and group_of("pp", 6) == [6, 14], "rank 6's groups")

    return {key: x if isinstance(x, RoundOff) else int(x) if float(x).is_integer() else float(x)
            for key, x in v.items()}


def measure_questions() -> dict[str, float]:
    """The answers of README §12 and of the notebook's questions and cells that the code computes."""
    v = {}
    # §12 Q2 (and the notebook's Q2): TP 4, b = 1, s = h = 4096, bf16, one layer's forward
    MiB, tp = 2**20, 4
    x = 4096 * 4096 * 2
    def sent(op, nbytes):
        return comm.ring_traffic(comm.CommRecord(op, tuple(range(tp)), nbytes, None, ())) / MiB
    v |= {"q2.bshe_mib": x / MiB, "q2.tp_handed_mib": 2 * x / MiB, "q2.tp_sent_mib": 2 * sent("all_reduce", x),
          "q2.sp_handed_mib": (2 * x // tp + 2 * x) / MiB,
          "q2.sp_sent_mib": 2 * sent("all_gather", x // tp) + 2 * sent("reduce_scatter", x),
          "q2.regather_mib": 2 * sent("all_gather", x // tp)}

    # §12 Q5 (the notebook's Q1): merge_attention of lse 2.0 and 0.0
    one, zero = torch.ones(1, 1, 1, 1, dtype=torch.float64), torch.zeros(1, 1, 1, 1, dtype=torch.float64)
    lse_a, lse_b = torch.full((1, 1, 1), 2.0, dtype=torch.float64), torch.zeros(1, 1, 1, dtype=torch.float64)
    weight_a, lse = merge_attention(one, lse_a, zero, lse_b)         # out_a = 1, out_b = 0: out is A's weight
    weight_b, _ = merge_attention(zero, lse_a, one, lse_b)
    v |= {"q5.lse": lse.item(), "q5.weight_a": weight_a.item(), "q5.weight_b": weight_b.item()}

    # the notebook's own cells: the CP shapes of section 7 (one layer, one micro-batch, b = 1,
    # a = 8, g = 4, s = 16, cp = 4), the lockstep ring of section 5, Q3
    one_layer = ch04.tiny_model(num_layers=1, num_attention_heads=8, num_query_groups=4)
    nb_run = ch04.make_run(one_layer, cp=4, cp_comm_type="a2a", micro_batches=1, micro_batch_size=1, seq=16)
    sizes = [b for (op, tag, b) in ch04.expected_ledger(nb_run) if op == "all_to_all" and tag == "fwd"]
    v |= {"nb.kv_bytes": min(sizes), "nb.q_bytes": max(sizes)}      # the all-to-alls of q, k, v, out
    v["nb.lockstep_contiguous"] = lockstep_over_ideal(4, False)
    v["q3.contiguous_ratio"] = ch04.load_balance((4,), 4096)[0][1]
    return v


def lockstep_over_ideal(cp: int, load_balance: bool, c: int = 64) -> float:
    """The notebook's section 5: the ring's time in lockstep (the busiest rank's scores at every
    step, from block_pairs) over the balanced time (the mean rank's scores)."""
    ids = [cp_chunk_ids(cp, r, load_balance) for r in range(cp)]
    steps = [[sum(c * (c + 1) // 2 if causal else c * c for _, _, causal in block_pairs(ids[r], ids[(r - t) % cp]))
              for r in range(cp)] for t in range(cp)]
    return sum(max(step) for step in steps) / (sum(map(sum, steps)) / cp)


@dataclass
class Figures:
    """The bytes main printed for its measured sections (none with --formulas-only): tp_memory
    {"single", "tp2", "tp2_sp", "tp4", "tp4_sp"}, cp_memory {"single", "cp2", "cp4"} (per rank),
    core {"naive_one", "sdpa_one", "naive_cp2", "sdpa_cp2"}."""
    exit_code: int = 0
    tp_memory: dict = field(default_factory=dict)
    cp_memory: dict = field(default_factory=dict)
    core: dict = field(default_factory=dict)


def main(argv=None) -> Figures:
    argv = sys.argv[1:] if argv is None else argv
    torch.set_num_threads(1)
    OUT.mkdir(exist_ok=True)
    draw_sequence_parallel_regions(OUT / "sp_regions.png")
    load_balance_section()
    comm_types_section()
    found = Figures()
    if "--formulas-only" not in argv:
        me = importlib.import_module("chapters.04_sp_cp.make_figures")   # spawned functions by their name
        tp_panel = tp_memory_section(me, found.tp_memory)
        cp_panel = cp_memory_section(me)
        found.cp_memory = {"single": cp_panel["single"],
                           **{f"cp{cp}": saved for cp, saved in zip(cp_panel["cp"][1:], cp_panel["measured"][1:])}}
        plot_sp_cp_activations(tp_panel, cp_panel, OUT / "activations.png")
        found.core = naive_vs_sdpa_section(me)
    print(f"\nfigures written to {OUT}")
    return found


if __name__ == "__main__":      # the guard matters: spawned ranks import this file again
    sys.exit(main().exit_code)
