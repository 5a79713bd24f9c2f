"""ZeRO-1, ZeRO-2 and ZeRO-3 (minimegatron/dp/zero.py, fsdp.py) against the single-device run.

One spawned world per DP size (2, 3, 4) runs every case of that size (each rank costs seconds
to start), each step by the training loop's own `train.train_step` (tests/workers/dp_zero.py);
the parent compares each case with `testing.single_device_run` on the same global
batches: losses, first-step gradients (reassembled from the shards), final parameters. The
ledger of every step must equal the formula derived here from the parameter shapes alone, and
the memory measured on the real tensors must equal the derived bytes, next to
`analysis.memory.training_memory`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from minimegatron.analysis.communication import data_parallel_phases
from minimegatron.analysis.memory import training_memory
from minimegatron.dp.zero import build_buckets, shard_range
from minimegatron.launch import spawn
from minimegatron.model import GPTModel
from minimegatron.testing import RunRecord, assert_equivalent, single_device_run
from workers.dp_zero import case_batches, case_train_config, run_zero_cases, tiny_config, train_config


# float32 cases: AdamW's first update is g / (|g| + eps). A gradient element near eps (measured:
# 5.6e-9, a sum that nearly cancels) rounds 2.4e-10 differently when the ranks' gradients are
# averaged instead of computed on the whole batch, and its update then moves by 1% of lr
# (3e-5, above float32's tolerance). That is AdamW's amplification, not sharding; a larger eps
# keeps it below float32 rounding. The float64 cases use the default eps and are exact.
F32_EPS = 1e-5


def _case(style, stage, M, dtype="float64", clip=0.0, steps=2, **extra):
    return dict(style=style, stage=stage, M=M, dtype=dtype, clip=clip, steps=steps, mbs=1, **extra)


# every stage x {M=1, M=2} at every DP size; both model styles; clipping active; float32; resume
CASES = {
    2: [_case("gpt2", 1, 1), _case("gpt2", 1, 2, clip=0.05, steps=3, resume_at=1),
        _case("gpt2", 2, 1, bucket_size=4000), _case("llama", 2, 2),
        _case("gpt2", 3, 1), _case("llama", 3, 2, steps=3)],
    3: [_case("llama", 1, 1), _case("gpt2", 1, 2),
        _case("llama", 2, 1, clip=0.05, bucket_size=6000), _case("gpt2", 2, 2, steps=3, resume_at=2),
        _case("llama", 3, 1, clip=0.05, steps=3), _case("gpt2", 3, 2)],
    4: [_case("llama", 1, 2, steps=3), _case("llama", 1, 1, dtype="float32", adam_eps=F32_EPS),
        _case("gpt2", 2, 1, bucket_size=2000), _case("gpt2", 2, 2, dtype="float32", adam_eps=F32_EPS),
        _case("llama", 3, 1, dtype="float32", adam_eps=F32_EPS), _case("gpt2", 3, 2, clip=0.05, steps=3, resume_at=1)],
}
ALL = [(dp, i) for dp, cases in CASES.items() for i in range(len(cases))]


def _id(dp_i):
    dp, i = dp_i
    c = CASES[dp][i]
    return f"dp{dp}-zero{c['stage']}-{c['style']}-M{c['M']}-{c['dtype']}" + ("-clip" if c["clip"] else "")


@functools.cache
def _world(dp: int) -> list[list[dict]]:
    return spawn(run_zero_cases, dp, CASES[dp], timeout=240)


@functools.cache
def _reference(dp: int, i: int) -> RunRecord:
    c = CASES[dp][i]
    return single_device_run(tiny_config(c["style"], c["dtype"]), case_batches(c, dp),
                             train_config(c["steps"], c["clip"], c.get("adam_eps", 1e-8)),
                             grad_accum_steps=c["M"])


def _e(c) -> int:
    return 8 if c["dtype"] == "float64" else 4


# --------------------------------------------------------------------------------------
# layouts: pure functions, no process group
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dp", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("numel", [0, 1, 5, 6, 7, 160, 39488])
def test_shard_range_tiles_the_padded_buffer(numel, dp):
    ranges = [shard_range(numel, dp, r) for r in range(dp)]
    sizes = {e - s for s, e in ranges}
    assert len(sizes) == 1, f"unequal shards {ranges}: collectives need equal sizes"
    assert ranges[0][0] == 0 and all(ranges[r][1] == ranges[r + 1][0] for r in range(dp - 1))
    padded = ranges[-1][1]
    assert numel <= padded < numel + dp, f"padding {padded - numel} must be < dp={dp}"


def test_shard_range_rejects_bad_input():
    for args in [(10, 0, 0), (10, 2, 2), (10, 2, -1), (-1, 2, 0)]:
        with pytest.raises(ValueError, match="shard_range"):
            shard_range(*args)


def _bucket_sizes(model, bucket_size):
    """The documented rule: reverse parameter order, split by weight decay, close a bucket once
    it holds >= bucket_size elements (None: one bucket per group)."""
    named = list(model.named_parameters())[::-1]
    out = []
    for decay in (True, False):
        sizes = [p.numel() for _, p in named if (p.dim() >= 2) == decay]
        current = []
        for i, s in enumerate(sizes):
            current.append(s)
            if i == len(sizes) - 1 or (bucket_size and sum(current) >= bucket_size):
                out.append(sum(current))
                current = []
    return out


@pytest.mark.parametrize("bucket_size", [None, 3000])
def test_buckets_hold_the_parameters_as_views(bucket_size):
    model = GPTModel(tiny_config("gpt2"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    buckets = build_buckets(list(model.parameters()), dp=3, rank=2, bucket_size=bucket_size)
    assert [b.numel for b in buckets] == _bucket_sizes(GPTModel(tiny_config("gpt2")), bucket_size)
    for b in buckets:
        assert b.padded_numel == 3 * math.ceil(b.numel / 3) and (b.start, b.end) == shard_range(b.numel, 3, 2)
        assert torch.all(b.param_data[b.numel:] == 0) and all((p.dim() >= 2) == b.decay for p in b.params)
        for p in b.params:
            assert p.untyped_storage().data_ptr() == b.param_data.untyped_storage().data_ptr()
        assert b.grad_data.shape == b.param_data.shape and not b.grad_data.any()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n])
    # writing the bucket changes the model: that is how the all-gather updates the parameters
    buckets[0].param_data.add_(1.0)
    assert torch.equal(buckets[0].params[0].detach(), before[buckets[0].names[0]] + 1.0)


# --------------------------------------------------------------------------------------
# equivalence with the single-device run
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dp_i", ALL, ids=_id)
def test_zero_equals_single_device(dp_i):
    dp, i = dp_i
    c, ranks = CASES[dp][i], [r[i] for r in _world(dp)]
    losses = [sum(r["losses"][s] for r in ranks) / dp for s in range(c["steps"])]
    record = RunRecord(losses, ranks[0]["grads"], ranks[0]["params"])
    assert_equivalent(_reference(dp, i), record, getattr(torch, c["dtype"]))
    # the global norm: every rank returns the same value, equal to the single-device norm
    ref_norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in _reference(dp, i).grads.values()))
    for r in ranks:
        assert r["norms"][0] == pytest.approx(ref_norm, rel=1e-9 if c["dtype"] == "float64" else 1e-5)
    if c["clip"]:
        assert ranks[0]["norms"][0] > c["clip"], "the case must clip for real"
    assert all(r["padding_zero"] for r in ranks), "padding changed: it leaked into the update"


@pytest.mark.parametrize("dp_i", [x for x in ALL if CASES[x[0]][x[1]].get("resume_at")], ids=_id)
def test_resume_from_per_rank_state_is_exact(dp_i):
    dp, i = dp_i
    for r in _world(dp):
        assert r[i]["resume_max_diff"] == 0.0, f"resumed run differs by {r[i]['resume_max_diff']:.3e}"
        assert r[i]["resume_losses"] == r[i]["losses"]


# --------------------------------------------------------------------------------------
# communication: the ledger equals the formula derived from the parameter shapes
# --------------------------------------------------------------------------------------

def _units(model):
    """ZeRO-3 units by the documented rule, in forward order: (name, numel)."""
    named = list(model.named_parameters())
    groups = [("embedding", "embedding.")] + [(f"decoder.layers.{i}", f"decoder.layers.{i}.")
                                              for i in range(model.config.num_layers)]
    units = [(name, sum(p.numel() for n, p in named if n.startswith(pre))) for name, pre in groups]
    units.append(("head", sum(p.numel() for n, p in named if n.startswith(("decoder.final_layernorm.", "output_layer.")))))
    return units


def _expected_ledger(c, dp):
    """Per step: list of (op, bytes, tag), in the order the implementation must issue them."""
    e, model = _e(c), GPTModel(tiny_config(c["style"], c["dtype"]))
    norm = [("all_reduce", e, "grad-norm")]
    if c["stage"] in (1, 2):
        S = [math.ceil(n / dp) for n in _bucket_sizes(model, c.get("bucket_size"))]
        return ([("reduce_scatter", dp * s * e, "grads") for s in S] + norm
                + [("all_gather", s * e, "params") for s in S])
    units = {name: math.ceil(n / dp) for name, n in _units(model)}
    tied = c["style"] == "gpt2"
    uses = list(units) + (["embedding"] if tied else [])     # the tied head reads the embedding
    backward_uses = uses[1:]                                 # the lookup's backward reads no weight
    rows = []
    for m in range(c["M"]):
        rows += [("all_gather", units[u] * e, "fwd") for u in uses]
        if tied:   # multiset only: (checked below) the tied head's order is autograd's business
            rows += [("all_gather", units[u] * e, "bwd") for u in backward_uses]
            if m == c["M"] - 1:
                rows += [("reduce_scatter", dp * units[u] * e, "grads") for u in uses]
        else:      # exact order: gather a unit for backward, then reduce-scatter it, output first
            for u in reversed(uses):
                if u in backward_uses:
                    rows.append(("all_gather", units[u] * e, "bwd"))
                if m == c["M"] - 1:
                    rows.append(("reduce_scatter", dp * units[u] * e, "grads"))
    return rows + norm


@pytest.mark.parametrize("dp_i", ALL, ids=_id)
def test_ledger_equals_the_formula(dp_i):
    dp, i = dp_i
    c = CASES[dp][i]
    expected = _expected_ledger(c, dp)
    for r in _world(dp):
        for step, got in enumerate(r[i]["ledger"]):
            if c["stage"] == 2:   # buckets reduce in the order backward completes them
                ops = [op for op, _, _ in got]
                n = ops.count("reduce_scatter")
                assert ops == ["reduce_scatter"] * n + ["all_reduce"] + ["all_gather"] * n, ops
                assert sorted(got) == sorted(expected), f"step {step}"
            elif c["stage"] == 3 and c["style"] == "gpt2":
                assert sorted(got) == sorted(expected), f"step {step}"
                assert [x for x in got if x[2] == "fwd"] == [x for x in expected if x[2] == "fwd"]
            else:
                assert got == expected, f"step {step}:\n got      {got}\n expected {expected}"


def test_analysis_formula_equals_the_derived_ledger():
    """analysis.data_parallel_phases (chapters 01-02's formula) issues the ledger derived above,
    which the measured ledgers equal: a tied head's second use of the embedding unit included."""
    for dp, cases in CASES.items():
        for c in cases:
            cfg = dataclasses.replace(case_train_config(c), zero_stage=c["stage"], ddp_bucket_size=c.get("bucket_size"))
            phases = data_parallel_phases(GPTModel(tiny_config(c["style"], c["dtype"])), cfg, dp, _e(c))
            assert sorted(x for phase in phases for x in phase) == sorted(_expected_ledger(c, dp)), (dp, c)


# --------------------------------------------------------------------------------------
# memory: measured on the real tensors, derived exactly, next to the ZeRO paper's formula
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dp_i", ALL, ids=_id)
def test_memory_per_rank(dp_i):
    dp, i = dp_i
    c = CASES[dp][i]
    e, cfg = _e(c), tiny_config(c["style"], c["dtype"])
    model = GPTModel(cfg)
    N = sum(p.numel() for p in model.parameters())
    sizes = (_bucket_sizes(model, c.get("bucket_size")) if c["stage"] < 3 else [n for _, n in _units(model)])
    S = [math.ceil(n / dp) for n in sizes]
    formula = training_memory(cfg, zero_stage=c["stage"], dp=dp)
    total_state = 0
    for rank, r in enumerate(_world(dp)):
        m = r[i]["memory"]
        real = sum(max(0, min(s, n - rank * s)) for n, s in zip(sizes, S))
        derived = {"params": (sum(S) if c["stage"] == 3 else dp * sum(S)) * e,
                   "grads": (dp * sum(S) if c["stage"] == 1 else sum(S)) * e,
                   "optimizer": 2 * real * e}
        for kind, value in derived.items():
            assert m[kind] == value, (f"rank {rank} {kind}: measured {m[kind]} B, derived {value} B, "
                                      f"ZeRO formula {formula[kind]} B")
            # the formula pads N once; here every bucket / unit is padded: less than dp
            # elements each (per copy), the only difference allowed
            assert abs(m[kind] - formula[kind]) < 2 * e * dp * len(sizes), (kind, m[kind], formula[kind])
        total_state += m["optimizer"]
    assert total_state == 2 * N * e, "the optimizer state must be a partition: no element twice, none lost"


def test_padding_is_exercised():
    """At dp=3 the buckets and units of the cases do not all divide: padding is really tested."""
    for style in ("gpt2", "llama"):
        model = GPTModel(tiny_config(style))
        assert any(n % 3 for n in _bucket_sizes(model, None)), style
        assert any(n % 3 for _, n in _units(model)), style


def test_zero2_never_holds_the_full_gradient():
    """Stage 2 with several buckets and no accumulation: the most full-gradient bytes a rank
    held during backward is below one full gradient (stage 1 holds all of it all the time)."""
    for dp, i in ALL:
        c = CASES[dp][i]
        if c["stage"] == 2 and c["M"] == 1 and c.get("bucket_size"):
            N = sum(p.numel() for p in GPTModel(tiny_config(c["style"])).parameters())
            for r in _world(dp):
                assert r[i]["synced_grads_freed"], "a .grad survived the reduce-scatter"
                assert 0 < r[i]["grad_peak"] < N * _e(c), (r[i]["grad_peak"], N * _e(c))


# --------------------------------------------------------------------------------------
# ZeRO-3: the parameter memory over one step
# --------------------------------------------------------------------------------------

def test_zero3_memory_profile_untied():
    """LLaMA (untied), dp 2, M 2: each unit is gathered alone, freed before the next one, and
    regathered for backward except the embedding; at the end only the shards remain."""
    dp, i = 2, 5
    c = CASES[dp][i]
    assert c["stage"] == 3 and c["style"] == "llama" and c["M"] == 2
    e = _e(c)
    units = {name: math.ceil(n / dp) for name, n in _units(GPTModel(tiny_config("llama")))}
    sharded = sum(units.values()) * e
    one_mb = []
    for u in units:
        one_mb += [(f"fwd gather {u}", dp * units[u] * e), (f"fwd free {u}", 0)]
    for u in reversed([u for u in units if u != "embedding"]):
        one_mb += [(f"bwd gather {u}", dp * units[u] * e), (f"bwd free {u}", 0)]
    for r in _world(dp):
        profile = r[i]["profile"]
        assert all(s == sharded for _, s, _ in profile)
        assert [(label, g) for label, _, g in profile] == one_mb * 2


def test_zero3_memory_profile_tied_and_plot(tmp_path):
    from minimegatron.dp.fsdp import MemoryEvent
    from booktools.demo import import_chapter
    plot_memory_profile = import_chapter("01", "make_figures").plot_memory_profile

    dp, i = 3, 5
    c = CASES[dp][i]
    assert c["stage"] == 3 and c["style"] == "gpt2"
    units = {name: math.ceil(n / dp) for name, n in _units(GPTModel(tiny_config("gpt2")))}
    e = _e(c)
    for r in _world(dp):
        profile = r[i]["profile"]
        labels = [label for label, _, _ in profile]
        head = labels.index("fwd gather head")
        assert labels[head + 1] == "fwd gather embedding", "the tied head gathers the embedding too"
        assert profile[head + 1][2] == dp * (units["head"] + units["embedding"]) * e
        peak = max(g for _, _, g in profile)
        assert peak == dp * e * max(units["decoder.layers.0"], units["head"] + units["embedding"])
        assert profile[-1][2] == 0 and sum(label.startswith("fwd gather") for label, _, _ in profile) == 5 * c["M"]
    path = tmp_path / "profile.png"
    plot_memory_profile([MemoryEvent(*x) for x in _world(dp)[0][i]["profile"]], path, unsharded_bytes=1 << 18)
    assert path.stat().st_size > 1000
