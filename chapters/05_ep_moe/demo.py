"""Chapter 05 demo: a GPT-MoE with expert parallelism, proven on tp x cp x pp x dp ranks (5D).

    python chapters/05_ep_moe/demo.py                 # no torchrun: spawns 2 ranks itself (ep 2)
    python chapters/05_ep_moe/demo.py --quick --ep 4 --dispatcher allgather
    torchrun --standalone --nproc_per_node=4 chapters/05_ep_moe/demo.py --ep 2          # ep 2 x expert-dp 2
    torchrun --standalone --nproc_per_node=4 chapters/05_ep_moe/demo.py --tp 2 --sp --ep 2 --etp 1
    torchrun --standalone --nproc_per_node=16 chapters/05_ep_moe/demo.py --tp 2 --sp --cp 2 --ep 2 --pp 2 --dp 2  # 5D

This file is the chapter's experiment and its command line; the tests, the graders, the
notebook and make_figures.py run it from Python:

    from minimegatron.launch import spawn
    from booktools.demo import import_chapter
    ch05 = import_chapter("05")              # this file, as chapters.05_ep_moe.demo
    run = ch05.make_run(ch05.tiny_moe(), ep=2, dp=2)
    per_rank = spawn(ch05.train_run, run.world, run)
    print(ch05.check_run(run, per_rank))

A `MoERun` trains one GPT-MoE on tp x cp x pp x dp ranks, whose experts live on a second grid
over the same ranks (etp x ep x expert-dp x pp, cp folded away: parallel_state). Every rank
builds its model as the training loop does (parallelize.build_model: pipeline chunk -> tensor
(+ sequence) parallel -> context parallel -> expert parallel -> DDP, experts in buckets of
their own over the expert-dp group) and runs train.train_step on its micro-batches
(testing.train_layout). `check_run` judges it against independent references:

  [1/4] equivalence: losses (with the auxiliary losses in the backward), first-step gradients
        (the router's included) and final parameters against testing.single_device_run, whose
        micro-batches are the ranks' own (each data replica's micro-batch is one token set of
        the load-balancing loss, as in Megatron: the counts are summed over tp x cp only);
  [2/4] communication of one step, from the ledger: the dispatcher's messages against
        analysis's formulas (all-to-all: this rank's routed rows T k h bytes, the combine's rows summed over
        the ep group equal to the dispatched ones; all-gather: every message from T, h, E), and
        the two dispatchers' volumes for every ep the experts allow (the divisors of E);
  [3/4] accounting: total and active parameters, FLOPs per token (training_flops against
        Megatron's formula), and the experts' parameters and Adam state on each rank against
        the formula total / (ep etp) per stage;
  [4/4] load balance (one device, a short run on chapters 00-02's text): tokens per expert with
        no balancing, with the auxiliary loss and with the expert bias, and the fraction of
        routed pairs dropped at capacity factors 0.5 .. 2;

and ends with a line starting MATCH (exit 0) or MISMATCH (exit 1).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch

from minimegatron.analysis import count_parameters, megatron_mlp_flops, training_flops
from minimegatron.analysis.communication import dispatcher_step_messages
from booktools.demo import (Results, Run, check_at_least, check_at_least_one, check_sequence_length, demo_parser,
                           run_demo, verdict_line)
from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.data.corpus import FROZEN
from minimegatron.model import GPTModel, MoELayer
from minimegatron.model.router import apply_token_dropping
from minimegatron.optim import Optimizer, learning_rate
from minimegatron.parallel_state import Layout
from minimegatron.parallelize import unwrap, validate_layout
from minimegatron.pp import stage_layers
from minimegatron.testing import (EquivalenceReport, RunRecord, compare_runs, single_device_run, train_layout)
from minimegatron.train import train_step

MOE_TAGS = ("moe-counts", "moe-dispatch", "moe-combine", "moe-dispatch-bwd", "moe-combine-bwd", "moe-etp",
            "moe-etp-bwd", "moe-allgather", "moe-allgather-bwd", "moe-aux", "moe-bias", "expert-grads", "grads")
# the dispatchers' messages whose sizes do not depend on the routing (expected_dispatch)
ROUTING_INDEPENDENT = ("moe-counts", "moe-dispatch", "moe-combine-bwd", "moe-allgather", "moe-allgather-bwd")


def tiny_moe(dtype: str = "float64", **overrides) -> ModelConfig:
    """LLaMA style, h 32, 2 layers (both MoE), 4 heads (2 key/value groups), vocabulary 64; 4
    experts of width 32, top-2, with the load-balancing loss and the z-loss on."""
    sizes = dict(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                 vocab_size=64, max_position_embeddings=64, params_dtype=dtype, num_experts=4, moe_router_topk=2,
                 moe_ffn_hidden_size=32, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
    return ModelConfig.llama(**{**sizes, **overrides})


@dataclass(frozen=True)
class MoERun(Run):
    """One run (booktools.demo.Run) on tp x cp x pp x dp ranks, its experts on the second grid
    etp x ep x expert-dp x pp."""
    ep = property(lambda self: self.train.expert_model_parallel_size)
    etp = property(lambda self: self.train.etp)
    dispatcher = property(lambda self: self.train.moe_token_dispatcher_type)
    expert_dp = property(lambda self: self.world // (self.etp * self.ep * self.pp))

    def name(self) -> str:
        parts = [f"tp={self.tp}" + ("+sp" if self.sp else "")] if self.tp > 1 else []
        parts += [f"cp={self.cp}"] if self.cp > 1 else []
        parts += [f"ep={self.ep} ({self.dispatcher})"] + ([f"etp={self.etp}"] if self.etp > 1 or self.etp != self.tp
                                                           else [])
        parts += [f"pp={self.pp}"] if self.pp > 1 else []
        zero = [f"ZeRO-{self.train.zero_stage}"] if self.train.zero_stage else []
        return " x ".join(parts + [f"dp={self.dp}", f"expert-dp={self.expert_dp}"] + zero)



def make_run(model: ModelConfig, tp: int = 1, cp: int = 1, pp: int = 1, dp: int = 1, *, ep: int = 2,
             etp: int | None = None, sp: bool = False, dispatcher: str = "alltoall", micro_batches: int = 2,
             micro_batch_size: int = 2, steps: int = 2, seq: int = 32, clip_grad: float = 0.05,
             zero_stage: int = 0) -> MoERun:
    """A validated MoERun (parallelize.validate_layout: ConfigError naming the field and the
    numbers before any process starts). clip_grad 0.05 is below the tiny model's gradient norm,
    so every step clips and the norm over the experts' groups is checked too."""
    train = TrainConfig(seq_length=seq, micro_batch_size=micro_batch_size, grad_accum_steps=micro_batches,
                        train_iters=steps, lr_warmup_iters=0, clip_grad=clip_grad, progress=False, eval_interval=0,
                        adam_eps=1e-5 if model.params_dtype == "float32" else 1e-8,
                        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                        sequence_parallel=sp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                        moe_token_dispatcher_type=dispatcher, zero_stage=zero_stage)
    validate_layout(model, train, tp * cp * pp * dp)
    return MoERun(model, train, dp)


# ---------------------------------------------------------------------------------------
# on every rank
# ---------------------------------------------------------------------------------------
def train_run(run: MoERun) -> dict:
    """Spawn (or torchrun) target on each of run.world ranks: testing.train_layout's record
    (losses, first-step gradients, final parameters under single-device names; the first step's
    ledger with MOE_TAGS) plus "experts" (this rank's expert parameters: elements), "expert_adam"
    (elements of AdamW's two moments of them after the last step: the optimizer's own state) and
    "dense" (its other parameters: elements)."""
    out, chunks, _, optimizer = train_layout(run.model, run.train, run.dp, run.global_batches(), MOE_TAGS)
    out.pop("microbatches")
    experts = {id(p): p for c in chunks for p in routed_expert_parameters(unwrap(c))}
    dense = [p for c in chunks for p in unwrap(c).parameters() if id(p) not in experts]
    out["experts"] = sum(p.numel() for p in experts.values())
    out["expert_adam"] = (None if run.train.zero_stage else      # ZeRO: the state of this rank's shards
                          sum(optimizer.state[p][m].numel() for p in experts.values() for m in ("exp_avg", "exp_avg_sq")))
    out["dense"] = sum(p.numel() for p in dense)
    return out


def routed_expert_parameters(model: GPTModel) -> list[torch.Tensor]:
    """The parameters of the routed experts this model (one rank's chunk) holds: every MoE
    layer's `experts`, found by where they sit, not by their placement record. (The record's
    allreduce=False, moe.is_expert_parameter, is written by apply_expert_parallel, which does
    nothing in a world of one rank: at --ep 1 on one rank nothing is marked, and the experts are
    still there.)"""
    return [p for layer in model.modules() if isinstance(layer, MoELayer) for p in layer.experts.parameters()]


def train_runs(runs: list[MoERun]) -> list[dict]:
    """train_run for each of `runs` in turn, in one world (each run's world must be its size)."""
    return [train_run(run) for run in runs]


# ---------------------------------------------------------------------------------------
# the formulas
# ---------------------------------------------------------------------------------------
def tokens_per_rank(run: MoERun) -> int:
    """T: the tokens one rank routes per micro-batch, b s / cp (/ tp under sequence parallelism)."""
    t = run.train
    return t.micro_batch_size * t.seq_length // run.cp // (run.tp if run.sp else 1)


def expected_dispatch(run: MoERun, pp_rank: int = 0) -> Counter:
    """The dispatcher's messages of one step on a rank of stage `pp_rank` that do not depend on
    the routing, as a Counter of (op, tag, bytes): analysis.dispatcher_step_messages (per MoE
    layer and micro-batch, T = tokens_per_rank: alltoall's counts over ep and etp, its T k h e
    dispatch and combine-bwd; allgather's seven messages). The combine and the dispatch's
    backward move the rows this rank's experts received: check_run checks their sums."""
    return dispatcher_step_messages(run.model, run.train, pp_rank)


def dispatcher_volumes(tokens: int, hidden: int, experts: int, topk: int, ep: int, element_size: int = 2) -> dict:
    """Bytes one rank RECEIVES from other ranks per MoE layer and micro-batch, forward, with
    uniform routing and etp 1: all-to-all, the rows of its experts from the other ep - 1 ranks,
    T k h e (1 - 1/ep) for the dispatch and as much for the combine; all-gather, every other
    rank's tokens, (ep - 1) T h e (plus their weights and routing maps, (ep - 1) T E (e + 1)),
    and as much again in the reduce-scatter."""
    T, h, E, k, e = tokens, hidden, experts, topk, element_size
    alltoall = 2 * T * k * h * e * (ep - 1) / ep
    allgather = 2 * (ep - 1) * T * h * e + (ep - 1) * T * E * (e + 1)
    return {"alltoall": alltoall, "allgather": allgather}


def expert_parallel_sizes(num_experts: int) -> list[int]:
    """The expert-parallel sizes a model of `num_experts` experts can have, above 1: the
    divisors of E (each ep rank holds E / ep whole experts)."""
    return [ep for ep in range(2, num_experts + 1) if num_experts % ep == 0]


def expert_elements_per_rank(run: MoERun, pp_rank: int = 0) -> int:
    """The experts' parameter elements one rank holds: per MoE layer of its stage, E / ep experts,
    each cut over etp (count_parameters' one-expert size / etp)."""
    cfg = run.model
    layers = [i for i in stage_layers(cfg.num_layers, run.pp, pp_rank) if cfg.is_moe_layer(i)]
    return len(layers) * (cfg.num_experts // run.ep) * count_parameters(cfg)["moe"]["expert"] // run.etp


# ---------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------
@dataclass
class RunReport:
    run: MoERun
    equivalence: EquivalenceReport
    ledger: list[tuple[int, Counter, Counter, int, int]]   # per stage: measured, formula, dispatched, combined
    memory: list[tuple[int, int, int, int]]                # per stage: experts, formula, their Adam state, dense
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.equivalence.ok and not self.problems

    def dispatch_totals(self) -> list[dict]:
        """Per stage: {"stage", "messages" and "bytes" (the routing-independent formula's), "dispatched",
        "combined" (the moe-dispatch and moe-combine bytes summed over the stage's ranks)}."""
        return [{"stage": stage, "messages": sum(want.values()), "bytes": sum(n * key[2] for key, n in want.items()),
                 "dispatched": dispatched, "combined": combined}
                for stage, _, want, dispatched, combined in self.ledger]

    def accounting(self) -> dict:
        """[3/4]'s formulas: parameters ("total", "active") and training FLOPs per token ("flops",
        of which "mlp", Megatron's MLP formula "megatron_mlp", and "router")."""
        cfg, s = self.run.model, self.run.train.seq_length
        counts, flops = count_parameters(cfg), training_flops(cfg, 1, s)
        mlp = 3 * sum(flops["forward"].get(k, 0) for k in ("fc1", "fc2", "experts_fc1", "experts_fc2",
                                                           "shared_fc1", "shared_fc2"))
        return {"total": counts["total"], "active": counts["active"], "flops": flops["total"] / s, "mlp": mlp / s,
                "megatron_mlp": megatron_mlp_flops(cfg, s) / s, "router": 3 * flops["forward"]["router"] / s}

    def __str__(self) -> str:
        r, t, cfg = self.run, self.run.train, self.run.model
        lines = [f"=== {r.name()} ({r.world} ranks), {t.grad_accum_steps} micro-batches of {t.micro_batch_size} x "
                 f"{t.seq_length} tokens, {t.train_iters} steps, {cfg.params_dtype}, {cfg.num_experts} experts, "
                 f"top-{cfg.moe_router_topk}",
                 "[1/4] equivalence with the single-device run (each data replica's micro-batch one micro-batch there):"]
        lines += ["      " + x for x in str(self.equivalence).splitlines()]
        lines.append(f"[2/4] the {r.dispatcher} dispatcher's messages of one step, ledger vs formula:")
        capacity = cfg.moe_expert_capacity_factor is not None
        for (stage, got, want, dispatched, combined), total in zip(self.ledger, self.dispatch_totals()):
            mine = Counter({key: n for key, n in got.items() if key[1] in ROUTING_INDEPENDENT})
            lines.append(f"      stage {stage}: {total['messages']} routing-independent messages, {total['bytes']:,} B: "
                         + ("not compared (capacity: the dropped pairs make the dispatched rows depend on the "
                            "routing)" if capacity else
                            "OK, equal to the formula" if mine == want else "DIFFERENT from the formula"))
            if r.dispatcher == "alltoall" and r.ep > 1:
                lines.append(f"      summed over the stage's ranks: dispatched {dispatched:,} B, combined {combined:,} B "
                             + ("(equal: every row comes back)" if dispatched == combined else "(DIFFERENT)"))
        T, h = tokens_per_rank(r), cfg.hidden_size
        sizes = expert_parallel_sizes(cfg.num_experts)
        lines.append(f"      bytes received per rank, MoE layer and micro-batch (formula, T={T}, h={h}, uniform routing; "
                     + (f"every ep that divides the {cfg.num_experts} experts):" if sizes else
                        f"none: {cfg.num_experts} expert cannot be spread)"))
        for ep in sizes:
            v = dispatcher_volumes(T, h, cfg.num_experts, cfg.moe_router_topk, ep,
                                   torch.empty((), dtype=cfg.dtype).element_size())
            lines.append(f"        ep={ep:2d}: all-to-all {v['alltoall']:>10,.0f} B, all-gather {v['allgather']:>10,.0f} B"
                         + ("   (this run)" if ep == r.ep else ""))
        a = self.accounting()
        lines.append(f"[3/4] parameters: total {a['total']:,}, active per token {a['active']:,} "
                     f"({a['active'] / a['total']:.0%}); training FLOPs per token {a['flops']:,.0f}, of which MLP "
                     f"{a['mlp']:,.0f} (Megatron's formula {a['megatron_mlp']:,.0f}) and router {a['router']:,.0f} "
                     f"(not in Megatron's)")
        for stage, measured, formula, adam, dense in self.memory:
            lines.append(f"      stage {stage}, per rank: experts {measured:,} elements (formula E/ep x expert / etp "
                         f"per MoE layer: {formula:,}) " + ("OK" if measured == formula else "DIFFERENT")
                         + (f"; AdamW's two moments of them {adam:,} (formula 2 x {formula:,}) "
                            + ("OK" if adam == 2 * formula else "DIFFERENT") if adam is not None else
                            "; AdamW's moments sharded over the expert-dp group (ZeRO-1)")
                         + f"; dense parameters {dense:,}")
        lines += [f"      problem: {p}" for p in self.problems[:6]]
        return "\n".join(lines)


def reference_config(run: MoERun) -> TrainConfig:
    """The single-device TrainConfig of a run: every size 1."""
    return TrainConfig(**{**run.train.__dict__, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                          "context_parallel_size": 1, "sequence_parallel": False, "expert_model_parallel_size": 1,
                          "expert_tensor_parallel_size": None})


def check_run(run: MoERun, per_rank: list[dict]) -> RunReport:
    """Judge a run: equivalence (rank 0's view) against the single device with one micro-batch
    per data replica's micro-batch; each pipeline stage's dispatcher messages on its ranks; the
    experts' elements per rank."""
    t = run.train
    reference = single_device_run(run.model, run.global_batches(), reference_config(run),
                                  grad_accum_steps=t.grad_accum_steps * run.dp)
    mine = per_rank[0]
    equivalence = compare_runs(reference, RunRecord(mine["losses"], mine["grads"], mine["params"]), run.model.dtype)
    problems, ledger, memory = [], [], []
    for stage in range(run.pp):
        want = expected_dispatch(run, stage)
        ranks = [r for r in per_rank if r["pp_rank"] == stage]
        for r in ranks:
            got = Counter({key: n for key, n in Counter(r["ledger"]).items() if key[1] in ROUTING_INDEPENDENT})
            if got != want and run.model.moe_expert_capacity_factor is None:
                problems.append(f"stage {stage}, rank {per_rank.index(r)}: messages differ from the formula: "
                                f"unexpected {dict(got - want)}, missing {dict(want - got)}")
        dispatched = sum(b for r in ranks for op, tag, b in r["ledger"] if tag == "moe-dispatch")
        combined = sum(b for r in ranks for op, tag, b in r["ledger"] if tag == "moe-combine")
        for group in {(r["etp_rank"], r["expert_dp_rank"]) for r in ranks}:     # each ep group of the stage
            members = [r for r in ranks if (r["etp_rank"], r["expert_dp_rank"]) == group]
            sent, back = (sum(b for r in members for _, tag, b in r["ledger"] if tag == name)
                          for name in ("moe-dispatch", "moe-combine"))
            if sent != back:
                problems.append(f"stage {stage}, an ep group: {sent} bytes dispatched but {back} combined")
        ledger.append((stage, Counter(ranks[0]["ledger"]), want, dispatched, combined))
        formula = expert_elements_per_rank(run, stage)
        for r in ranks:
            if r["experts"] != formula or r["expert_adam"] not in (None, 2 * formula):
                problems.append(f"stage {stage}: a rank holds {r['experts']} expert elements and {r['expert_adam']} "
                                f"of their Adam state, the formula {formula} and {2 * formula}")
        memory.append((stage, ranks[0]["experts"], formula, ranks[0]["expert_adam"], ranks[0]["dense"]))
    for r in per_rank[1:]:
        if r["losses"] != per_rank[0]["losses"]:
            problems.append(f"rank {per_rank.index(r)} reports other losses than rank 0")
            break
    return RunReport(run, equivalence, ledger, memory, problems)


# ---------------------------------------------------------------------------------------
# load balance (one device)
# ---------------------------------------------------------------------------------------
BALANCING = {   # name -> the router's settings
    "no balancing": dict(),
    "aux loss 1e-2": dict(moe_aux_loss_coeff=1e-2),
    "sigmoid, no balancing": dict(moe_router_score_function="sigmoid"),
    "sigmoid + expert bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                  moe_router_bias_update_rate=1e-2),
}
CAPACITY_FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)


def routed_counts(model: GPTModel, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Tokens per expert [E] of each MoE layer on `tokens` (no gradient, nothing accumulated):
    each layer's input is caught by a forward pre-hook and routed again by MoELayer.route."""
    inputs = []
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    hooks = [layer.register_forward_pre_hook(lambda mod, args: inputs.append(args[0])) for layer in layers]
    try:
        with torch.no_grad():
            was_training = model.training
            model.eval()
            model(tokens)
            model.train(was_training)
            return [layer.route(x.reshape(-1, x.shape[-1]))[2].sum(0) for layer, x in zip(layers, inputs)]
    finally:
        for hook in hooks:
            hook.remove()


def dropped_fraction(model: GPTModel, tokens: torch.Tensor, capacity_factor: float) -> float:
    """The fraction of routed (token, expert) pairs a capacity of ceil(T k / E x factor) drops
    (drop policy "probs"), over every MoE layer, on `tokens`."""
    inputs, kept, routed = [], 0, 0
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    hooks = [layer.register_forward_pre_hook(lambda mod, args: inputs.append(args[0])) for layer in layers]
    try:
        with torch.no_grad():
            model.eval()
            model(tokens)
            model.train()
            for layer, x in zip(layers, inputs):
                _, probs, routing_map = layer.route(x.reshape(-1, x.shape[-1]))
                _, kept_map = apply_token_dropping(probs, routing_map, layer.config.moe_router_topk, capacity_factor)
                kept, routed = kept + int(kept_map.sum()), routed + int(routing_map.sum())
    finally:
        for hook in hooks:
            hook.remove()
    return 1 - kept / routed


# The load-balance runs read these chapters' texts as the frozen corpus holds them
# (minimegatron/data/book_corpus.jsonl.gz), so that editing the book does not move their
# numbers; bytes as tokens (the byte tokenizer).
BALANCE_TEXTS = ("chapters/00_single_device/README.md", "chapters/01_dp/README.md", "chapters/02_tp/README.md")


def balance_batches(steps: int, batch: int, seq: int) -> tuple[list[dict], torch.Tensor]:
    """(one training micro-batch {"tokens", "labels"} [batch, seq] per step, a held-out batch of
    tokens [batch, seq]) cut from BALANCE_TEXTS's paragraphs in the frozen corpus, as UTF-8
    bytes: the training windows start at random offsets (a fixed seed) in the first 90% of the
    text, the held-out ones in the rest."""
    documents = [json.loads(line) for line in gzip.decompress(FROZEN.read_bytes()).decode("utf-8").splitlines()]
    text = "\n\n".join(doc["text"] for doc in documents if doc["source"] in BALANCE_TEXTS)
    data = torch.tensor(list(text.encode("utf-8")))
    split = int(0.9 * len(data))
    g = torch.Generator().manual_seed(0)

    def windows(lo: int, hi: int) -> torch.Tensor:                              # [batch, seq + 1]
        starts = torch.randint(lo, hi - seq - 1, (batch,), generator=g)
        return torch.stack([data[i:i + seq + 1] for i in starts.tolist()])
    train = [windows(0, split) for _ in range(steps)]
    return [{"tokens": w[:, :-1], "labels": w[:, 1:]} for w in train], windows(split, len(data))[:, :-1]


def load_balance(steps: int = 60, experts: int = 8, topk: int = 2, seq: int = 64, batch: int = 8) -> dict:
    """Train the same tiny GPT-MoE (float32, h 64, 2 MoE layers, `experts` experts, top-k) for
    `steps` AdamW steps on the book's text (balance_batches), once per BALANCING setting, on one
    device. Returns {name: {"imbalance": [max / mean tokens per expert after each step, over the
    layers], "final": [fraction of the routed pairs per expert after the last step, in the layer
    whose max / mean is the largest then], "final_layer": that layer's index, "dropped":
    {capacity factor: fraction of pairs dropped}}}, all on a held-out batch."""
    base = dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                vocab_size=257, max_position_embeddings=seq, params_dtype="float32", num_experts=experts,
                moe_router_topk=topk, moe_ffn_hidden_size=64)
    train = TrainConfig(seq_length=seq, micro_batch_size=batch, train_iters=steps, lr=3e-3, lr_warmup_iters=0,
                        clip_grad=1.0, progress=False, eval_interval=0)
    batches, held_out = balance_batches(steps, batch, seq)
    results = {}
    for name, router in BALANCING.items():
        cfg = ModelConfig.llama(**{**base, **router})
        model = GPTModel(cfg)
        optimizer = Optimizer([model], train)
        imbalance = []
        for step in range(steps):
            train_step([model], optimizer, [batches[step]], Layout(), learning_rate(step, train))
            counts = routed_counts(model, held_out)
            imbalance.append(max(float(c.max() / c.float().mean()) for c in counts))
        counts = routed_counts(model, held_out)
        # the layer the imbalance curve ends on (its worst), so the shares show the collapse the curve shows
        worst = max(range(len(counts)), key=lambda i: float(counts[i].max() / counts[i].float().mean()))
        final = counts[worst]
        results[name] = {"imbalance": imbalance, "final": (final / final.sum()).tolist(), "final_layer": worst,
                         "dropped": {f: dropped_fraction(model, held_out, f) for f in CAPACITY_FACTORS}}
    return results


def load_balance_lines(results: dict) -> list[str]:
    lines = ["[4/4] load balance, one device, chapters 00-02's text: max/mean tokens per expert on a held-out batch "
             "(1 = balanced), and routed pairs dropped at capacity factor " + ", ".join(map(str, CAPACITY_FACTORS))]
    for name, r in results.items():
        curve = r["imbalance"]
        dropped = ", ".join(f"{r['dropped'][f]:.0%}" for f in CAPACITY_FACTORS)
        lines.append(f"      {name:22s} step 1: {curve[0]:.2f}, last: {curve[-1]:.2f}; dropped {dropped}")
    return lines


def summary_line(reports: list[RunReport]) -> str:
    """The demo's last line: MATCH ... or MISMATCH ..."""
    compared = all(r.run.model.moe_expert_capacity_factor is None for r in reports)
    return verdict_line(reports, lambda r: r.run.name(), ("the dispatcher's messages equal the formulas; " if compared
                                                           else "") + "every rank holds the experts the formula says")


# ---------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = demo_parser("05", "Chapter 05: train a tiny GPT-MoE with expert parallelism (x tensor, sequence, "
                               "context, pipeline and data parallelism) and check it against the single-device run, "
                               "the dispatcher's formulas, the accounting, and show the load balance.")
    parser.epilog = "world = tp x cp x pp x dp; the experts' grid: etp x ep x expert-dp x pp over the same ranks. " \
                    + parser.epilog
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel size (default 2)")
    parser.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: --tp)")
    parser.add_argument("--num-experts", type=int, default=None,
                        help="experts per MoE layer (default 4, or the smallest multiple of --ep above it)")
    parser.add_argument("--topk", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--dispatcher", choices=["alltoall", "allgather"], default="alltoall")
    parser.add_argument("--capacity-factor", type=float, default=None,
                        help="expert capacity factor (default none: no token dropped); the ledger check then covers "
                             "only the messages whose size does not depend on the routing")
    parser.add_argument("--shared-expert", type=int, default=None, metavar="WIDTH",
                        help="a shared expert of this inner width (default none)")
    parser.add_argument("--expert-bias", action="store_true", help="sigmoid scores with DeepSeek-V3's expert bias")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1; > 1 needs --sp)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (MoE with --tp > 1 needs it)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    parser.add_argument("--dp", type=int, default=None,
                        help="data-parallel replicas (default: world / (tp cp pp) under torchrun, else --ep)")
    parser.add_argument("--zero-stage", type=int, choices=[0, 1], default=0,
                        help="1: ZeRO-1, the dense state sharded over dp x cp, the experts' over expert-dp")
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 64, or 32 with --quick)")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="AdamW steps (default 3, or 2 with --quick)")
    parser.add_argument("--balance-steps", type=int, default=None,
                        help="steps of the load-balance runs (default 60, or 0 with --quick: not run)")
    parser.add_argument("--quick", action="store_true", help="sequences of 32, 2 steps, no load-balance runs")
    args = parser.parse_args(argv)
    check_at_least(parser, args, 0, "balance_steps")
    return check_at_least_one(parser, args, "ep", "etp", "topk", "tp", "cp", "pp", "dp", "micro_batches", "num_experts",
                              "seq", "steps")


def build_run(args: argparse.Namespace, dp: int) -> MoERun:
    """The run every rank trains; ConfigError naming the numbers if it cannot: in this demo's
    flags for what its flags decide (sequence parallelism with --tp, the experts' grid, the
    sequence length), in the configuration's fields for the rest (parallelize.validate_layout)."""
    experts = args.num_experts if args.num_experts is not None else -(-4 // args.ep) * args.ep
    router = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_bias_update_rate=1e-2) if args.expert_bias else {}
    model = tiny_moe(args.dtype, num_layers=2 * args.pp, num_experts=experts, moe_router_topk=args.topk,
                     moe_expert_capacity_factor=args.capacity_factor,
                     moe_shared_expert_intermediate_size=args.shared_expert, **router)
    seq = args.seq if args.seq is not None else (32 if args.quick else 64)
    check_expert_flags(args, experts, dp)
    check_sequence_length(seq, cp=args.cp, tp=args.tp, sp=args.sp, max_positions=model.max_position_embeddings,
                          given=args.seq is not None)
    return make_run(model, tp=args.tp, cp=args.cp, pp=args.pp, dp=dp, ep=args.ep, etp=args.etp, sp=args.sp,
                    dispatcher=args.dispatcher, micro_batches=args.micro_batches, zero_stage=args.zero_stage,
                    steps=args.steps if args.steps is not None else (2 if args.quick else 3), seq=seq)


def check_expert_flags(args: argparse.Namespace, experts: int, dp: int) -> None:
    """ConfigError, in this demo's flags, for what they decide about the experts: --tp > 1
    without --sp (Megatron-Core's rule: each tp rank routes its own s / tp tokens), --ep not
    dividing the experts, and an experts' grid etp x ep x pp that does not divide the ranks
    tp x cp x pp x dp (the two grids cover the same ranks)."""
    etp = args.etp if args.etp is not None else args.tp
    if args.tp > 1 and not args.sp:
        raise ConfigError(f"--tp {args.tp} without --sp: a mixture of experts under tensor parallelism needs sequence "
                          f"parallelism, as in Megatron-Core (each tp rank routes its own s / tp tokens); add --sp")
    if experts % args.ep:
        raise ConfigError(f"--ep {args.ep} must divide --num-experts {experts}: each ep rank holds whole experts")
    world = args.tp * args.cp * args.pp * dp
    if world % (etp * args.ep * args.pp):
        default = "" if args.etp is not None else " (its default: --tp)"
        dp_flag = f"--dp {dp}" if args.dp is not None else f"dp {dp}"
        raise ConfigError(f"--etp {etp}{default} x --ep {args.ep} x --pp {args.pp} = {etp * args.ep * args.pp} must "
                          f"divide the {world} ranks (--tp {args.tp} x --cp {args.cp} x --pp {args.pp} x {dp_flag}): "
                          f"the experts' grid covers the same ranks; use another --etp, --ep or --dp")


@dataclass
class MoEResults(Results):
    """What report printed: the ranks, the largest differences from the single-device run, each
    stage's dispatcher totals (RunReport.dispatch_totals) and T, the tokens a rank routes; the
    accounting (RunReport.accounting), each stage's expert elements per rank {"stage", "experts",
    "formula", "adam", "dense"}, and load_balance's results (None when not run)."""
    ranks: int = 0
    dloss: float = 0.0
    dgrad: float = 0.0
    dparam: float = 0.0
    dispatch: list[dict] = field(default_factory=list)
    tokens_per_rank: int = 0
    accounting: dict = field(default_factory=dict)
    memory: list[dict] = field(default_factory=list)
    balance: dict | None = None


def report(args, run: MoERun, per_rank: list[dict]) -> MoEResults:
    result = check_run(run, per_rank)
    print(result)
    balance_steps = args.balance_steps if args.balance_steps is not None else (0 if args.quick else 60)
    balance = load_balance(steps=balance_steps) if balance_steps else None
    if balance:
        print("\n".join(load_balance_lines(balance)))
    e = result.equivalence
    return MoEResults(verdict=summary_line([result]), ranks=run.world, dloss=e.max_loss_diff, dgrad=e.max_grad_diff,
                      dparam=e.max_param_diff, dispatch=result.dispatch_totals(), tokens_per_rank=tokens_per_rank(run),
                      accounting=result.accounting(),
                      memory=[dict(zip(("stage", "experts", "formula", "adam", "dense"), m)) for m in result.memory],
                      balance=balance)


def main(argv=None) -> MoEResults:
    return run_demo(parse_args(argv), "05", build_run, train_run, report,
                    model_parallel=lambda args: {"tp": args.tp, "cp": args.cp, "pp": args.pp},
                    spawn_dp=spawn_data_parallel_size)


def spawn_data_parallel_size(args: argparse.Namespace) -> int:
    """dp without torchrun: --dp, or the smallest that lets the experts' grid etp x ep (x pp)
    divide the ranks tp x cp x dp (x pp): etp ep / gcd(tp cp, etp ep)."""
    if args.dp is not None:
        return args.dp
    experts_grid = args.ep * (args.etp if args.etp is not None else args.tp)
    return experts_grid // math.gcd(args.tp * args.cp, experts_grid)


if __name__ == "__main__":      # the guard matters: spawned ranks import this file again
    sys.exit(main().exit_code)
