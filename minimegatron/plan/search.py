"""The search: every 5D layout of a model on a cluster, each either rejected with its reason or
estimated (memory per rank, FLOPs, bytes, bubble, step time, MFU), the valid ones ranked.

    result = search(model_cfg, cluster, gpus=1024, seq_length=8192, global_batch_size=1024)
    result.plans[0]          # the fastest estimated layout that fits
    result.rejected          # Counter{reason pattern: layouts}; result.examples[pattern]: one of them

A Layout: tp, cp, pp, v, ep, etp (MoE), ZeRO 0-3, recompute none / selective (core_attn) /
full (uniform, one layer per unit), micro-batch size; dp and m follow. bf16 mixed precision,
SP whenever tp > 1, cp_comm_type "p2p", the all-to-all dispatcher. Pruned first: sizes that
cannot divide the GPUs, tp beyond twice a node, cp ranks with fewer than
MIN_TOKENS_PER_CP_RANK tokens; v and micro-batch sizes in (1, 2, 4). Any size can be pinned.

Rejected by the first failing check, in order:

  1. node       tp within one node (tp <= GPUs per node, a divisor of it)
  2. batch      the global batch is a whole number of micro-batches per dp rank
  3. layers     pp x v divides the layers (pp.stage_layers)
  4. weights    parameters, gradients and optimizer state alone exceed the usable memory
  5. layout     parallelize.validate_layout(model, train config, gpus)
  6. memory     with the activations, the first or last stage exceeds USABLE_MEMORY of a GPU
Rejections are counted by message pattern (numbers replaced by #)."""

from __future__ import annotations

import heapq
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from .. import parallelize
from ..analysis import rank_parameters
from ..config import ConfigError, ModelConfig, TrainConfig
from ..pp import stage_layers
from .cluster import Cluster, GiB
from .megatron_formulas import megatron_flops
from .rank_memory import layer_activation_bytes, rank_memory, rank_states
from .step_time import compute_bound, step_estimate

__all__ = ["Layout", "Plan", "SearchResult", "search", "USABLE_MEMORY"]

USABLE_MEMORY = 0.9
MIN_TOKENS_PER_CP_RANK = 1024
RECOMPUTE_CHOICES = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    """One point of the search: the parallel sizes and the memory switches."""
    tp: int
    cp: int
    pp: int
    vp: int
    ep: int
    etp: int
    dp: int
    zero: int
    recompute: str
    mbs: int
    m: int

    def train_config(self, seq_length: int) -> TrainConfig:
        """The TrainConfig that runs this layout (bf16, SP with tp, overlapped ZeRO-1/2)."""
        full = self.recompute == "full"
        return TrainConfig(seq_length=seq_length, micro_batch_size=self.mbs, grad_accum_steps=self.m,
                           tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                           pipeline_schedule="interleaved" if self.vp > 1 else "1f1b",
                           num_virtual_stages_per_pipeline_rank=self.vp, sequence_parallel=self.tp > 1,
                           context_parallel_size=self.cp, expert_model_parallel_size=self.ep,
                           expert_tensor_parallel_size=self.etp, zero_stage=self.zero,
                           overlap_grad_reduce=self.zero in (1, 2), overlap_param_gather=self.zero in (1, 2),
                           bf16=True, recompute_granularity=None if self.recompute == "none" else self.recompute,
                           recompute_method="uniform" if full else None, recompute_num_layers=1 if full else None)

    def __str__(self) -> str:
        experts = f" ep{self.ep} etp{self.etp}" if self.ep > 1 or self.etp != self.tp else ""
        chunks = f"v{self.vp}" if self.vp > 1 else ""
        return (f"tp{self.tp} cp{self.cp} pp{self.pp}{chunks}{experts} dp{self.dp} zero{self.zero} "
                f"{self.recompute} mbs{self.mbs} m{self.m}")


@dataclass
class Plan:
    """A layout that fits, estimated: `memory` the fullest stage's rank_memory (with "stage"),
    `estimate` step_time.step_estimate's dict."""
    layout: Layout
    train_cfg: TrainConfig
    memory: dict
    estimate: dict


@dataclass
class SearchResult:
    plans: list[Plan]                                   # the layouts that fit, fastest first
    rejected: Counter                                   # reason pattern -> layouts rejected by it
    examples: dict[str, tuple[Layout, str]]             # reason pattern -> (a layout, its message)
    considered: int
    seconds: float
    unranked: int                                       # fit, but compute and bubble alone lose to the top `keep`
    usable_bytes: int
    settings: dict = field(default_factory=dict)


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _pattern(message: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "#", message)


def _layouts(model_cfg: ModelConfig, cluster: Cluster, gpus: int, seq: int, gbs: int, pins: dict):
    """Every Layout of the search space (see the module docstring), pins applied."""
    def choices(name, default):
        return [pins[name]] if pins.get(name) is not None else default

    moe = model_cfg.num_experts is not None
    for tp in choices("tp", [t for t in _powers_of_two(2 * cluster.gpus_per_node) if gpus % t == 0]):
        for cp in choices("cp", [c for c in _powers_of_two(gpus // tp)
                                 if c == 1 or seq // c >= MIN_TOKENS_PER_CP_RANK]):
            if gpus % (tp * cp):
                continue
            for pp in choices("pp", _divisors(gpus // (tp * cp), model_cfg.num_layers)):
                if gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                for vp in choices("vp", [1, 2, 4] if pp > 1 else [1]):
                    for etp in choices("etp", sorted({1, tp}) if moe else [tp]):
                        eps = [e for e in _divisors(model_cfg.num_experts, model_cfg.num_experts)
                               if gpus % (etp * e * pp) == 0] if moe else [1]
                        for ep in choices("ep", eps):
                            for zero in choices("zero", [0, 1, 2, 3]):
                                for recompute in choices("recompute", list(RECOMPUTE_CHOICES)):
                                    for mbs in choices("mbs", [1, 2, 4]):
                                        yield Layout(tp, cp, pp, vp, ep, etp, dp, zero, recompute, mbs,
                                                     max(1, gbs // (dp * mbs)))


class _Checker:
    """The module docstring's checks for one search, caching what layouts share (a stage's parameter
    counts, a micro-batch's activations per layer)."""

    def __init__(self, model_cfg: ModelConfig, cluster: Cluster, gpus: int, seq: int, gbs: int, usable: int):
        self.model_cfg, self.cluster, self.gpus, self.seq, self.gbs, self.usable = (model_cfg, cluster, gpus, seq,
                                                                                     gbs, usable)
        self.parameters: dict[tuple, dict] = {}
        self.activations: dict[tuple, dict] = {}
        self.flops: dict[int, dict] = {}                # Megatron's FLOPs of the global batch, by tp
        self.bar = float("inf")                         # a layout whose compute bound reaches it is not estimated

    def __call__(self, layout: Layout) -> tuple[str | None, Plan | None]:
        """(the first failing check's message, None) or (None, the plan)."""
        model_cfg, gpus, usable, n = self.model_cfg, self.gpus, self.usable, self.cluster.gpus_per_node
        if layout.tp > n or n % layout.tp:
            return (f"tensor_model_parallel_size={layout.tp} does not fit in one node of {n} GPUs: tensor "
                    f"parallelism's collectives run in every layer and need the node's NVLink"), None
        if self.gbs % (layout.dp * layout.mbs):
            return (f"global_batch_size={self.gbs} is not a multiple of data-parallel size {layout.dp} x "
                    f"micro_batch_size {layout.mbs}"), None
        try:
            stage_layers(model_cfg.num_layers, layout.pp, 0, layout.vp)
        except (ConfigError, ValueError) as exc:
            return str(exc), None
        cfg = layout.train_config(self.seq)
        stages = sorted({0, layout.pp - 1})
        counts = {}
        for r in stages:
            key = (layout.tp, layout.pp, layout.vp, layout.ep, layout.etp, r)
            if key not in self.parameters:
                self.parameters[key] = rank_parameters(model_cfg, cfg, r)
            counts[r] = self.parameters[key]
        held = [rank_states(model_cfg, cfg, gpus, r, counts[r]) for r in stages]
        states = max(h["params"] + h["grads"] + h["optimizer"] for h in held)
        if states > usable:
            return (f"parameters, gradients and optimizer state alone need {states / GiB:.1f} GiB per GPU, more "
                    f"than the {usable / GiB:.1f} GiB usable"), None
        try:
            parallelize.validate_layout(model_cfg, cfg, gpus)
        except ConfigError as exc:
            return str(exc), None
        key = (layout.tp, layout.cp, layout.etp, layout.mbs, layout.recompute)
        if key not in self.activations:
            self.activations[key] = layer_activation_bytes(model_cfg, cfg)
        memories = [dict(rank_memory(model_cfg, cfg, gpus, r, parameters=counts[r],
                                     per_microbatch=self.activations[key]), stage=r) for r in stages]
        worst = max(memories, key=lambda m: m["total"])
        if worst["total"] > usable:
            return (f"stage {worst['stage']} needs {worst['total'] / GiB:.1f} GiB per GPU (states "
                    f"{(worst['total'] - worst['activations']) / GiB:.1f}, activations "
                    f"{worst['activations'] / GiB:.1f} for {worst['in_flight']} micro-batch-chunks in flight), more "
                    f"than the {usable / GiB:.1f} GiB usable"), None
        if layout.tp not in self.flops:
            self.flops[layout.tp] = megatron_flops(model_cfg, layout.mbs * layout.m * layout.dp, self.seq, layout.tp)
        flops = self.flops[layout.tp]
        if compute_bound(model_cfg, cfg, gpus, self.cluster, flops) >= self.bar:
            return None, Plan(layout, cfg, worst, None)                 # fits, but cannot reach the top
        return None, Plan(layout, cfg, worst, step_estimate(model_cfg, cfg, gpus, self.cluster, parameters=counts,
                                                            flops=flops))


def search(model_cfg: ModelConfig, cluster: Cluster, gpus: int, seq_length: int, global_batch_size: int, *,
           keep: int | None = None, progress: bool | None = None, **pins) -> SearchResult:
    """Enumerate, check and rank (module docstring). `pins` fix tp, cp, pp, vp, ep, etp, zero,
    recompute ("none" | "selective" | "full"), mbs; ConfigError for inputs no layout satisfies.
    `keep`: layouts whose compute and bubble alone (step_time.compute_bound) are slower than the
    keep-th estimate are counted in `unranked`, not estimated (None: estimate all). `progress`: a
    bar on stderr after two seconds (default: when stderr is a terminal)."""
    model_cfg.validate()
    cluster.validate()
    cluster.check_gpus(gpus)
    unknown = set(pins) - {"tp", "cp", "pp", "vp", "ep", "etp", "zero", "recompute", "mbs"}
    if unknown:
        raise ConfigError(f"unknown search pins {sorted(unknown)}")
    if seq_length > model_cfg.max_position_embeddings:
        raise ConfigError(f"seq_length={seq_length} is longer than the model's max_position_embeddings="
                          f"{model_cfg.max_position_embeddings}")
    for name, value in (("seq_length", seq_length), ("global_batch_size", global_batch_size)):
        if value < 1:
            raise ConfigError(f"{name}={value} must be positive")
    if pins.get("recompute") not in (None, *RECOMPUTE_CHOICES):
        raise ConfigError(f"recompute={pins['recompute']!r} is not one of {', '.join(RECOMPUTE_CHOICES)}")
    if model_cfg.num_experts is None and (pins.get("ep") or 1) > 1:
        raise ConfigError(f"ep={pins['ep']}: the model has no experts")
    progress = sys.stderr.isatty() if progress is None else progress
    usable = int(cluster.memory_bytes * USABLE_MEMORY)
    start = time.perf_counter()
    layouts = list(_layouts(model_cfg, cluster, gpus, seq_length, global_batch_size, pins))
    if not layouts:
        pinned = ", ".join(f"{k}={v}" for k, v in pins.items() if v is not None)
        raise ConfigError(f"no layout to search: with {pinned}, tp x cp x pp (and etp x ep x pp) cannot divide "
                          f"gpus={gpus}")
    plans, rejected, examples, best, unranked = [], Counter(), {}, [], 0
    check = _Checker(model_cfg, cluster, gpus, seq_length, global_batch_size, usable)
    for i, layout in enumerate(layouts):
        message, plan = check(layout)
        if plan is not None and plan.estimate is None:
            unranked += 1
        elif plan is not None:
            plans.append(plan)
            if keep is not None:
                heapq.heappush(best, -plan.estimate["step_time"])
                if len(best) > keep:
                    heapq.heappop(best)
                if len(best) == keep:
                    check.bar = -best[0]
        else:
            key = _pattern(message)
            rejected[key] += 1
            examples.setdefault(key, (layout, message))
        if progress and i % 200 == 0 and time.perf_counter() - start > 2:
            done = (i + 1) / len(layouts)
            print(f"\r  [{'#' * int(30 * done):<30}] {i + 1}/{len(layouts)} layouts", end="", file=sys.stderr)
    if progress and time.perf_counter() - start > 2:
        print(file=sys.stderr)
    plans.sort(key=lambda p: (p.estimate["step_time"], p.memory["total"]))
    return SearchResult(plans, rejected, examples, len(layouts), time.perf_counter() - start, unranked, usable,
                        dict(gpus=gpus, seq_length=seq_length, global_batch_size=global_batch_size, pins=pins,
                             keep=keep))
