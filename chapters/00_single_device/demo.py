"""Chapter 00: the single-device baseline that every later chapter is compared against.

The chapter's experiments and its demo in one file: first the functions (the notebook and the
tests use them too), then the command line.

    python chapters/00_single_device/demo.py                 # about 20 s on a laptop CPU
    python chapters/00_single_device/demo.py --quick         # a few seconds (what the tests run)
    torchrun --nproc_per_node=1 chapters/00_single_device/demo.py
    torchrun --nproc_per_node=4 chapters/00_single_device/demo.py --quick

From Python (a notebook, a test), through `booktools.demo.import_chapter`, which
imports this file as `chapters.00_single_device.demo` (a name the ranks of
`minimegatron.launch.spawn` can import too):

    ch00 = import_chapter("00")
    print(ch00.grad_accum_equivalence(torch.float64))     # MATCH ... / MISMATCH ...
    print(ch00.measure_budget(ch00.tiny_llama(), batch=4, seq=32))
    ch00.single_device_limits("gpt3-175b")                 # why one device is not enough
    launch.spawn(ch00.init_checksum_worker, 4, ch00.tiny_gpt2(num_layers=4))

Every experiment *measures* something and puts it next to what the book's formulas or its
single-device reference say, so that a check built on it can fail:

  - `grad_accum_equivalence`: k accumulated micro-batches against one big batch, through the
    equivalence harness of `minimegatron.testing` (the reference is the training loop's own
    step; the accumulation loop here is written out on purpose, so the two are independent);
  - `measure_budget`: parameter, gradient, Adam-state and activation bytes counted on a real
    model, and FLOPs counted by `torch.utils.flop_counter.FlopCounterMode`, next to
    `minimegatron.analysis`;
  - `init_checksum_worker`: run on N ranks by `minimegatron.launch.spawn` (or by this demo
    under torchrun); every rank builds the model with a different global RNG state and
    gathers fingerprints of its weights.

What the demo (`main`) does, in order:
  1. init      every rank builds the model from (seed, parameter name) with a different global
               RNG state, and the ranks all-gather fingerprints of their weights: they must be
               bit-identical (one rank: the check runs against a pipeline-stage-like slice);
  2. train     the tiny LLaMA-style model on the embedded corpus (the book's own text), with
               a progress bar; the loss curve goes to <out-dir>/loss.png;
  3. FLOPs     per token: the 6N rule next to the exact matmul count and the count measured by
               torch's FlopCounterMode;
  4. memory    parameters, gradients, Adam's two moments and the activations of one
               micro-batch: the formula of minimegatron.analysis next to bytes counted on the
               model (activations: the tensors autograd saves, seen by saved-tensor hooks);
  5. verdict   gradient accumulation over k micro-batches against one batch k times larger,
               in float64, through the equivalence harness of minimegatron.testing.

The last line starts with MATCH (exit status 0) or MISMATCH (exit status 1). Chapter 00 has
one device; with torchrun --nproc_per_node > 1 the ranks take part in step 1 and rank 0 alone
runs the rest (the parallel chapters give the other ranks work).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from booktools.demo import Results, check_at_least_one, demo_parser, largest_differences
from minimegatron import comm
from minimegatron.analysis import (activation_memory, count_parameters, does_it_fit, flops_per_token_6n,
                                   measure_saved_activation_bytes, training_flops, training_memory)
from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.launch import finish_torchrun, init_from_torchrun
from minimegatron.model import GPTModel, apply_rotary_pos_emb, finalize_model_grads, rope_cos_sin
from minimegatron.model.init import init_name
from minimegatron.optim import Optimizer, learning_rate
from minimegatron.parallel_state import Layout
from minimegatron.testing import (EquivalenceReport, RunRecord, compare_runs, make_batches, single_device_run,
                                  split_microbatches)
from minimegatron.train import before_optimizer_step, optimizer_step, train, train_step

__all__ = [
    "tiny_gpt2", "tiny_llama", "parameter_table", "future_leak", "rope_scores",
    "fingerprint", "model_fingerprints", "init_checksum_worker",
    "corpus_unigram_entropy", "accumulate_gradients", "accumulation_run", "grad_accum_equivalence",
    "BudgetRow", "Budget", "measure_budget", "single_device_limits", "parse_args", "main",
]


# ---------------------------------------------------------------------------------------
# the two model styles, tiny
# ---------------------------------------------------------------------------------------
def tiny_gpt2(**overrides) -> ModelConfig:
    """A GPT-2 style model small enough to train in seconds on one CPU core.

    h = 64, L = 2, a = 4 heads (multi-head attention), LayerNorm, GELU, learned absolute
    positions, biases, tied embeddings, byte vocabulary (V = 257), up to 64 positions.
    """
    base = dict(hidden_size=64, num_layers=2, num_attention_heads=4, max_position_embeddings=64)
    return ModelConfig.gpt2(**{**base, **overrides}).validate()


def tiny_llama(**overrides) -> ModelConfig:
    """The same sizes, LLaMA style: RMSNorm, SwiGLU, RoPE, no biases, untied embeddings and
    grouped-query attention with g = 2 key/value heads for the a = 4 query heads."""
    base = dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                max_position_embeddings=64)
    return ModelConfig.llama(**{**base, **overrides}).validate()


def parameter_table(model: torch.nn.Module) -> str:
    """One line per parameter: its Megatron-core name, shape and number of elements,
    then the total. Tied weights are listed (and counted) once, as `named_parameters` does."""
    rows = [(name, tuple(p.shape), p.numel()) for name, p in model.named_parameters()]
    width = max(len(name) for name, _, _ in rows)
    lines = [f"{'name':<{width}}  {'shape':<12}{'numel':>9}"]
    lines += [f"{name:<{width}}  {str(list(shape)):<12}{numel:>9,}" for name, shape, numel in rows]
    lines.append(f"{'total':<{width}}  {'':<12}{sum(r[2] for r in rows):>9,}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# attention and RoPE, measured
# ---------------------------------------------------------------------------------------
def future_leak(attention: Callable[..., torch.Tensor], *, seq: int = 8, cut: int = 5, batch: int = 2,
                heads: int = 3, head_dim: int = 4, seed: int = 0) -> float:
    """How much the outputs at positions < cut move when the keys and values at positions
    >= cut are replaced by other random numbers.

    attention: a function (query, key, value) -> output, all [b, n, s, d] (float64 here).
    Returns the largest absolute change of output[:, :, :cut]: exactly 0.0 for causal
    attention (position i reads only positions j <= i), > 0 for attention that sees the future.
    """
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, generator=g, dtype=torch.float64) for _ in range(3))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, cut:] = torch.randn(batch, heads, seq - cut, head_dim, generator=g, dtype=torch.float64)
    v2[:, :, cut:] = torch.randn(batch, heads, seq - cut, head_dim, generator=g, dtype=torch.float64)
    before, after = attention(q, k, v), attention(q, k2, v2)
    return (before[:, :, :cut] - after[:, :, :cut]).abs().max().item()


def rope_scores(query: torch.Tensor, key: torch.Tensor, positions: int, base: float = 10000.0) -> torch.Tensor:
    """The attention score of `query` placed at position m with `key` placed at position n.

    query, key: [d] vectors (d even). Each is rotated by RoPE (`apply_rotary_pos_emb`, the
    book's rotation) at every position 0..positions-1, then every pair is dotted.
    Returns [positions, positions] (row m, column n), in the dtype of `query`.
    RoPE's promise: the entry depends on m - n only (every diagonal is constant).
    """
    d = query.shape[-1]
    pos = torch.arange(positions)
    cos, sin = rope_cos_sin(pos, d, base, dtype=query.dtype)                     # [S, d]
    q = apply_rotary_pos_emb(query.expand(1, 1, positions, d), cos, sin)[0, 0]   # [S, d]
    k = apply_rotary_pos_emb(key.expand(1, 1, positions, d), cos, sin)[0, 0]     # [S, d]
    return q @ k.t()                                                             # [S, S]


# ---------------------------------------------------------------------------------------
# layout-independent initialisation, across ranks
# ---------------------------------------------------------------------------------------
def fingerprint(t: torch.Tensor) -> int:
    """A 63-bit number from the exact bytes of `t` (its dtype and shape included):
    equal fingerprints mean bit-identical tensors (up to a 2^-63 chance)."""
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return int.from_bytes(h.digest()[:8], "little") & (2**63 - 1)


def model_fingerprints(model: torch.nn.Module) -> dict[str, int]:
    """{parameter name: fingerprint} for every parameter of `model`, sorted by name."""
    return {name: fingerprint(p) for name, p in sorted(model.named_parameters())}


def init_checksum_worker(config: ModelConfig, rng_offset: int = 1000) -> dict:
    """Run on every rank (by `minimegatron.launch.spawn`): does every rank build the same weights?

    On rank r of W:
      1. seed the *global* torch RNG with rng_offset + r, so that anything drawing from it
         would differ between ranks (initialisation must not: it uses (seed, name) only);
      2. build the full GPTModel(config) and fingerprint every parameter;
      3. all-gather the fingerprints through `minimegatron.comm` (one explicit, recorded
         all_gather over the world): every rank gets the [W, P] table of all ranks' prints;
      4. build only a pipeline-stage-like slice of the model: layer r mod L, the embedding
         on rank 0 and the final norm and output layer on rank W-1 (`GPTModel(pre_process,
         post_process, layer_numbers)`), and check each of its parameters against the full
         model's parameter of the same name (for a tied output layer on a last stage that is
         not the first: the word embedding, see `model.init.init_name`).

    Returns {"rank", "world_size", "names" (P sorted parameter names), "table" (int64
    [W, P] gathered fingerprints), "stage_names", "stage_matches" (one bool per stage
    parameter), "ledger" (the communication table), "gathered_bytes"}.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rng_offset + rank)

    full = model_fingerprints(GPTModel(config))
    names = list(full)
    mine = torch.tensor([full[n] for n in names], dtype=torch.int64).unsqueeze(0)       # [1, P]
    with comm.record_communication() as ledger:
        table = comm.all_gather(mine, group=None, dim=0, tag="init")                  # [W, P]

    layer = rank % config.num_layers
    stage = GPTModel(config, pre_process=(rank == 0), post_process=(rank == world - 1), layer_numbers=[layer])
    stage_prints = model_fingerprints(stage)
    matches = [stage_prints[n] == full[init_name(n, config)] for n in stage_prints]
    return {"rank": rank, "world_size": world, "names": names, "table": table,
            "stage_names": list(stage_prints), "stage_matches": matches,
            "ledger": ledger.table(), "gathered_bytes": ledger.total_bytes()}


# ---------------------------------------------------------------------------------------
# a yardstick for the training run
# ---------------------------------------------------------------------------------------
def corpus_unigram_entropy(prefix: str | None = None) -> float:
    """The entropy, in nats per token, of the token frequencies of an indexed dataset
    (default: the embedded corpus, `data.build_default_corpus()`).

    This is the cross-entropy of the best predictor that ignores context (it always predicts
    the corpus's token frequencies), measured on the corpus itself. A language model whose
    loss goes below it has learned to use the preceding tokens.
    """
    import numpy as np

    from minimegatron.data import IndexedDataset, build_default_corpus

    dataset = IndexedDataset(prefix or build_default_corpus())
    counts = np.zeros(1, dtype=np.int64)
    for i in range(len(dataset)):
        doc = np.bincount(np.asarray(dataset[i], dtype=np.int64))
        if doc.size > counts.size:
            counts = np.pad(counts, (0, doc.size - counts.size))
        counts[: doc.size] += doc
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# ---------------------------------------------------------------------------------------
# gradient accumulation == one big batch
# ---------------------------------------------------------------------------------------
def accumulate_gradients(model: torch.nn.Module, microbatches: list[dict[str, torch.Tensor]],
                         scale_loss: bool = True) -> float:
    """Forward and backward every micro-batch, letting autograd add up the gradients.

    Written out here on purpose (the training loop's `train.forward_backward_no_pipelining`
    does the same) so that the equivalence check compares two independent pieces of code.
    `backward()` does `p.grad += d loss / d p`: accumulation is that `+=`. Each micro-batch's
    mean token loss is divided by k = len(microbatches), so that the sum of the k gradients is
    the gradient of the mean over all k * b sequences. `scale_loss=False` forgets the 1/k
    (a classic bug: the gradient comes out k times too large).
    Returns the mean loss of the whole batch (the sum of the k scaled losses).
    """
    total = 0.0
    for mb in microbatches:
        loss = model(mb["tokens"], labels=mb["labels"]).mean()          # mean over b * s tokens
        if scale_loss:
            loss = loss / len(microbatches)
        loss.backward()                                                 # grads accumulate (+=)
        total += loss.item()
    return total


def accumulation_run(model_cfg: ModelConfig, batches: list[dict[str, torch.Tensor]], micro_batches: int,
                     train_cfg: TrainConfig, scale_loss: bool = True) -> RunRecord:
    """Train with each global batch cut into `micro_batches` pieces, one optimizer step per
    global batch: `accumulate_gradients`, then the rest of the training loop's step
    (`train.train_step`: the gradient hooks, then `train.optimizer_step`: clip the global
    gradient norm, AdamW; zero the gradients).
    Returns the `RunRecord` (losses, first-step gradients, final parameters) that
    `testing.compare_runs` compares."""
    model = GPTModel(model_cfg)
    optimizer = Optimizer([model], train_cfg)
    losses, first_grads = [], {}

    def keep_first_grads():
        if not first_grads:
            first_grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    for step, batch in enumerate(batches):
        loss = accumulate_gradients(model, split_microbatches(batch, micro_batches), scale_loss)
        finalize_model_grads([model])
        keep_first_grads()
        optimizer_step(optimizer, learning_rate(step, train_cfg))
        losses.append(loss)
    return RunRecord(losses, first_grads, {n: p.detach().clone() for n, p in model.named_parameters()})


def grad_accum_equivalence(dtype: torch.dtype = torch.float64, *, config: ModelConfig | None = None,
                           micro_batches: int = 4, micro_batch_size: int = 2, seq_length: int = 16,
                           steps: int = 3, scale_loss: bool = True, seed: int = 0) -> EquivalenceReport:
    """Does accumulating k micro-batches give the same training as one batch k times larger?

    reference: `testing.single_device_run` (the training loop's step), one global batch of
               micro_batches * micro_batch_size sequences per step, no accumulation;
    candidate: `accumulation_run`, each global batch cut into `micro_batches` pieces.
    Both start from the same weights ((seed, name) init), see the same random token batches
    (`testing.make_batches`, seed `seed`), take `steps` AdamW steps (warm-up 0, no
    clipping), in `dtype` (the model is built in that dtype).

    Returns the `EquivalenceReport` (largest loss, first-step gradient and final parameter
    differences against the tolerance of `dtype` from `testing.TOLERANCES`); `str(report)`
    starts with MATCH or MISMATCH. The two runs add the same numbers in another order, so
    they agree to rounding (~1e-16 relative in float64), not bit for bit.
    """
    names = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16"}
    cfg = dataclasses.replace(config or tiny_llama(hidden_size=32, max_position_embeddings=seq_length),
                              params_dtype=names[dtype]).validate()
    train_cfg = TrainConfig(train_iters=steps, lr_warmup_iters=0, clip_grad=0.0, seq_length=seq_length)
    batches = make_batches(cfg, steps, micro_batches * micro_batch_size, seq_length, seed=seed)
    reference = single_device_run(cfg, batches, train_cfg)
    candidate = accumulation_run(cfg, batches, micro_batches, train_cfg, scale_loss=scale_loss)
    return compare_runs(reference, candidate, dtype)


# ---------------------------------------------------------------------------------------
# where memory and FLOPs go: formula next to measurement
# ---------------------------------------------------------------------------------------
@dataclass
class BudgetRow:
    what: str          # e.g. "gradients (bytes)"
    formula: int       # from minimegatron.analysis
    measured: int      # counted on the model
    how: str           # how it was measured

    @property
    def ok(self) -> bool:
        return self.formula == self.measured


@dataclass
class Budget:
    """Formula against measurement for one model and one [batch, seq] micro-batch."""
    config: ModelConfig
    batch: int
    seq: int
    rows: list[BudgetRow] = field(default_factory=list)
    flops_6n: int = 0                   # 6 N per token, N = non-embedding parameters (Kaplan)
    flops_6n_all: int = 0               # 6 N per token, N = every parameter
    flops_exact_per_token: float = 0.0  # training_flops / (b s)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def row(self, what: str) -> BudgetRow:
        return next(r for r in self.rows if r.what.startswith(what))

    def __str__(self) -> str:
        c = self.config
        style = "LLaMA" if c.normalization == "RMSNorm" else "GPT-2"
        lines = [f"{style} style, h={c.hidden_size} L={c.num_layers} a={c.num_attention_heads} "
                 f"g={c.query_groups} V={c.vocab_size}, {c.params_dtype}",
                 f"one training step on a micro-batch of b={self.batch} x s={self.seq} tokens",
                 f"{'':<20}{'formula':>13}{'measured':>13}",
                 "-" * 70]
        for r in self.rows:
            lines.append(f"{r.what:<20}{r.formula:>13,}{r.measured:>13,}  {'==' if r.ok else '!='}  {r.how}")
        lines.append("-" * 70)
        lines.append(f"FLOPs per token: 6N    = {self.flops_6n:,} (N without embeddings)")
        lines.append(f"                 6N    = {self.flops_6n_all:,} (N with embeddings)")
        lines.append(f"                 exact = {self.flops_exact_per_token:,.0f} "
                     f"({self.flops_exact_per_token / self.flops_6n:.2f} x the first 6N)")
        return "\n".join(lines)


def measure_budget(config: ModelConfig, batch: int, seq: int, seed: int = 0) -> Budget:
    """Build `config`'s model, run one training step on a random [batch, seq] micro-batch and
    count what it holds and computes, next to `minimegatron.analysis`:

      parameters (count)    sum of numel over `model.parameters()`   vs count_parameters
      parameters (bytes)    numel * element_size                     vs training_memory
      gradients (bytes)     the .grad tensors after backward          vs training_memory
      Adam m + v (bytes)    exp_avg + exp_avg_sq in AdamW's state     vs training_memory
                            after one step (its per-tensor `step` counters are not counted)
      activations (bytes)   storages autograd saves for backward       vs activation_memory
                            (`measure_saved_activation_bytes`, saved-tensor hooks)
      FLOPs (fwd + bwd)     `torch.utils.flop_counter.FlopCounterMode` vs training_flops,
                            counted on the written-out ("naive") attention: the counter does
                            not see inside PyTorch's fused CPU attention kernel ("sdpa")

    Returns a `Budget`; `str(budget)` is the table, `budget.ok` says every row agrees exactly.
    """
    from torch.utils.flop_counter import FlopCounterMode

    config.validate()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    labels = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    model = GPTModel(config)
    params = list(model.parameters())

    saved = measure_saved_activation_bytes(model, tokens, labels)
    # The same function and weights (initialised by name) with the written-out attention, whose
    # matmuls are the ones training_flops lists; the fused "sdpa" kernel is invisible to the counter.
    counted = GPTModel(dataclasses.replace(config, attention_backend="naive"))
    with FlopCounterMode(display=False) as counter:
        counted(tokens, labels=labels).mean().backward()
    optimizer, grads = Optimizer([model], TrainConfig()), []             # one step of the training loop
    with before_optimizer_step(optimizer, lambda: grads.extend(p.grad for p in params)):
        train_step([model], optimizer, [{"tokens": tokens, "labels": labels}], Layout(), TrainConfig().lr)
    state = [optimizer.state[p] for p in params]

    def nbytes(ts) -> int:
        return sum(t.numel() * t.element_size() for t in ts)

    mem = training_memory(config)
    counts = count_parameters(config)
    flops = training_flops(config, batch, seq)["total"]
    rows = [
        BudgetRow("parameters (count)", counts["total"], sum(p.numel() for p in params), "p.numel()"),
        BudgetRow("parameters (bytes)", mem["params"], nbytes(params), "numel x itemsize"),
        BudgetRow("gradients (bytes)", mem["grads"], nbytes(grads), "p.grad"),
        BudgetRow("Adam m + v (bytes)", mem["exp_avg"] + mem["exp_avg_sq"],
                  nbytes([s["exp_avg"] for s in state] + [s["exp_avg_sq"] for s in state]), "AdamW state"),
        BudgetRow("activations (bytes)", activation_memory(config, batch, seq)["total"], saved,
                  "saved-tensor hooks"),
        BudgetRow("FLOPs (fwd + bwd)", flops, int(counter.get_total_flops()), "FlopCounterMode"),
    ]
    return Budget(config, batch, seq, rows, flops_per_token_6n(config),
                  flops_per_token_6n(config, include_embedding=True), flops / (batch * seq))


# ---------------------------------------------------------------------------------------
# why one device stops being enough
# ---------------------------------------------------------------------------------------
def single_device_limits(name: str = "gpt3-175b", *, tokens: float = 300e9, device_memory_gib: float = 80,
                         device_flops: float = 312e12, mfu: float = 0.5, batch: int = 1) -> dict:
    """What training the published model `name` (`analysis.REAL_MODELS`) on ONE accelerator
    would take. Formulas only: nothing is allocated.

    Memory: `analysis.does_it_fit` (mixed-precision AdamW, 16 bytes per parameter, plus the
    activations of one [batch, seq] micro-batch at the model's training context).
    Time: 6 N D FLOPs (N every parameter, D = `tokens`; GPT-3 trained on 300e9) at
    `mfu` x `device_flops` (default: an A100's 312 dense bf16 TFLOP/s, at 50 % model FLOPs utilisation, MFU).

    Returns does_it_fit's dict (params, grads, optimizer, activations, total, fits,
    devices_needed, table, ...) plus "train_flops", "seconds", "years".
    """
    report = does_it_fit(name, device_memory_gib=device_memory_gib, batch=batch)
    flops = 6 * report["num_parameters"] * tokens
    seconds = flops / (device_flops * mfu)
    report.update(train_flops=flops, seconds=seconds, years=seconds / (365.25 * 24 * 3600))
    return report


# ---------------------------------------------------------------------------------------
# the demo: python chapters/00_single_device/demo.py [--quick] (or under torchrun)
# ---------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = demo_parser("00", "Chapter 00: train the single-device baseline, account for its memory and FLOPs, "
                               "and check that gradient accumulation equals one big batch (float64).")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny, fast run (smaller model, 15 training steps); what the tests use")
    parser.add_argument("--style", choices=["llama", "gpt2"], default="llama",
                        help="model style (default: llama)")
    parser.add_argument("--train-iters", type=int, default=None,
                        help="training steps (default: 150, or 15 with --quick)")
    parser.add_argument("--micro-batches", type=int, default=4,
                        help="k, the micro-batches accumulated in the equivalence check (default: 4)")
    parser.add_argument("--out-dir", default="runs/ch00_demo",
                        help="where the loss log and loss.png go (default: runs/ch00_demo)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--forget-loss-scaling", action="store_true",
                        help="break the accumulation on purpose (no 1/k on the micro-batch losses) "
                             "to see the check fail")
    return check_at_least_one(parser, parser.parse_args(argv), "train_iters", "micro_batches")


@dataclass
class SingleDeviceResults(Results):
    """What main printed (rank 0): the training loss first and last (3 decimals, as printed),
    FLOPs per token by the 6N rule, exactly and measured, and the largest differences of
    gradient accumulation from one big batch."""
    parameters: int = 0
    loss_first: float = 0.0
    loss_last: float = 0.0
    flops_6n: int = 0
    flops_exact_per_token: float = 0.0
    flops_measured_per_token: float = 0.0
    max_loss_diff: float = 0.0
    max_grad_diff: float = 0.0
    max_param_diff: float = 0.0


def main(argv=None) -> SingleDeviceResults:
    args = parse_args(argv)
    rank, world = init_from_torchrun()
    make = tiny_llama if args.style == "llama" else tiny_gpt2
    sizes = dict(hidden_size=32, max_position_embeddings=32) if args.quick else {}
    config = make(**sizes)
    say = print if rank == 0 else (lambda *a, **k: None)
    failures: list[str] = []

    # 1. layout-independent init, across the ranks of this job -------------------------
    init_cfg = make(**{**sizes, "num_layers": max(world, 2)})
    result = init_checksum_worker(init_cfg)
    table = result["table"]
    same = bool((table == table[0]).all())
    say(f"[1/5] init: {world} rank(s) built the model from (seed, parameter name), each with another "
        f"global RNG state:\n      {len(result['names'])} parameter tensors "
        f"{'bit-identical on every rank' if same else 'DIFFERENT between ranks'}; rank 0's pipeline-stage "
        f"slice equals the full model: {all(result['stage_matches'])}")
    if not same:
        failures.append("ranks built different initial weights")
    if not all(result["stage_matches"]):
        failures.append("a stage's weights differ from the full model's")
    if world > 1:
        # every rank learns whether some rank's slice failed (one more all-gather)
        ok = comm.all_gather(torch.tensor([int(all(result["stage_matches"]))]), group=None)
        if not bool(ok.all()):
            failures.append(f"stage slices differ from the full model on ranks {(ok == 0).nonzero().flatten().tolist()}")
        say(f"      the other {world - 1} rank(s) stop here: chapter 00 trains on one device")
        # every rank leaves the process group; rank 0 goes on alone, as a world of one (the
        # training loop would otherwise build its process groups with ranks that are gone)
        dist.destroy_process_group()
        if rank != 0:
            return SingleDeviceResults()

    # 2. train ------------------------------------------------------------------------
    iters = args.train_iters if args.train_iters is not None else (15 if args.quick else 150)
    seq, mbs = (32, 4) if args.quick else (64, 8)
    train_cfg = TrainConfig(seq_length=seq, micro_batch_size=mbs, train_iters=iters,
                            lr_warmup_iters=max(1, iters // 10), eval_interval=max(1, iters // 3),
                            eval_iters=2 if args.quick else 4, out_dir=args.out_dir,
                            progress=not args.no_progress)
    counts = count_parameters(config)
    style = "LLaMA" if args.style == "llama" else "GPT-2"
    say(f"[2/5] train: {style} style, h={config.hidden_size} L={config.num_layers} a={config.num_attention_heads} "
        f"g={config.query_groups}, {counts['total']:,} parameters ({counts['non_embedding']:,} non-embedding), "
        f"{iters} steps of {mbs} x {seq} tokens")
    start = time.perf_counter()
    run = train(config, train_cfg)
    found = SingleDeviceResults(parameters=counts["total"], loss_first=round(run.losses[0], 3),
                                loss_last=round(run.losses[-1], 3))
    val = f", validation {run.eval_losses[-1][1]:.3f}" if run.eval_losses else ""
    say(f"      loss {found.loss_first:.3f} -> {found.loss_last:.3f}{val} "
        f"(ln V = {torch.log(torch.tensor(float(config.vocab_size))).item():.3f} is a uniform guess) "
        f"in {time.perf_counter() - start:.1f} s; curve: {os.path.join(args.out_dir, 'loss.png')}")

    # 3 + 4. FLOPs and memory, formula vs measured --------------------------------------
    b, s = (2, 16) if args.quick else (mbs, seq)
    budget = measure_budget(config, b, s)
    flops = budget.row("FLOPs")
    found.flops_6n, found.flops_exact_per_token = budget.flops_6n, budget.flops_exact_per_token
    found.flops_measured_per_token = flops.measured / (b * s)
    say(f"[3/5] FLOPs per token (train = forward + backward):\n"
        f"      6N rule   {budget.flops_6n:>12,}   (N = {counts['non_embedding']:,} non-embedding parameters)\n"
        f"      exact     {budget.flops_exact_per_token:>12,.0f}   (every matmul, incl. attention and logits; "
        f"{budget.flops_exact_per_token / budget.flops_6n:.2f} x 6N)\n"
        f"      measured  {flops.measured / (b * s):>12,.0f}   (torch FlopCounterMode)")
    say("[4/5] memory and FLOPs of one training step, formula vs measured:")
    say("      " + str(budget).replace("\n", "\n      "))
    for row in budget.rows:
        if not row.ok:
            failures.append(f"{row.what}: formula {row.formula:,} != measured {row.measured:,}")

    # 5. the verdict ------------------------------------------------------------------
    k = args.micro_batches
    report = grad_accum_equivalence(torch.float64, config=make(**{**sizes, "max_position_embeddings": 16}),
                                         micro_batches=k, steps=2 if args.quick else 3,
                                         scale_loss=not args.forget_loss_scaling)
    say(f"[5/5] gradient accumulation ({k} micro-batches of 2) vs one batch of {2 * k}, "
        f"{2 if args.quick else 3} AdamW steps, float64:")
    lines = str(report).splitlines()
    say("      " + "\n      ".join(lines[:4] + (lines[4:7] + [f"  ... {len(lines) - 7} more"] if len(lines) > 8 else lines[4:])))
    if not report.ok:
        failures.insert(0, "gradient accumulation differs from one big batch")

    diffs = largest_differences([report])
    found.max_loss_diff, found.max_grad_diff, found.max_param_diff = (
        float(f"{x:.1e}") for x in (report.max_loss_diff, report.max_grad_diff, report.max_param_diff))
    found.verdict = (f"MISMATCH: {'; '.join(failures)}; {diffs}" if failures else
                     f"MATCH: {k} accumulated micro-batches equal one batch of {2 * k} on the single device (float64): "
                     f"{diffs}; memory and FLOPs formulas equal the measurement")
    found.exit_code = 1 if failures else 0
    say(found.verdict)
    return found


if __name__ == "__main__":
    sys.exit(finish_torchrun(main().exit_code))
