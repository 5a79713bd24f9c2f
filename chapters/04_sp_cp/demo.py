"""Chapter 04 demo: sequence and context parallelism, proven on tp x cp x pp x dp ranks.

    torchrun --standalone --nproc_per_node=2 chapters/04_sp_cp/demo.py --tp 2 --sp
    torchrun --standalone --nproc_per_node=4 chapters/04_sp_cp/demo.py --cp 4 --cp-comm-type p2p
    torchrun --standalone --nproc_per_node=4 chapters/04_sp_cp/demo.py --cp 4 --cp-comm-type a2a+p2p
    torchrun --standalone --nproc_per_node=16 chapters/04_sp_cp/demo.py --tp 2 --sp --cp 2 --pp 2 --dp 2   # 4D
    python chapters/04_sp_cp/demo.py                  # no torchrun: spawns the ranks (cp 2, p2p) itself
    python chapters/04_sp_cp/demo.py --quick --tp 2 --sp --cp 2

This file is the chapter's experiment and its command line. The tests, the graders, the
notebook and make_figures.py run the same experiment from Python:

    from minimegatron.launch import spawn
    from booktools.demo import import_chapter
    ch04 = import_chapter("04")              # this file, as chapters.04_sp_cp.demo
    run = ch04.make_run(ch04.tiny_model(), cp=2, cp_comm_type="p2p")
    per_rank = spawn(ch04.train_run, run.world, run)
    print(ch04.check_run(run, per_rank))          # equivalence, ledger vs formulas, memory

A `SeqRun` trains one model on tp x cp x pp x dp ranks (Megatron's order tp-cp-dp-pp: tp
fastest). Every rank builds its model as the training loop does (parallelize.build_model:
pipeline chunk -> tensor parallel, with sequence parallelism if asked -> context parallel ->
DDP over the dp x cp ranks) and runs train.train_step on its micro-batches: its data-parallel
replica's sequences, cut to its context-parallel tokens (train.local_microbatch's rule,
cp.get_batch_on_this_cp_rank, zig-zag). `check_run` judges it against independent references:

  [1/4] equivalence: losses, first-step gradients and final parameters (full, single-device
        names) against testing.single_device_run on the same global batches;
  [2/4] communication of one step, from the ledger, against `expected_ledger`: analysis's
        formulas of tensor (or sequence) parallelism and of the cp_comm_type, message by message
        (op, tag, bytes), and the bytes on the wire of SP against TP's all-reduces;
  [3/4] activation memory per rank: the bytes autograd saves for one micro-batch
        (analysis.measure_saved_activation_bytes) on a first-stage rank, against the same
        stage on one device (its ratio near tp x cp with SP), with and without SP, and the
        saving SP measures next to the one Korthikanti et al.'s per-layer count predicts;
  [4/4] load balance of this run's causal attention over its cp ranks: unmasked score
        entries per rank, zig-zag against contiguous (cp.causal_work_per_rank), max / mean;

and ends with a line starting MATCH (exit 0) or MISMATCH (exit 1).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minimegatron import comm, parallel_state
from minimegatron.analysis import step_communication
from minimegatron.analysis.communication import context_parallel_step_messages
from minimegatron.analysis.activations import korthikanti_activation_memory, measure_saved_activation_bytes
from booktools.demo import (Results, Run, add_training_flags, check_at_least_one, check_sequence_length, demo_parser,
                           run_demo, verdict_line)
from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.cp import (CP_COMM_TYPES, ContextParallelAttention, apply_context_parallel, causal_work_per_rank,
                             cp_chunk_ids, get_batch_on_this_cp_rank, positions_on_rank)
from minimegatron.model import GPTModel
from minimegatron.model.linear import RMSNorm
from minimegatron.parallelize import build_model, unwrap, validate_layout
from minimegatron.placement import set_placement
from minimegatron.pp import stage_layers
from minimegatron.testing import (EquivalenceReport, RunRecord, compare_runs, single_device_run, train_layout)
from minimegatron.tp import ColumnParallelLinear, allreduce_sequence_parallel_grads
from minimegatron.tp.layers import SEQUENCE_DIM

COMM_TAGS = ("fwd", "bwd", "regather", "sp-grads")   # what tensor, sequence and context parallelism send


def tiny_model(style: str = "llama", dtype: str = "float64", **overrides) -> ModelConfig:
    """h 32, 2 layers, 4 query heads (2 key/value groups for llama), vocabulary 64, positions 64."""
    sizes = dict(hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=64, vocab_size=64,
                 max_position_embeddings=64, params_dtype=dtype)
    if style == "llama":
        sizes["num_query_groups"] = 2
    return getattr(ModelConfig, style)(**{**sizes, **overrides})


@dataclass(frozen=True)
class SeqRun(Run):
    """One run (booktools.demo.Run) on tp x cp x pp x dp ranks; load_balance: the zig-zag cut
    (the training loop's, Megatron's), or False: contiguous."""
    load_balance: bool = True

    comm_type = property(lambda self: self.train.cp_comm_type)

    def name(self) -> str:
        parts = [f"tp={self.tp}" + ("+sp" if self.sp else "")] if self.tp > 1 else []
        parts += [f"cp={self.cp} ({self.comm_type}" + ("" if self.load_balance else ", contiguous") + ")"
                  ] if self.cp > 1 else []
        parts += [f"pp={self.pp}"] if self.pp > 1 else []
        return " x ".join(parts + [f"dp={self.dp}"])



def make_run(model: ModelConfig, tp: int = 1, cp: int = 1, pp: int = 1, dp: int = 1, *, sp: bool = False,
             cp_comm_type: str = "p2p", hierarchical: tuple[int, int] | None = None, micro_batches: int = 2,
             micro_batch_size: int = 2, steps: int = 2, seq: int = 32, zero_stage: int = 0,
             clip_grad: float = 0.05, load_balance: bool = True) -> SeqRun:
    """A validated SeqRun (parallelize.validate_layout: ConfigError naming the field and the
    numbers before any process starts). clip_grad 0.05 is below the tiny model's gradient norm,
    so every step clips and the norm over the layout is checked too. load_balance=False cuts
    the sequences contiguously instead of zig-zag (the training loop always uses zig-zag, as
    Megatron does): the ring's chunk-pair rule runs either layout."""
    train = TrainConfig(seq_length=seq, micro_batch_size=micro_batch_size, grad_accum_steps=micro_batches,
                        train_iters=steps, lr_warmup_iters=0, clip_grad=clip_grad, progress=False, eval_interval=0,
                        adam_eps=1e-5 if model.params_dtype == "float32" else 1e-8, zero_stage=zero_stage,
                        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                        sequence_parallel=sp, cp_comm_type=cp_comm_type,
                        hierarchical_context_parallel_sizes=hierarchical)
    validate_layout(model, train, tp * cp * pp * dp)
    return SeqRun(model, train, dp, load_balance=load_balance)


# ---------------------------------------------------------------------------------------
# on every rank
# ---------------------------------------------------------------------------------------
def train_run(run: SeqRun) -> dict:
    """Spawn (or torchrun) target on each of run.world ranks. Returns {"tp_rank", "cp_rank",
    "pp_rank", "dp_rank" (data replica), "losses" (per step, the global batch's mean),
    "grads" (first step) and "params" (final), full under single-device names, "ledger" (the
    first step's (op, tag, bytes) with tags COMM_TAGS), "saved_bytes" (one micro-batch's
    activations on this rank, first stage only: None elsewhere) and, with tp > 1,
    "saved_bytes_without_sp" (the same model built without sequence parallelism)}."""
    def contiguous(chunks, layout):           # the contiguous cut instead of build_model's zig-zag
        for chunk in chunks:
            apply_context_parallel(unwrap(chunk), layout.cp_group, t.cp_comm_type, load_balance=False,
                                   a2a_group=layout.cp_a2a_group, p2p_group=layout.cp_p2p_group)
    t = run.train
    # the batch is cut by this module's get_batch_on_this_cp_rank, looked up at each call (the
    # grader of exercise 4.2 swaps it for one built on the learner's zigzag_positions)
    out, chunks, layout, _ = train_layout(run.model, t, run.dp, run.global_batches(), COMM_TAGS,
                                          after_build=None if run.load_balance else contiguous,
                                          load_balance=run.load_balance,
                                          split_batch=lambda *args: get_batch_on_this_cp_rank(*args))
    microbatches = out.pop("microbatches")
    out["saved_bytes"] = out["saved_bytes_without_sp"] = None
    if layout.pp_rank == 0:                   # the first stage holds the embedding: feed it tokens
        mb = microbatches[0]
        out["saved_bytes"] = _saved_bytes(unwrap(chunks[0]), mb)
        if run.tp > 1:
            plain = build_model(run.model, TrainConfig(**{**t.__dict__, "sequence_parallel": False}), layout)
            out["saved_bytes_without_sp"] = _saved_bytes(unwrap(plain[0]), mb)
    return out


def _saved_bytes(model: GPTModel, mb: dict) -> int:
    labels = mb["labels"] if model.post_process else None
    return measure_saved_activation_bytes(model, mb["tokens"], labels, mb["position_ids"])


def train_runs(runs: list[SeqRun]) -> list[dict]:
    """train_run for each of `runs` in turn, in one world (each run's world must be its size)."""
    return [train_run(run) for run in runs]


# ---------------------------------------------------------------------------------------
# the formulas
# ---------------------------------------------------------------------------------------
def expected_ledger(run: SeqRun, pp_rank: int = 0) -> Counter:
    """The messages of one step on a rank of stage `pp_rank` with tags COMM_TAGS, as a Counter
    of (op, tag, bytes): analysis.step_communication's "tp" records (per micro-batch
    tensor_parallel_messages, under SP once per step the "sp-grads" all_reduce of every norm
    weight and row bias) and context_parallel_step_messages (per attention layer and
    micro-batch context_parallel_messages)."""
    records = (step_communication(run.model, run.train, run.world, pp_rank).get("tp", Counter())
               + context_parallel_step_messages(run.model, run.train, pp_rank))
    return Counter({key: n for key, n in records.items() if key[1] in COMM_TAGS})


def wire_bytes(calls: Counter, group_size: int, tags=("fwd", "bwd")) -> float:
    """Bytes each rank puts on the wire for the collectives of `calls` (tags `tags`) with the
    textbook ring algorithms (comm.ring_traffic): an all-reduce of n bytes sends 2 (N-1)/N n,
    a reduce-scatter of n bytes (N-1)/N n, an all-gather of a shard of n bytes (N-1) n."""
    group = tuple(range(group_size))
    return sum(count * comm.ring_traffic(comm.CommRecord(op, group, nbytes, None, ()))
               for (op, tag, nbytes), count in calls.items()
               if tag in tags and op in ("all_reduce", "reduce_scatter", "all_gather"))


def load_balance(cp_sizes=(2, 4, 8), seq: int = 4096) -> list[tuple[int, float, float]]:
    """(cp, contiguous max/mean, zig-zag max/mean) of the unmasked causal score entries per rank."""
    rows = []
    for cp in cp_sizes:
        ratios = []
        for balanced in (False, True):
            work = causal_work_per_rank(seq, cp, balanced)
            ratios.append(max(work) / (sum(work) / cp))
        rows.append((cp, *ratios))
    return rows


# ---------------------------------------------------------------------------------------
# the verdict
# ---------------------------------------------------------------------------------------
@dataclass
class RunReport:
    run: SeqRun
    equivalence: EquivalenceReport
    ledger: list[tuple[int, Counter, Counter]]      # per pp stage (rank 0 of its groups): measured, formula
    memory: dict
    wire: dict | None = None                        # SP only: bytes on the wire against TP's
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.equivalence.ok and not self.problems

    def ledger_totals(self) -> list[dict]:
        """Per pipeline stage: {"stage", "messages": the ledger's count, "bytes": {op: bytes handed in}}."""
        totals = []
        for stage, got, _ in self.ledger:
            ops = Counter()
            for (op, _, nbytes), n in got.items():
                ops[op] += n * nbytes
            totals.append({"stage": stage, "messages": sum(got.values()), "bytes": dict(sorted(ops.items()))})
        return totals

    def __str__(self) -> str:
        r, t = self.run, self.run.train
        lines = [f"=== {r.name()} ({r.world} ranks), {t.grad_accum_steps} micro-batches of {t.micro_batch_size} x "
                 f"{t.seq_length} tokens, {t.train_iters} steps, {r.model.params_dtype}",
                 "[1/4] equivalence with the single-device run on the same global batches:"]
        lines += ["      " + x for x in str(self.equivalence).splitlines()]
        lines.append("[2/4] communication of one step (tags fwd, bwd, sp-grads), ledger vs formula:")
        for (stage, got, want), total in zip(self.ledger, self.ledger_totals()):
            summary = ", ".join(f"{op} {nbytes:,} B" for op, nbytes in total["bytes"].items()) or "nothing"
            lines.append(f"      stage {stage}: {total['messages']} messages, {summary}: "
                         + ("OK, equal to the formula" if got == want else "DIFFERENT from the formula"))
        if self.wire:
            w = self.wire
            lines.append(f"      on the wire (ring algorithms, tags fwd/bwd): SP {w['sp']:,.0f} B, TP's all-reduces "
                         f"{w['tp']:,.0f} B" + (f" + the embedding's backward all-gather {w['embedding']:,} B "
                                                "(learned positions)" if w["embedding"] else "")
                         + (": the same" if w["same"] else ": DIFFERENT")
                         + f"; plus the backward's re-gathers of the saved shards: {w['regather']:,.0f} B")
        lines += memory_lines(r, self.memory)
        lines += balance_lines(r)
        lines += [f"      problem: {p}" for p in self.problems[:6]]
        return "\n".join(lines)


def memory_lines(run: SeqRun, m: dict) -> list[str]:
    """Line [3/4]: the measured bytes of a first-stage rank against the same stage on one
    device, and with tp > 1 the measured saving of SP next to the saving Korthikanti et al.'s
    per-layer count predicts for the same shapes (each saving from its own two numbers: the
    measurement counts this float64 model's whole stage, the paper one 16-bit layer with
    dropout; the paper has no context parallelism, so with cp > 1 it is left out)."""
    if m.get("parallel") is None:
        return []
    sizes = f"tp x cp = {run.tp * run.cp}" + (", with SP" if run.sp else "")
    lines = [f"[3/4] activations saved for one micro-batch (measured, {run.model.params_dtype}), {m['stage']}:",
             f"      this rank {m['parallel']:,} bytes; the same on one device {m['single']:,} bytes: "
             f"ratio {m['single'] / m['parallel']:.2f} ({sizes})"]
    if m.get("without_sp") is not None:
        lines.append(f"      this rank without sequence parallelism {m['without_sp']:,} bytes (ratio "
                     f"{m['single'] / m['without_sp']:.2f}): SP saves {1 - m['parallel'] / m['without_sp']:.0%} of them")
    if m.get("korthikanti_one") is not None:
        one, tp, sp = m["korthikanti_one"], m["korthikanti_tp"], m["korthikanti_sp"]
        lines += [f"      Korthikanti et al.'s count for one 16-bit layer with dropout (these shapes): one device "
                  f"{one:,} bytes,",
                  f"        TP {tp:,} (ratio {one / tp:.2f}), TP + SP {sp:,} (ratio {one / sp:.2f}): SP saves "
                  f"{1 - sp / tp:.0%} of them"]
    return lines


def balance_lines(run: SeqRun) -> list[str]:
    """Line [4/4]: the unmasked causal score entries of one sequence on each of this run's cp
    ranks (cp.causal_work_per_rank, for the run's s and cp), zig-zag and contiguous, marking
    the cut this run used; with cp = 1 there is nothing to balance."""
    s, cp = run.train.seq_length, run.cp
    if cp == 1:
        return [f"[4/4] causal attention work per cp rank: cp = 1, one rank attends over all {s} tokens (nothing to "
                f"balance; --cp 2 or more shows the two cuts)"]
    lines = [f"[4/4] causal attention work per cp rank (unmasked scores of one sequence), s = {s}, cp = {cp}:"]
    for name, balanced in (("zig-zag", True), ("contiguous", False)):
        work = causal_work_per_rank(s, cp, balanced)
        mark = " (this run)" if balanced == run.load_balance else ""
        lines.append(f"      {name + mark:<22} {', '.join(f'{w:,}' for w in work)}: max/mean "
                     f"{max(work) / (sum(work) / cp):.3f}")
    return lines


def check_run(run: SeqRun, per_rank: list[dict]) -> RunReport:
    """Judge a run: equivalence (rank 0's view), each pipeline stage's ledger on the rank with
    tp, cp and dp rank 0 (and, for the ring, every cp rank), the activation bytes."""
    t = run.train
    reference = single_device_run(run.model, run.global_batches(), t.__class__(**{
        **t.__dict__, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
        "sequence_parallel": False, "zero_stage": 0, "hierarchical_context_parallel_sizes": None}),
        grad_accum_steps=t.grad_accum_steps)
    mine = per_rank[0]
    equivalence = compare_runs(reference, RunRecord(mine["losses"], mine["grads"], mine["params"]), run.model.dtype)
    problems, ledger = [], []
    for stage in range(run.pp):
        want = expected_ledger(run, stage)
        ranks = [r for r in per_rank if r["pp_rank"] == stage and r["tp_rank"] == 0 and r["dp_rank"] == 0]
        for r in ranks:
            got = Counter(r["ledger"])
            if got != want:
                extra, missing = got - want, want - got
                problems.append(f"stage {stage} cp rank {r['cp_rank']}: ledger differs from the formula: "
                                f"unexpected {dict(extra)}, missing {dict(missing)}")
        ledger.append((stage, Counter(ranks[0]["ledger"]), want))
    for r in per_rank[1:]:
        if r["losses"] != per_rank[0]["losses"]:
            problems.append(f"rank {per_rank.index(r)} reports other losses than rank 0")
            break
    memory = {"parallel": mine["saved_bytes"], "without_sp": mine["saved_bytes_without_sp"]}
    if mine["saved_bytes"] is not None:
        memory.update(single_stage_memory(run))
    if mine["saved_bytes_without_sp"] is not None and run.cp == 1:
        memory.update({f"korthikanti_{kind}": korthikanti_activation_memory(
            run.model, t.micro_batch_size, t.seq_length, tp=tp, sequence_parallel=sp)["per_layer"]
            for kind, tp, sp in (("one", 1, False), ("tp", run.tp, False), ("sp", run.tp, True))})
    wire = sp_against_tp(run) if run.sp else None
    if wire and not wire["same"]:
        problems.append(f"SP's bytes on the wire differ from TP's all-reduces: {wire}")
    return RunReport(run, equivalence, ledger, memory, wire, problems)


def single_stage_memory(run: SeqRun) -> dict:
    """{"single": the bytes autograd saves for one micro-batch of the first pipeline stage's
    model on one device (its layers, the embedding, and with pp = 1 the output layer and the
    loss: what a first-stage rank holds a 1 / (tp cp) part of), "stage": those parts in words}."""
    t, cfg = run.train, run.model
    layers = stage_layers(cfg.num_layers, run.pp, 0)
    last = run.pp == 1
    stage = GPTModel(cfg, pre_process=True, post_process=last, layer_numbers=layers)
    batch = run.global_batches()[-1]
    tokens, labels = batch["tokens"][:t.micro_batch_size], batch["labels"][:t.micro_batch_size]
    if last:
        parts = (f"the whole model: {len(layers)} layer{'s' * (len(layers) > 1)}, the embedding, the output layer "
                 f"and the loss")
    else:
        parts = (f"the first of {run.pp} stages: layers {layers[0]}-{layers[-1]} of {cfg.num_layers} and the embedding"
                 if len(layers) > 1 else f"the first of {run.pp} stages: layer 0 of {cfg.num_layers} and the embedding")
    return {"single": measure_saved_activation_bytes(stage, tokens, labels if last else None), "stage": parts}


def sp_against_tp(run: SeqRun) -> dict:
    """Bytes on the wire per rank (ring algorithms, tags fwd and bwd) of the SP run's formula
    and of the same run without SP. They are equal (an all-reduce is a reduce-scatter plus an
    all-gather) except, with learned positions, for the embedding's backward all-gather:
    Megatron all-reduces the embedding, adds the positions, then keeps this rank's tokens.
    "regather": what the backward's second all-gathers of the saved shards add."""
    t = run.train
    without = SeqRun(run.model, TrainConfig(**{**t.__dict__, "sequence_parallel": False}), run.dp)
    sp, tp = wire_bytes(expected_ledger(run), run.tp), wire_bytes(expected_ledger(without), run.tp)
    x = t.micro_batch_size * (t.seq_length // run.cp) * run.model.hidden_size * \
        torch.empty((), dtype=run.model.dtype).element_size()
    learned = run.model.position_embedding_type == "learned_absolute"
    embedding = t.grad_accum_steps * (run.tp - 1) * x // run.tp if learned else 0
    return {"sp": sp, "tp": tp, "embedding": embedding, "same": abs(sp - tp - embedding) < 1e-6,
            "regather": wire_bytes(expected_ledger(run), run.tp, tags=("regather",))}


def summary_line(reports: list[RunReport]) -> str:
    """The demo's last line: MATCH ... or MISMATCH ..."""
    return verdict_line(reports, lambda r: r.run.name(), "every message of the ledger equals the formulas")


# ---------------------------------------------------------------------------------------
# layer-level experiments (the notebook spawns them): one SP linear, one CP attention
# ---------------------------------------------------------------------------------------
def _ledger_rows(ledger) -> list[tuple[str, str, int]]:
    return [(r.op, r.tag, r.nbytes) for r in ledger]


def sp_norm_and_column_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor, dy: torch.Tensor) -> dict:
    """The start of a sequence-parallel block on tp = world ranks: RMSNorm on this rank's
    tokens, then a ColumnParallelLinear(sequence_parallel=True).

    x [b, s, in] (full; rank r takes tokens [r s/tp, (r+1) s/tp)), norm_weight [in],
    weight [out, in] and bias [out] (full; the layer keeps rows r), dy [b, s, out] (the full
    output gradient; rank r's slice is its columns). Returns {"y" [b, s, out/tp], "dx"
    [b, s/tp, in], "dweight" [out/tp, in], "dbias" [out/tp], "dnorm_local" (the norm weight's
    gradient from this rank's tokens), "dnorm" (after allreduce_sequence_parallel_grads),
    "ledger" [(op, tag, bytes)] of the forward and backward, "ledger_grads" of the
    all-reduce}."""
    group, tp, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    s_r = x.shape[SEQUENCE_DIM] // tp
    norm = RMSNorm(x.shape[-1], eps=1e-5).to(x.dtype)
    with torch.no_grad():
        norm.weight.copy_(norm_weight)
    set_placement(norm.weight, sequence_parallel=True)     # what apply_tensor_parallel marks
    linear = ColumnParallelLinear(x.shape[-1], weight.shape[0], group, sequence_parallel=True,
                                  params_dtype=x.dtype)
    linear.load_full(weight, bias)
    x_r = x[:, r * s_r:(r + 1) * s_r].clone().requires_grad_()               # [b, s/tp, in]
    out_tp = weight.shape[0] // tp
    with comm.record_communication() as ledger:
        y = linear(norm(x_r))                                                # [b, s, out/tp]
        y.backward(dy[..., r * out_tp:(r + 1) * out_tp])
    local = norm.weight.grad.clone()
    with comm.record_communication() as grads_ledger:
        allreduce_sequence_parallel_grads([norm], group)
    return {"y": y.detach(), "dx": x_r.grad, "dweight": linear.weight.grad, "dbias": linear.bias.grad,
            "dnorm_local": local, "dnorm": norm.weight.grad, "ledger": _ledger_rows(ledger),
            "ledger_grads": _ledger_rows(grads_ledger)}


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                 comm_types: list[str], backend: str = "sdpa", load_balance: bool = True) -> dict:
    """Causal attention with every cp_comm_type of `comm_types` on cp = world ranks.

    q [b, a, s, d], k and v [b, g, s, d], dout [b, a, s, d]: full tensors; rank r takes the
    positions of its chunks (zig-zag when `load_balance`, cp/layout.positions_on_rank) along
    dim 2. "a2a+p2p" uses all-to-all groups of 2 (hierarchical sizes [2, world/2]). Returns
    {"positions": this rank's positions, comm_type: {"out", "dq", "dk", "dv" (this rank's
    rows, [b, heads, s/cp, d]), "ledger" [(op, tag, bytes)] of the forward and backward}}."""
    cp, r = dist.get_world_size(), dist.get_rank()
    positions = torch.tensor(positions_on_rank(q.shape[2], cp, r, load_balance))
    ids = [cp_chunk_ids(cp, j, load_balance) for j in range(cp)]
    result = {"positions": positions}
    for comm_type in comm_types:
        sizes = (2, cp // 2) if comm_type == "a2a+p2p" else None
        parallel_state.initialize_model_parallel(context_parallel_size=cp, hierarchical_context_parallel_sizes=sizes)
        try:
            groups = ((parallel_state.get_group("hcp-a2a"), parallel_state.get_group("hcp-p2p"))
                      if sizes else (None, None))
            attention = ContextParallelAttention(parallel_state.get_context_parallel_group(), comm_type, ids,
                                                 backend, *groups)
            q_r, k_r, v_r = (t.index_select(2, positions).requires_grad_() for t in (q, k, v))
            with comm.record_communication() as ledger:
                out = attention(q_r, k_r, v_r)                                   # [b, a, s/cp, d]
                out.backward(dout.index_select(2, positions))
            result[comm_type] = {"out": out.detach(), "dq": q_r.grad, "dk": k_r.grad, "dv": v_r.grad,
                                 "ledger": _ledger_rows(ledger)}
        finally:
            parallel_state.destroy_model_parallel()
    return result


# ---------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = demo_parser("04", "Chapter 04: train a tiny model with sequence and/or context parallelism (x pipeline x "
                               "data parallel) and check it against the single-device run, the communication "
                               "formulas and the activation memory.")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    parser.add_argument("--cp", type=int, default=None, help="context-parallel size (default 2 without torchrun "
                                                              "and without --tp; else 1)")
    parser.add_argument("--cp-comm-type", choices=CP_COMM_TYPES, default="p2p", help="default p2p (ring attention)")
    parser.add_argument("--hierarchical-context-parallel-sizes", type=int, nargs=2, default=None, metavar=("A2A", "P2P"),
                        help="a2a+p2p: all-to-all size and ring size (default 2 and cp / 2)")
    parser.add_argument("--contiguous", action="store_true",
                        help="cut the sequences contiguously instead of zig-zag (the comparison; attention is "
                             "then unbalanced over the cp ranks, the results the same)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    parser.add_argument("--dp", type=int, default=None,
                        help="data-parallel replicas (default: world / (tp cp pp) under torchrun, 1 without)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 64, or 32 with --quick)")
    add_training_flags(parser, micro_batch_size=False)
    args = parser.parse_args(argv)
    if args.cp is None:           # cp 1 under torchrun or with tp; without them the demo shows cp 2
        args.cp = 1 if "RANK" in os.environ or args.tp > 1 else 2
    return check_at_least_one(parser, args, "tp", "pp", "micro_batches", "cp", "dp", "seq", "steps")


def build_run(args: argparse.Namespace, dp: int) -> SeqRun:
    """The run every rank trains; ConfigError naming the numbers if it cannot: in this demo's
    flags for the sequence length and the cp_comm_type (with a setting that works), in the
    configuration's fields for the rest (parallelize.validate_layout)."""
    model = tiny_model(args.style, args.dtype, num_layers=2 * args.pp)
    seq = args.seq if args.seq is not None else (32 if args.quick else 64)
    check_sequence_length(seq, cp=args.cp, tp=args.tp, sp=args.sp, max_positions=model.max_position_embeddings,
                          given=args.seq is not None)
    hierarchical = check_cp_comm_flags(args, model)
    return make_run(model, tp=args.tp, cp=args.cp, pp=args.pp, dp=dp, sp=args.sp, cp_comm_type=args.cp_comm_type,
                    hierarchical=hierarchical, micro_batches=args.micro_batches,
                    steps=args.steps if args.steps is not None else (2 if args.quick else 3), seq=seq,
                    load_balance=not args.contiguous)


def check_cp_comm_flags(args: argparse.Namespace, model: ModelConfig) -> tuple[int, int] | None:
    """The hierarchical sizes [A, P] of the run (None unless --hierarchical-context-parallel-sizes
    was given), after a ConfigError in this demo's flags, naming a setting that works, for:

      a2a      --cp not dividing the query heads or key/value groups of a tensor-parallel rank
               (each rank runs whole heads after the all-to-all);
      a2a+p2p  sizes whose product is not --cp, an all-to-all size A that does not divide them,
               or a level of one rank: [A, 1] is plain a2a and [1, P] plain p2p, which the run
               would do without saying so. (Megatron requires the sizes with a2a+p2p,
               megatron/training/arguments.py; this demo defaults them to [2, cp / 2], which at
               --cp 2 is [2, 1].)"""
    cp, kind, given = args.cp, args.cp_comm_type, args.hierarchical_context_parallel_sizes
    if cp == 1 or kind not in ("a2a", "a2a+p2p"):
        return tuple(given) if given else None             # validate_layout refuses sizes without a2a+p2p
    heads, groups = model.num_attention_heads // args.tp, model.query_groups // args.tp
    per_rank = f"the {heads} query heads and {groups} key/value groups of a tensor-parallel rank"
    both = next(((a, cp // a) for a in range(cp - 1, 1, -1) if cp % a == 0 and heads % a == 0 and groups % a == 0),
                None)                                       # the largest all-to-all size with a ring of 2 or more
    hierarchy = (f"--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes {both[0]} {both[1]}"
                 if both else None)
    ring_kinds = "--cp-comm-type p2p or all_gather"
    if kind == "a2a":
        if heads % cp or groups % cp:
            raise ConfigError(f"--cp-comm-type a2a with --cp {cp}: each rank runs whole heads after the all-to-all, so "
                              f"--cp must divide {per_rank}; use " + (f"{hierarchy}, or " if hierarchy else "")
                              + ring_kinds)
        return None
    a2a, ring = given if given else (2, cp // 2)
    sizes = (f"--hierarchical-context-parallel-sizes {a2a} {ring}"
             + ("" if given else f" (this demo's default for --cp {cp}: 2 and cp / 2)"))
    if a2a * ring != cp:
        raise ConfigError(f"--cp-comm-type a2a+p2p with {sizes}: their product must be --cp {cp}; use "
                          + (hierarchy if hierarchy else ring_kinds))
    if heads % a2a or groups % a2a:
        raise ConfigError(f"--cp-comm-type a2a+p2p with {sizes}: the all-to-all size {a2a} must divide {per_rank}; "
                          f"use " + (hierarchy if hierarchy else ring_kinds))
    if a2a == 1 or ring == 1:
        plain = "a2a" if ring == 1 else "p2p"
        level = "a ring" if ring == 1 else "all-to-all groups"
        raise ConfigError(f"--cp-comm-type a2a+p2p with {sizes}: {level} of one rank would run plain {plain} under "
                          f"the name a2a+p2p; use --cp-comm-type {plain}"
                          + (f", or {hierarchy} for both levels" if hierarchy else
                             ", or a --cp with two levels above 1 (e.g. --cp 4 --hierarchical-context-parallel-sizes "
                             "2 2)"))
    return (a2a, ring) if given else None


@dataclass
class SeqResults(Results):
    """What report printed: the largest differences from the single-device run, each stage's
    ledger totals (RunReport.ledger_totals), the activation bytes ([3/4]: "parallel", "single",
    "without_sp", "korthikanti_one/tp/sp" as RunReport.memory) and SP's bytes on the wire
    (sp_against_tp, None without SP)."""
    dloss: float = 0.0
    dgrad: float = 0.0
    dparam: float = 0.0
    ledger: list[dict] = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    wire: dict | None = None


def report(args, run: SeqRun, per_rank: list[dict]) -> SeqResults:
    result = check_run(run, per_rank)
    print(result)
    e = result.equivalence
    return SeqResults(verdict=summary_line([result]), dloss=e.max_loss_diff, dgrad=e.max_grad_diff,
                      dparam=e.max_param_diff, ledger=result.ledger_totals(), memory=result.memory, wire=result.wire)


def main(argv=None) -> SeqResults:
    return run_demo(parse_args(argv), "04", build_run, train_run, report,
                    model_parallel=lambda args: {"tp": args.tp, "cp": args.cp, "pp": args.pp})


if __name__ == "__main__":      # the guard matters: spawned ranks import this file again
    sys.exit(main().exit_code)
