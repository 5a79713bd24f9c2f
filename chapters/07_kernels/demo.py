"""Chapter 07 demo: activation recompute on the one model under tp x cp x pp x dp (x ep) ranks,
proven equal, bit for bit, to the same run without it.

    python chapters/07_kernels/demo.py                           # spawns 4 ranks: full recompute, tp 2 x dp 2
    python chapters/07_kernels/demo.py --recompute selective --recompute-modules core_attn mlp --tp 2 --cp 2 --dp 1
    python chapters/07_kernels/demo.py --pack --recompute selective --tp 2 --sp --dp 2
    python chapters/07_kernels/demo.py --kernels triton --recompute full --tp 2 --sp --dp 2
    python chapters/07_kernels/demo.py --kernels compile --tp 2 --sp --dp 2    # each layer through torch.compile
    torchrun --standalone --nproc_per_node=8 chapters/07_kernels/demo.py --recompute full --recompute-method block --tp 2 --sp --pp 2

This file is the chapter's experiment and its command line; make_figures.py, the notebook and
the graders run it from Python (`import_chapter("07")`). Every rank trains the same layout twice
from the same random states (dropout on, so the recompute must draw the masks again): without
recompute, then with it (parallelize.build_model: ... -> FP8 -> recompute -> the data-parallel
wrapper; testing.train_layout). The report:

  [1/4] on every rank, the losses, gradients and parameters with recompute against those without:
        equal bit for bit (chapters 01-05 prove the layout itself equals one device);
  [2/4] communication of one step with recompute from the ledger, every dimension against
        analysis.step_communication, whose "recompute ..." lines count the forwards run again;
  [3/4] memory (one process, a GPT-2-style bf16 layer at s = 256, Korthikanti et al.'s setting):
        the bytes one micro-batch keeps for the backward, measured with saved-tensor hooks,
        against analysis.activation_memory, for no recompute, selective and full, with the
        paper's s b h (34 + 5 a s / h), 34 s b h and 2 s b h beside them, and the run's own
        recompute (granularity, method, modules) when it is none of those three;
  [4/4] time (one process, the same model, this machine): a forward and backward without and
        with each recompute (skipped with --quick);
  [packed] with --pack (documents packed in each row, Megatron's three switches on): the logits
        of packed documents against each document alone, one process, within the model dtype's
        round-off over the forward (testing.rounding_tolerance);
  [kernels] with --kernels triton (the model's norms, attention core and SwiGLU as Triton
        programs, interpreted on a CPU): each kernel's forward and gradients against the book's
        PyTorch function, one process;

With --kernels compile (each layer through torch.compile; no recompute, no dropout) [1/4]
compares the compiled run with the eager one instead, within float32's summation-order
tolerance (Inductor fuses and reorders the elementwise work), and [2/4] checks that the
compiled layers send exactly the formula's messages.

and ends with a line starting MATCH (exit 0) or MISMATCH (exit 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from booktools.demo import (Results, Run, busiest_rank_communication, check_at_least_one, communication_report,
                            demo_parser, run_demo)
from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.parallelize import validate_layout
from minimegatron.testing import TOLERANCES, Tolerance, forward_operations

GRANULARITIES = ("none", "selective", "full")


PACKED = dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)


@dataclass
class RecomputeResults(Results):
    """What report printed: calls per dimension on the busiest rank; memory_table's rows (name,
    measured, formula, per_layer, korthikanti bytes); the timed rows' ms; with --kernels triton
    kernel_errors' [what, error, tolerance], attention_bytes ({seq, naive, flash}) and
    loss_bytes ({vocab, unfused, fused}); with --pack {packed, mixed, tolerance}."""
    calls: dict = field(default_factory=dict)
    memory: list = field(default_factory=list)
    times_ms: list = field(default_factory=list)
    kernel_errors: list = field(default_factory=list)
    attention_bytes: list = field(default_factory=list)
    loss_bytes: list = field(default_factory=list)
    packed: dict | None = None


@dataclass(frozen=True)
class RecomputeRun(Run):
    def global_batches(self) -> list[dict[str, torch.Tensor]]:
        """testing.global_batches; with packed documents (the three switches on) every 7th token,
        from the 6th, an <eod> (the vocabulary's last id), and document_masks' keys added."""
        batches = super().global_batches()
        if not self.train.reset_attention_mask:
            return batches
        return [pack(batch, self.model.vocab_size - 1) for batch in batches]

    def name(self) -> str:
        t = self.train
        what = ("no recompute" if t.recompute_granularity is None else
                f"full recompute ({t.recompute_method}, {t.recompute_num_layers})"
                if t.recompute_granularity == "full" else f"selective recompute ({', '.join(t.recompute_modules)})")
        parts = [f"tp={self.tp}" + (" + SP" if self.sp else "")] + [f"{k}={getattr(self, k)}" for k in ("cp", "pp")
                                                                    if getattr(self, k) > 1]
        if t.expert_model_parallel_size > 1:
            parts.append(f"ep={t.expert_model_parallel_size}")
        extras = (", packed documents" * t.reset_attention_mask + ", Triton kernels" * (t.kernels == "triton")
                  + ", compiled layers" * (t.kernels == "compile"))
        return f"{what}{extras}: " + " x ".join(parts + [f"dp={self.dp}"])


def pack(batch: dict[str, torch.Tensor], eod: int) -> dict[str, torch.Tensor]:
    """A batch whose rows hold documents of 7 tokens ending with `eod`, and their masks."""
    from minimegatron.data import document_masks
    tokens = batch["tokens"].clone()
    tokens[:, 5::7] = eod
    labels = torch.cat([tokens[:, 1:], batch["labels"][:, -1:]], dim=1)
    return {"tokens": tokens, "labels": labels, **document_masks(tokens, eod, **PACKED)}


def packed_equals_alone(model_cfg: ModelConfig, lengths=(5, 9, 4, 14)) -> tuple[float, float]:
    """One process: documents of `lengths` tokens packed into one row with the three switches'
    masks, against each document run alone (positions from 0). Returns (max |logit difference|
    packed with the masks against alone, the same without the masks for the documents after
    the first, the tolerance of the first: testing.rounding_tolerance in the model's dtype over
    forward_operations at the packed length, of the largest |logit| alone)."""
    from minimegatron.testing import rounding_tolerance
    from minimegatron.data import document_masks
    from minimegatron.model import GPTModel
    model = GPTModel(dataclasses.replace(model_cfg, num_experts=None)).eval()
    eod = model_cfg.vocab_size - 1
    g = torch.Generator().manual_seed(0)
    docs = [torch.cat([torch.randint(0, eod, (n - 1,), generator=g), torch.tensor([eod])]) for n in lengths]
    packed = torch.cat(docs).unsqueeze(0)                                             # [1, s]
    masks = document_masks(packed, eod, reset_position_ids=True, reset_attention_mask=True)
    with torch.no_grad():
        together = model(packed, position_ids=masks["position_ids"], document_ids=masks["document_ids"])[0]
        mixed = model(packed)[0]
        alone = torch.cat([model(doc.unsqueeze(0))[0] for doc in docs])
    first = lengths[0]
    tolerance = rounding_tolerance(model_cfg.dtype, forward_operations(model_cfg, sum(lengths)),
                                   alone.abs().max().item())
    return (together - alone).abs().max().item(), (mixed[first:] - alone[first:]).abs().max().item(), tolerance


def tiny_model(layers: int = 2, experts: int | None = None, cp: int = 1, kernels: str = "torch") -> ModelConfig:
    """The demo's model in float64, dropout 0.1 (attention dropout 0 under cp > 1, which the
    ring does not support: chapter 04). With the Triton kernels: float32 (they compute in it)
    and no attention dropout (the Triton FlashAttention has none). Compiled: float32 (the
    CPU's compiled path) and no dropout (Inductor draws its own masks)."""
    triton, compiled = kernels == "triton", kernels == "compile"
    return ModelConfig.llama(hidden_size=32, num_layers=layers, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=64, vocab_size=64, max_position_embeddings=64,
                             params_dtype="float32" if triton or compiled else "float64",
                             hidden_dropout=0.0 if compiled else 0.1,
                             attention_dropout=0.0 if cp > 1 or triton or compiled else 0.1,
                             **({"num_experts": experts, "moe_router_topk": 2} if experts else {}))


def make_run(model: ModelConfig, granularity: str = "full", tp: int = 1, cp: int = 1, pp: int = 1, dp: int = 1, *,
             sp: bool = False, ep: int = 1, method: str = "uniform", num_layers: int = 1,
             modules: tuple[str, ...] = ("core_attn",), micro_batches: int = 2, steps: int = 2,
             seq: int = 32, packed: bool = False, kernels: str = "torch") -> RecomputeRun:
    """A validated RecomputeRun (ConfigError naming the numbers before any process starts)."""
    full = granularity == "full"
    train = TrainConfig(seq_length=seq, micro_batch_size=2, grad_accum_steps=micro_batches, train_iters=steps,
                        lr=1e-2, lr_warmup_iters=0, clip_grad=1.0, progress=False, eval_interval=0,
                        recompute_granularity=None if granularity == "none" else granularity,
                        recompute_method=method if full else None, recompute_num_layers=num_layers if full else None,
                        recompute_modules=tuple(modules), tensor_model_parallel_size=tp, context_parallel_size=cp,
                        pipeline_model_parallel_size=pp, sequence_parallel=sp, expert_model_parallel_size=ep,
                        kernels=kernels, **(PACKED if packed else {}))
    validate_layout(model, train, tp * cp * pp * dp)
    return RecomputeRun(model, train, dp)


# ---------------------------------------------------------------------------------------
# on every rank
# ---------------------------------------------------------------------------------------
def train_run(run: RecomputeRun) -> dict:
    """Spawn (or torchrun) target: the layout trained without recompute, then with it, each from
    the random states the training loop seeds (train._run); under --kernels compile eagerly,
    then compiled (the "recompute" run is the compiled one); returns both runs' losses,
    first-step gradients and final parameters (full, single-device names) and, for the run
    with recompute, what run_report reads of a rank ("records" by dimension, "pp_rank",
    "ep_group")."""
    from minimegatron.parallel_state import get_group_ranks
    from minimegatron.run_report import KEYS_OF_THIS_RANK, records_by_dimension
    from minimegatron.testing import train_layout
    from minimegatron.tp import model_parallel_manual_seed

    out = {}
    plain = dataclasses.replace(run.train, recompute_granularity=None, recompute_method=None,
                                recompute_num_layers=None,
                                recompute_modules=TrainConfig.__dataclass_fields__["recompute_modules"].default,
                                kernels="torch" if run.train.kernels == "compile" else run.train.kernels)
    for label, cfg in (("plain", plain), ("recompute", run.train)):
        seed = lambda chunks, layout, cfg=cfg: model_parallel_manual_seed(   # noqa: E731
            cfg.data_seed, tp_rank=layout.tp_rank, pp_rank=layout.pp_rank)
        result, _, layout, _ = train_layout(run.model, cfg, run.dp, run.global_batches(), after_build=seed)
        out[label] = {k: result[k] for k in ("losses", "grads", "params")}
    groups = {k: get_group_ranks(k) for k in KEYS_OF_THIS_RANK} if layout.world > 1 else {}
    out.update(records=records_by_dimension(result["records"], groups), pp_rank=result["pp_rank"],
               ep_group=groups.get("ep", []))
    return out


# ---------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------
COMPILED = dict(loss=1e-5, rtol=1e-3, atol=1e-5)     # tests/test_compile.py's float32 tolerance


def reordered_sums(cfg: TrainConfig) -> bool:
    """Whether recompute adds some gradients in another order than the run without it: the
    layernorm module. Its input x has three uses (the residual, and x and x^2 inside the
    norm); recomputed, the norm's two are summed inside the recompute's backward before the
    residual's is added, (a + b) + c instead of the order autograd takes without it."""
    return cfg.recompute_granularity == "selective" and "layernorm" in cfg.recompute_modules


def bit_for_bit(per_rank: list[dict], compiled: bool = False, reordered: Tolerance | None = None
                ) -> tuple[list[str], list[str]]:
    """(lines, problems): on every rank, each loss, gradient and parameter with recompute
    against the same without it, compared with torch.equal; `compiled`: the compiled run
    against the eager one, within COMPILED; `reordered`: within this summation-order
    tolerance (reordered_sums: the dtype's row of testing.TOLERANCES)."""
    problems = []
    within = (Tolerance(**COMPILED) if compiled else reordered)

    def same(got, want) -> bool:
        if within is None:
            return torch.equal(got, want)
        return torch.allclose(got, want, rtol=within.rtol, atol=within.atol)
    for rank, r in enumerate(per_rank):
        plain, run = r["plain"], r["recompute"]
        far = max(abs(a - b) for a, b in zip(run["losses"], plain["losses"]))
        if (far > within.loss) if within is not None else run["losses"] != plain["losses"]:
            problems.append(f"rank {rank}: losses {run['losses']} against {plain['losses']}")
        for kind in ("grads", "params"):
            for name, want in plain[kind].items():
                if not same(run[kind][name], want):
                    problems.append(f"rank {rank}: {kind[:-1]} {name} differs by "
                                    f"{(run[kind][name] - want).abs().max().item():.1e}")
    tensors = len(per_rank[0]["plain"]["grads"]) + len(per_rank[0]["plain"]["params"])
    lines = [f"  losses {per_rank[0]['recompute']['losses']}",
             f"  {'equal' if not problems else 'NOT equal'} on all {len(per_rank)} ranks: the losses, and {tensors} "
             f"gradient and parameter tensors " + (f"(within loss {within.loss:g}, rtol {within.rtol:g}, "
                                                   f"atol {within.atol:g})" if within is not None else "(torch.equal)")]
    if reordered is not None and not compiled:
        lines.append("  (not torch.equal: recomputing the norms sums their inputs' gradients in another order; "
                     "within the model dtype's row of testing.TOLERANCES)")
    return lines, problems


def requested_recompute(cfg: TrainConfig) -> tuple[str, dict] | None:
    """(the row's name, activation_memory's recompute fields) of the recompute `cfg` asks for,
    or None without one. Routed-expert modules (moe, moe_act) are left out: the memory model is
    dense, where they recompute nothing (the same as none)."""
    if cfg.recompute_granularity is None:
        return None
    if cfg.recompute_granularity == "full":
        return (f"full, {cfg.recompute_method} {cfg.recompute_num_layers}",
                dict(recompute_granularity="full", recompute_method=cfg.recompute_method,
                     recompute_num_layers=cfg.recompute_num_layers))
    dense = tuple(m for m in cfg.recompute_modules if m not in ("moe", "moe_act"))
    return (f"selective {', '.join(dense) or '(none dense)'}",
            dict(recompute_granularity="selective", recompute_modules=dense) if dense else {})


def memory_table(seq: int = 256, batch: int = 1, requested: tuple[str, dict] | None = None) -> list[dict]:
    """One process: for each recompute, the bytes one micro-batch keeps for the backward in a
    4-layer GPT-2-style bf16 model (h 64, a 4, dropout 0.1, the naive attention whose [s, s]
    scores Korthikanti et al. count), measured (analysis.measure_saved_activation_bytes) and by
    analysis.activation_memory; per layer beside the paper's formulas. Rows: none, selective
    core_attn, full uniform 1 (the paper's three), then `requested` ((name, recompute fields):
    requested_recompute) when it is none of them, its "korthikanti" None."""
    from minimegatron.analysis import activation_memory, measure_saved_activation_bytes
    from minimegatron.model import GPTModel
    from minimegatron.recompute import apply_recompute

    model_cfg = ModelConfig.gpt2(hidden_size=64, num_layers=4, num_attention_heads=4, vocab_size=256,
                                 max_position_embeddings=seq, params_dtype="bfloat16", hidden_dropout=0.1,
                                 attention_dropout=0.1, attention_backend="naive")
    b, s, h, a, L = batch, seq, 64, 4, model_cfg.num_layers
    cases = [("none", {}, s * b * h * (34 + 5 * a * s / h)),
             ("selective core_attn", dict(recompute_granularity="selective", recompute_modules=("core_attn",)),
              34 * s * b * h),
             ("full, uniform 1", dict(recompute_granularity="full", recompute_method="uniform",
                                      recompute_num_layers=1), 2 * s * b * h)]
    if requested is not None and requested[1] not in [recompute for _, recompute, _ in cases]:
        cases.append((requested[0], requested[1], None))
    torch.manual_seed(0)
    tokens, labels = torch.randint(0, 256, (b, s)), torch.randint(0, 256, (b, s))
    rows = []
    for name, recompute, korthikanti in cases:
        model = apply_recompute(GPTModel(model_cfg), recompute.get("recompute_granularity"),
                                recompute.get("recompute_method"), recompute.get("recompute_num_layers"),
                                recompute.get("recompute_modules", ("core_attn",))).train()
        formula = activation_memory(model_cfg, b, s, **recompute)
        measured = measure_saved_activation_bytes(model, tokens, labels)
        rows.append({"name": name, "measured": measured, "formula": formula["total"],
                     "per_layer": formula["layers"] / L, "korthikanti": korthikanti, "model": model,
                     "tokens": tokens, "labels": labels})
    return rows


def memory_lines(rows: list[dict]) -> tuple[list[str], list[str]]:
    lines, problems = [], []
    for r in rows:
        same = r["measured"] == r["formula"]
        paper = f" (Korthikanti {r['korthikanti']:>9,.0f})" if r["korthikanti"] is not None else " (this run's recompute)"
        lines.append(f"  {r['name']:<20} {r['measured']:>11,} bytes measured {'=' if same else '!='} formula "
                     f"{r['formula']:>11,}; per layer {r['per_layer']:>9,.0f}{paper}")
        if not same:
            problems.append(f"{r['name']}: measured {r['measured']:,} bytes, activation_memory {r['formula']:,}")
    none, full = rows[0]["per_layer"], rows[2]["per_layer"]
    lines.append(f"  per layer, selective keeps {rows[1]['per_layer'] / none:.2f} of it and full {full / none:.3f}")
    return lines, problems


def time_lines(rows: list[dict], repeats: int = 5) -> tuple[list[str], list[float]]:
    """(lines, seconds): the median of `repeats` forwards and backwards of each model of
    memory_table (after one untimed), and the ratio to no recompute (this machine, one thread;
    a benchmark's number, not a test's)."""
    seconds = []
    for r in rows:
        times = []
        r["model"](r["tokens"], labels=r["labels"]).sum().backward()        # warm-up: allocations, first calls
        for _ in range(repeats):
            start = time.perf_counter()
            r["model"](r["tokens"], labels=r["labels"]).sum().backward()
            times.append(time.perf_counter() - start)
        seconds.append(statistics.median(times))
    return [f"  {r['name']:<20} {t * 1e3:8.1f} ms a forward and backward, {t / seconds[0]:.2f} x no recompute"
            for r, t in zip(rows, seconds)], seconds


def kernel_errors() -> list[tuple[str, float]]:
    """One process, float32: each Triton kernel (minimegatron/kernels/) against the book's
    PyTorch function, forward and every gradient: [(what, max |difference|, tolerance)], the
    tolerance testing.rounding_tolerance in float32 of the largest |value| of the PyTorch
    result, over the longest chain of roundings behind it: attention 4 s + 2 d (the scores, the
    softmax's sum, the weighted sum, and the backward's sums over s and d), RMSNorm 2 h + the
    rows summed into dw, SwiGLU 8 (its elementwise chain, exp inside the sigmoid)."""
    from minimegatron.testing import rounding_tolerance
    from minimegatron.kernels.flash_attention import flash_attention
    from minimegatron.kernels.rmsnorm import rms_norm
    from minimegatron.kernels.swiglu import swiglu
    from minimegatron.model.attention import sdpa_attention
    from minimegatron.model.linear import RMSNorm
    from minimegatron.model.mlp import mlp_activation

    def run(fn, inputs, dout):
        inputs = [x.clone().requires_grad_() for x in inputs]
        out = fn(*inputs)
        out.backward(dout)
        return [out.detach()] + [x.grad for x in inputs]

    def norm(x, w):                                   # the book's module, its weight given
        return torch.func.functional_call(RMSNorm(w.shape[0], 1e-5), {"weight": w}, (x,))

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 40, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    x, w, y = torch.randn(2, 40, 48), torch.randn(48), torch.randn(2, 40, 96)
    cases = [("FlashAttention-2 (GQA, s 40, d 16)", ("out", "dq", "dk", "dv"), flash_attention, sdpa_attention,
              (q, k, v), torch.randn(2, 4, 40, 16), 4 * 40 + 2 * 16),
             ("RMSNorm (h 48)", ("y", "dx", "dw"), lambda x, w: rms_norm(x, w, 1e-5), norm, (x, w),
              torch.randn(2, 40, 48), 2 * 48 + 2 * 40),
             ("SwiGLU (f 48)", ("out", "dy"), swiglu, lambda y: mlp_activation(y, True), (y,), torch.randn(2, 40, 48),
              8)]
    out = []
    for name, parts, kernel, reference, inputs, dout, operations in cases:
        for part, a, b in zip(parts, run(kernel, inputs, dout), run(reference, inputs, dout)):
            out.append((f"{name} {part}", (a - b).abs().max().item(),
                        rounding_tolerance(torch.float32, operations, b.abs().max().item())))
    return out


def saved_bytes(fn) -> int:
    """The bytes of the storages fn()'s autograd graph keeps for the backward, counted once."""
    storages = {}

    def pack(t):
        storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kept = fn()
    del kept
    return sum(storages.values())


def attention_saved_bytes(seq: int = 512, block: int = 16) -> dict[str, int]:
    """One process, float32, b 1, a 4, d 16: the bytes one causal attention call keeps for its
    backward, the book's written-out attention against the Triton FlashAttention (q, k, v, out
    and one float32 log-sum-exp per row; `block` queries and keys a program: the same bytes, and
    larger blocks run the interpreter faster at long sequences)."""
    from functools import partial

    from minimegatron.kernels.flash_attention import flash_attention
    from minimegatron.model.attention import causal_attention

    q, k, v = (torch.randn(1, 4, seq, 16, requires_grad=True) for _ in range(3))
    flash = partial(flash_attention, block_m=block, block_n=block)
    return {name: saved_bytes(lambda attend=attend: attend(q, k, v))
            for name, attend in (("naive", causal_attention), ("flash", flash))}


def loss_saved_bytes(vocab: int, tokens: int = 64, hidden: int = 32) -> dict[str, int]:
    """One process, float32: the bytes the output layer and the loss keep for the backward over
    `tokens` tokens, unfused (the logits, then the book's loss: log-probabilities [T, V]) and
    fused (kernels/cross_entropy.linear_cross_entropy: one log-sum-exp a token and the labels),
    the inputs x and W left out."""
    from minimegatron.kernels.cross_entropy import linear_cross_entropy
    from minimegatron.model.gpt import language_model_loss

    x, w = torch.randn(tokens, hidden, requires_grad=True), torch.randn(vocab, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    inputs = x.untyped_storage().nbytes() + w.untyped_storage().nbytes()
    unfused = saved_bytes(lambda: language_model_loss((x @ w.t()).view(1, tokens, vocab), labels.view(1, tokens)))
    fused = saved_bytes(lambda: linear_cross_entropy(x, w, labels, chunk=16))
    return {"unfused": unfused - inputs, "fused": fused - inputs}


def report(args, run: RecomputeRun, per_rank: list[dict]) -> RecomputeResults:
    compiled = run.train.kernels == "compile"
    reordered = TOLERANCES[run.model.dtype] if reordered_sums(run.train) else None
    exact, problems = bit_for_bit(per_rank, compiled, reordered)
    print(f"model: llama, h=32 L={run.model.num_layers}, {run.model.params_dtype}, dropout {run.model.hidden_dropout} "
          f"(attention {run.model.attention_dropout})")
    print(f"[1/4] {'compiled against eager' if compiled else 'with recompute against without'}, from the same "
          f"random states, over {run.train.train_iters} steps:")
    print("\n".join(exact))
    comm_lines, comm_problems = communication_report(run.model, run.train, per_rank)
    print(f"[2/4] one step's communication {'compiled' if compiled else 'with recompute'} per dimension (the busiest rank), against "
          "analysis.step_communication:")
    print("\n".join(comm_lines))
    rows = memory_table(requested=None if compiled else requested_recompute(run.train))
    mem_lines, mem_problems = memory_lines(rows)
    busiest = busiest_rank_communication(per_rank)                  # what communication_report printed
    out = RecomputeResults(calls={dim: row["calls"] for dim, row in busiest.items()}, memory=[{k: r[k] for k in (
        "name", "measured", "formula", "per_layer", "korthikanti")} for r in rows])
    print("[3/4] what one micro-batch keeps for the backward (one process, GPT-2 style, bf16, h 64, 4 layers, "
          "s 256, naive attention, dropout 0.1), against analysis.activation_memory:")
    print("\n".join(mem_lines))
    if not args.quick:
        print("[4/4] time, one process, one thread (this machine):")
        lines, seconds = time_lines(rows)
        print("\n".join(lines))
        out.times_ms = [1e3 * t for t in seconds]
    problems += comm_problems + mem_problems
    if run.train.kernels == "triton":
        print("[kernels] each Triton kernel against the book's PyTorch function, float32, Triton's interpreter on a CPU:")
        out.kernel_errors = [list(e) for e in kernel_errors()]
        for what, error, tolerance in out.kernel_errors:
            print(f"  {what:<40} max |difference| {error:.1e} (tolerance {tolerance:.0e})")
            if not error <= tolerance:
                problems.append(f"{what} differs by {error:.1e} > {tolerance:.1e}")
        kept = attention_saved_bytes()
        out.attention_bytes.append({"seq": 512, **kept})
        print(f"  one causal attention at s 512 (a 4, d 16, float32) keeps {kept['naive']:,} bytes for its backward "
              f"written out, {kept['flash']:,} as FlashAttention-2 (no [s, s] matrix)")
        if not args.quick:
            print("  the same at longer sequences (blocks of 128 in the interpreter; the bytes do not depend on them):")
            for seq in (1024, 2048, 4096):
                kept = attention_saved_bytes(seq, block=128)
                out.attention_bytes.append({"seq": seq, **kept})
                print(f"    s {seq:>5}: written out {kept['naive']:>13,} bytes, FlashAttention-2 {kept['flash']:>11,} "
                      f"({kept['naive'] / kept['flash']:.0f} x less)")
            for vocab in (257, 128256):
                kept = loss_saved_bytes(vocab)
                out.loss_bytes.append({"vocab": vocab, **kept})
                print(f"  the output layer and loss over 64 tokens at V {vocab:,}: unfused keeps {kept['unfused']:,} "
                      f"bytes, fused {kept['fused']:,} ({kept['unfused'] / 64:,.0f} and {kept['fused'] / 64:,.0f} a token)")
    if run.train.reset_attention_mask:
        packed, mixed, tolerance = packed_equals_alone(run.model)
        out.packed = {"packed": packed, "mixed": mixed, "tolerance": tolerance}
        print(f"[packed] documents of 5, 9, 4 and 14 tokens in one row, with --reset-position-ids "
              f"--reset-attention-mask: max |logit difference| to each document alone {packed:.1e} "
              f"(without the switches {mixed:.1e})")
        print(f"  tolerance {tolerance:.1e}: {run.model.params_dtype} round-off over the forward's "
              f"{forward_operations(run.model, 32):,} roundings (testing.rounding_tolerance)")
        if not packed <= tolerance:
            problems.append(f"a packed document's logits differ from its own by {packed:.1e}")
    if problems:
        out.verdict = f"MISMATCH: {run.name()}: {problems[0]}"
    elif compiled:
        out.verdict = (f"MATCH: {run.name()} equals the same run eager within float32's tolerance on every rank; "
                       f"every message is the formula's, and the bytes kept are the formulas'")
    elif reordered is not None:
        out.verdict = (f"MATCH: {run.name()} equals the same run without recompute within summation order on every "
                       f"rank; every recomputed message is the formula's, and the bytes kept are the formulas'")
    else:
        out.verdict = (f"MATCH: {run.name()} equals the same run without recompute bit for bit on every rank; every "
                       f"recomputed message is the formula's, and the bytes kept are the formulas'")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = demo_parser("07", "Chapter 07: train the tiny model with and without activation recompute under any "
                               "layout, check that they are equal bit for bit, the recomputed messages against the "
                               "formulas, and the memory each recompute keeps.")
    parser.add_argument("--recompute", choices=GRANULARITIES, default=None,
                        help="default full (none with --kernels compile, which takes no recompute)")
    parser.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                        help="full only: uniform (units of --recompute-num-layers; the default) or block (the first "
                             "layers of each chunk)")
    parser.add_argument("--recompute-num-layers", type=int, default=None, help="full only (default 1)")
    parser.add_argument("--recompute-modules", nargs="+", default=None,
                        help="selective only: core_attn, mlp, moe, moe_act, layernorm (default core_attn)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp > 1)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size: > 1 gives the model 4 experts per layer")
    parser.add_argument("--dp", type=int, default=None, help="data-parallel replicas (default: world / (tp cp pp) "
                                                            "under torchrun, else 2)")
    parser.add_argument("--kernels", choices=["torch", "triton", "compile"], default="torch",
                        help="triton: the norms, FlashAttention-2, SwiGLU and the loss as Triton kernels (a float32 "
                             "model without attention dropout; interpreted on a CPU); compile: each layer through "
                             "torch.compile (a float32 model without dropout, no recompute)")
    parser.add_argument("--pack", action="store_true",
                        help="documents of 7 tokens in each row, with Megatron's --reset-position-ids "
                             "--reset-attention-mask --eod-mask-loss")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step (default 2)")
    parser.add_argument("--steps", type=int, default=2, help="AdamW steps (default 2)")
    parser.add_argument("--quick", action="store_true", help="no timing (what the tests run)")
    args = parser.parse_args(argv)
    if args.recompute is None:
        args.recompute = "none" if args.kernels == "compile" else "full"
    for flag, granularity in (("recompute_method", "full"), ("recompute_num_layers", "full"),
                              ("recompute_modules", "selective")):
        value = getattr(args, flag)
        if value is not None and args.recompute != granularity:
            shown = " ".join(value) if isinstance(value, list) else value
            parser.error(f"--{flag.replace('_', '-')} {shown} would be ignored: it is for --recompute {granularity}, "
                         f"and this run's recompute is {args.recompute}")
    args.recompute_method = args.recompute_method or "uniform"
    args.recompute_num_layers = 1 if args.recompute_num_layers is None else args.recompute_num_layers
    args.recompute_modules = args.recompute_modules or ["core_attn"]
    return check_at_least_one(parser, args, "tp", "cp", "pp", "ep", "dp", "micro_batches", "steps",
                              "recompute_num_layers")


def build_run(args: argparse.Namespace, dp: int) -> RecomputeRun:
    """The run every rank trains; ConfigError naming the numbers if it cannot (TrainConfig's
    and validate_layout's checks, Megatron's rules among them)."""
    if args.ep > 1 and args.tp > 1 and not args.sp:
        raise ConfigError(f"--ep {args.ep} with --tp {args.tp} needs --sp (chapter 05: each tp rank routes its own "
                          f"s/tp tokens)")
    model = tiny_model(layers=2 * args.pp, experts=4 if args.ep > 1 else None, cp=args.cp, kernels=args.kernels)
    return make_run(model, args.recompute, args.tp, args.cp, args.pp, dp, sp=args.sp, ep=args.ep,
                    method=args.recompute_method, num_layers=args.recompute_num_layers,
                    modules=tuple(args.recompute_modules), micro_batches=args.micro_batches, steps=args.steps,
                    packed=args.pack, kernels=args.kernels)


def main(argv=None) -> int:
    return run_demo(parse_args(argv), "07", build_run, train_run, report,
                    model_parallel=lambda args: {"tp": args.tp, "cp": args.cp, "pp": args.pp},
                    spawn_dp=lambda args: args.dp if args.dp is not None else 2)


if __name__ == "__main__":      # the guard matters: spawned ranks import this file again
    sys.exit(main().exit_code)
