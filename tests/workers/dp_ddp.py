"""Rank functions and checks for the tests and graders of naive DP and bucketed DDP
(tests/test_dp_ddp.py, tests/graders/test_ch01_ddp.py).

`launch.spawn` runs functions that a new process imports by name (spawned ranks inherit
sys.path, so `from workers import dp_ddp` works in them too); the checks live next to them so
that a test and a grader judge a run by exactly the same rules.

A `DPCase` describes one data-parallel training run; `run_world(cases)` runs many of them
in one spawned world (starting ranks costs seconds, a tiny run milliseconds) and returns
each rank's record; in the parent, `check_run` compares the ranks' records with
`testing.single_device_run` on the same global batches and the ledger with the formula.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minimegatron import comm
from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.dp import naive
from minimegatron.dp.ddp import DistributedDataParallel
from minimegatron.dp.naive import HookedDataParallel, NaiveDataParallel
from minimegatron.model import GPTModel
from minimegatron.optim import Optimizer, learning_rate, set_learning_rate
from minimegatron.testing import RunRecord, assert_equivalent, local_microbatch, make_batches, single_device_run


def tiny_config(style: str, dtype: str = "float64") -> ModelConfig:
    """hidden 32, 2 layers, 4 heads, sequences up to 16: GPT-2 style (tied embeddings,
    biases) or LLaMA style (untied, GQA, no biases)."""
    make = ModelConfig.gpt2 if style == "gpt2" else ModelConfig.llama
    return make(hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=16,
                params_dtype=dtype)


@dataclass(frozen=True)
class DPCase:
    """One data-parallel training run: which wrapper, model, micro-batches and steps."""
    name: str
    wrapper: str                        # "naive" | "hooked" | "ddp"
    style: str = "gpt2"
    dtype: str = "float64"
    grad_accum: int = 1                 # M micro-batches per step
    steps: int = 2
    micro_batch: int = 2                # b rows per rank per micro-batch
    seq_length: int = 16
    bucket_size_bytes: int | None = None
    overlap: bool = True
    clip_grad: float = 0.0
    hook: str | None = None             # hooked: a hook function of this module by name

    def model_config(self) -> ModelConfig:
        return tiny_config(self.style, self.dtype)

    def train_config(self) -> TrainConfig:
        return TrainConfig(train_iters=self.steps, lr_warmup_iters=0, clip_grad=self.clip_grad,
                           seq_length=self.seq_length, micro_batch_size=self.micro_batch,
                           grad_accum_steps=self.grad_accum)

    def global_batches(self, dp: int) -> list[dict[str, torch.Tensor]]:
        """One global batch of b * M * dp rows per step, the same on every rank."""
        rows = self.micro_batch * self.grad_accum * dp
        return make_batches(self.model_config(), self.steps, rows, self.seq_length, seed=7)


def build_wrapper(case: DPCase, model, group):
    if case.wrapper == "naive":
        return NaiveDataParallel(model, group)
    if case.wrapper == "hooked":
        return HookedDataParallel(model, group, hook=globals()[case.hook] if case.hook else None)
    if case.wrapper == "ddp":
        return DistributedDataParallel(model, group, bucket_size_bytes=case.bucket_size_bytes,
                                       overlap=case.overlap)
    raise ValueError(f"unknown wrapper {case.wrapper!r}")


def _records(ledger) -> list[tuple[str, int, tuple, tuple]]:
    """(op, bytes, shape, group's global ranks) of every call."""
    return [(r.op, r.nbytes, r.shape, r.group_ranks) for r in ledger]


def train_data_parallel(case: DPCase, group) -> dict:
    """Train `case` on this rank; return its losses, first-step gradients, final parameters,
    the ledger of every micro-batch and of every finish_grad_sync, and DDP's buckets and
    timelines."""
    dp, rank = comm.group_size(group), comm.group_rank(group)
    cfg, train_cfg = case.model_config(), case.train_config()
    model = GPTModel(cfg)
    wrapper = build_wrapper(case, model, group)
    optimizer = Optimizer([wrapper], train_cfg)
    names = {p: n for n, p in model.named_parameters()}
    out = {"losses": [], "ledger": [], "timelines": [], "num_params": len(names),
           "grad_bytes": sum(p.numel() * p.element_size() for p in names),
           "param_shapes": [tuple(p.shape) for p in names], "group": comm.group_ranks(group)}
    if isinstance(wrapper, DistributedDataParallel):
        out["buckets"] = [[names[p] for p in b.params] for b in wrapper.buckets]
        out["bucket_bytes"] = [b.grad_data.numel() * b.grad_data.element_size() for b in wrapper.buckets]
    for step, batch in enumerate(case.global_batches(dp)):
        loss, per_microbatch = 0.0, []
        for m in range(case.grad_accum):
            last = m == case.grad_accum - 1
            mb = local_microbatch(batch, train_cfg, m, rank, dp)   # the training loop's rows
            with comm.record_communication() as ledger, (nullcontext() if last else wrapper.no_sync()):
                local = wrapper(mb["tokens"], labels=mb["labels"]).mean() / case.grad_accum
                local.backward()
            loss += local.item()
            per_microbatch.append(_records(ledger))
        with comm.record_communication() as ledger:
            wrapper.finish_grad_sync()
        out["ledger"].append({"microbatches": per_microbatch, "finish": _records(ledger)})
        if isinstance(wrapper, DistributedDataParallel):
            out["timelines"].append(wrapper.timeline)
        if step == 0:
            out["grads"] = {names[p]: p.grad.detach().clone() for p in names}
        # the rest of train.train_step, as it runs it (the step clips)
        set_learning_rate(optimizer, learning_rate(step, train_cfg))
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(loss)
    out["params"] = {n: p.detach().clone() for p, n in names.items()}
    return out


def broadcast_check(group) -> dict:
    """Every rank builds the model, then disturbs it by its rank; broadcast_parameters must
    leave every rank with the first rank's weights. Returns the weights and the ledger."""
    rank = comm.group_rank(group)
    model = GPTModel(tiny_config("gpt2"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(float(rank))
    with comm.record_communication() as ledger:
        naive.broadcast_parameters(model, group)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "ledger": _records(ledger), "num_params": len(list(model.parameters())),
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def run_world(cases_by_dp: dict[int, list[DPCase]], broadcast: bool = False) -> dict:
    """Spawn target: for each DP size dp (ascending), ranks 0..dp-1 form a data-parallel
    group (the whole world when dp is the world size) and run its cases, and the broadcast
    check if asked. One world of the largest size thus serves every smaller size too, and
    proves the wrappers use the group they are given, not the world.

    Returns {dp: {case name: record, "broadcast": record}} for the sizes this rank is in.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for dp in sorted(cases_by_dp):
        # new_group is collective over the whole world: every rank calls it, members or not
        group = dist.group.WORLD if dp == world_size else dist.new_group(list(range(dp)))
        if rank >= dp:
            continue
        out[dp] = {c.name: train_data_parallel(c, group) for c in cases_by_dp[dp]}
        if broadcast:
            out[dp]["broadcast"] = broadcast_check(group)
    return out


# ---------------------------------------------------------------- exercise 1.1 (grader)

def grade_allreduce_gradients() -> dict:
    """Spawn target of the gradient-averaging grader. First, known gradients: rank r sets
    p.grad to a random tensor seeded by (r, p's index) and calls allreduce_gradients; then a
    naive-DP training run with 2 micro-batches. The learner's code runs first."""
    group = dist.group.WORLD
    rank = comm.group_rank(group)
    model = GPTModel(tiny_config("llama"))
    before = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        g = torch.Generator().manual_seed(1000 * rank + i)
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        before[name] = p.grad.clone()
    with comm.record_communication() as ledger:
        naive.allreduce_gradients(model, group)
    after = {n: p.grad.clone() for n, p in model.named_parameters()}
    case = DPCase("naive-grader", "naive", style="gpt2", grad_accum=2)
    return {"before": before, "after": after, "ledger": _records(ledger),
            "param_shapes": [tuple(p.shape) for p in model.parameters()],
            "run": train_data_parallel(case, group), "case": case}


# ---------------------------------------------------------------- exercise 1.5: buggy hooks

def buggy_hook_from_the_docstring(param, group, sync):
    """The version shown in average_gradient_hook's docstring (both bugs)."""
    param.data.mul_(1.0 / comm.group_size(group))
    comm.all_reduce(param.data, group, tag="grads")


def buggy_hook_averages_the_parameter(param, group, sync):
    """Respects no_sync, but averages the parameter (identical anyway) instead of the gradient."""
    if sync:
        param.data.mul_(1.0 / comm.group_size(group))
        comm.all_reduce(param.data, group, tag="grads")


def buggy_hook_syncs_every_microbatch(param, group, sync):
    """Averages the gradient correctly, but on every micro-batch: the numbers come out right
    (avg(g1) + g2 averaged again = avg(g1 + g2)), the communication is M times the formula."""
    param.grad.mul_(1.0 / comm.group_size(group))
    comm.all_reduce(param.grad, group, tag="grads")


# ---------------------------------------------------------------- checks (in the parent)

def record_of(per_rank: list[dict]) -> RunRecord:
    """The data-parallel run as one RunRecord: the global loss of a step is the mean of the
    ranks' local losses; gradients and parameters are rank 0's (check_replicas: all equal)."""
    losses = [sum(r["losses"][k] for r in per_rank) / len(per_rank) for k in range(len(per_rank[0]["losses"]))]
    return RunRecord(losses, per_rank[0]["grads"], per_rank[0]["params"])


def check_replicas(per_rank: list[dict]) -> None:
    """Every rank ends with bitwise the same gradients (step 1) and parameters."""
    for r, result in enumerate(per_rank[1:], start=1):
        for kind in ("grads", "params"):
            for name, value in per_rank[0][kind].items():
                assert torch.equal(result[kind][name], value), \
                    f"rank {r}'s {kind[:-1]} {name} differs from rank 0's: the replicas drifted apart"


def check_equivalent(case: DPCase, per_rank: list[dict]):
    """Assert the run equals the single-device run on the same global batches."""
    dp = len(per_rank)
    reference = single_device_run(case.model_config(), case.global_batches(dp), case.train_config(),
                                  grad_accum_steps=case.grad_accum)
    report = assert_equivalent(reference, record_of(per_rank), case.model_config().dtype)
    check_replicas(per_rank)
    return report


def check_ledger(case: DPCase, per_rank: list[dict]) -> None:
    """The communication of every step equals the formula, on every rank:
      * nothing inside no_sync() (micro-batches 0 .. M-2);
      * naive / hooked: one all-reduce per parameter (P calls), each of that parameter's
        gradient, together all gradient bytes; naive in finish_grad_sync, hooked in the last
        backward;
      * ddp: one all-reduce per bucket, with that bucket's bytes, together all gradient
        bytes; overlapped: all issued during the last backward, else in finish_grad_sync."""
    for r, result in enumerate(per_rank):
        for step, entry in enumerate(result["ledger"]):
            where = f"rank {r}, step {step}"
            for m, records in enumerate(entry["microbatches"][:-1]):
                assert not records, f"{where}: micro-batch {m} (inside no_sync) communicated: {records}"
            issued = entry["microbatches"][-1] + entry["finish"]
            ops = {op for op, _, _, _ in issued}
            assert ops <= {"all_reduce"}, f"{where}: unexpected collectives {sorted(ops)}"
            groups = {g for _, _, _, g in issued}
            assert groups <= {result["group"]}, f"{where}: communicated over {groups}, not the DP group"
            total = sum(nbytes for _, nbytes, _, _ in issued)
            assert total == result["grad_bytes"], \
                f"{where}: all-reduced {total} bytes, expected all gradient bytes {result['grad_bytes']}"
            if case.wrapper in ("naive", "hooked"):
                P = result["num_params"]
                assert len(issued) == P, f"{where}: {len(issued)} all-reduces, expected one per parameter ({P})"
                shapes = sorted(s for _, _, s, _ in issued)
                assert shapes == sorted(result["param_shapes"]), f"{where}: all-reduced shapes are not the gradients'"
                in_backward = case.wrapper == "hooked"
            else:
                buckets = result["bucket_bytes"]
                assert len(issued) == len(buckets), \
                    f"{where}: {len(issued)} all-reduces, expected one per bucket ({len(buckets)})"
                assert sorted(b for _, b, _, _ in issued) == sorted(buckets), f"{where}: sizes differ from the buckets'"
                in_backward = case.overlap
            late = entry["finish"] if in_backward else entry["microbatches"][-1]
            assert not late, (f"{where}: {len(late)} all-reduce(s) issued "
                              f"{'after' if in_backward else 'during'} backward, expected none")


def check_run(case: DPCase, per_rank: list[dict]):
    """check_equivalent and check_ledger: what a correct data-parallel run must satisfy."""
    report = check_equivalent(case, per_rank)
    check_ledger(case, per_rank)
    return report
