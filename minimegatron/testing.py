"""How the book proves a parallel run equal to the single-device run.

A `RunRecord` holds the loss of every step, the first step's gradients (full, under
single-device names and shapes) and the parameters after the last step. `compare_runs` reports
the largest difference of each against the dtype's tolerance; `assert_equivalent` fails with it.

Tolerances are not zero because a parallel run adds the same numbers in another order, and
floating-point addition is not associative. `TOLERANCES` is the table per dtype; the bounds it
is checked against are derived below from the precision and the operations under test:
`rounding_tolerance` (n roundings in two orders: 2 lambda sqrt(n) u), `forward_operations`,
`cast_layout_tolerance` (casts on other scales) and `adam_step_bound`. For the demos' models
(h 32, 2 layers, s 32, V 64, 3 steps, 256 tokens a step):

  float64   rounding_tolerance over forward+backward x 3 steps (5,904 roundings): 4e-13 on the
            loss, 1e-13 relative; the row is about 1000 x that
  float32   the same bound: 2e-4 on the loss, 5e-5 relative; the row's loss (1e-5) is tighter
            (the mean over tokens averages its roundings: an empirical row)
  bf16/fp16 cast_layout_tolerance on their grids (one cast GEMM): loss 1.2e-2 / 1.5e-3,
            rtol 1.6e-2 / 2e-3; the rows (2e-2 / 5e-3, 5e-2 / 1e-2) are above both

AdamW turns a gradient g far below eps into an update of about lr * g / eps, so multi-step Adam
equivalence tests run in float64; float32 ones use adam_eps = 1e-5 or compare no parameters.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.distributed as dist

from . import comm
from .analysis import measure_saved_activation_bytes
from .config import ModelConfig, TrainConfig
from .cp import get_batch_on_this_cp_rank
from .data.gpt_dataset import global_sample_indices
from .dp import unwrap
from .optim import learning_rate
from .parallel_state import Layout
from .parallelize import build_model, build_optimizer, full_model_tensors
from .pp import PipelineComm
from .resume import initialize_layout
from .tp import model_parallel_manual_seed
from .train import before_optimizer_step, train_step


@dataclass(frozen=True)
class Tolerance:
    loss: float       # absolute, on the mean token loss
    rtol: float       # relative, on gradients and parameters
    atol: float       # absolute, on gradients (and parameters unless param_atol is given)
    param_atol: float | None = None     # absolute, on parameters, where it differs from atol
    param_rtol: float | None = None     # relative, on parameters, where it differs from rtol

    @property
    def parameters_atol(self) -> float:
        return self.atol if self.param_atol is None else self.param_atol

    @property
    def parameters_rtol(self) -> float:
        return self.rtol if self.param_rtol is None else self.param_rtol


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(loss=1e-10, rtol=1e-9, atol=1e-11),
    torch.float32: Tolerance(loss=1e-5, rtol=1e-4, atol=1e-6),
    torch.bfloat16: Tolerance(loss=2e-2, rtol=5e-2, atol=5e-3),
    torch.float16: Tolerance(loss=5e-3, rtol=1e-2, atol=1e-3),
}


# ---------------------------------------------------------------------------------------
# where tolerances come from: the precision and the number of operations under test
# ---------------------------------------------------------------------------------------
# Unit round-off u = 2^-p of a format with p significand bits (the implicit one counted): rounding
# to nearest moves a number by at most u relative (Higham, Accuracy and Stability of Numerical
# Algorithms, 2002, §2.1). FP8: e4m3 keeps 3 stored bits (p 4), e5m2 2 (p 3).
UNIT_ROUNDOFF: dict[str, float] = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "bfloat16": 2.0 ** -8,
                                   "float16": 2.0 ** -11, "e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}
# lambda of Higham and Mary's probabilistic bound: it holds with probability at least
# 1 - 2 exp(-lambda^2 (1 - u)^2 / 2) per result, 1 - 3e-8 for lambda = 6.
CONFIDENCE = 6.0


def unit_roundoff(precision: torch.dtype | str) -> float:
    """u of a torch dtype or of a name in UNIT_ROUNDOFF ("float32", "e4m3", ...)."""
    name = str(precision).replace("torch.", "")
    if name not in UNIT_ROUNDOFF:
        raise ValueError(f"no unit round-off for {precision!r}: known are {sorted(UNIT_ROUNDOFF)}")
    return UNIT_ROUNDOFF[name]


def rounding_tolerance(precision: torch.dtype | str, operations: int, magnitude: float = 1.0) -> float:
    """How far apart two computations of one result may land when each rounds `operations` = n times
    in precision's arithmetic, in different orders: 2 gamma(n) * magnitude (`magnitude` bounds the
    result's size), with gamma(n) = exp(lambda sqrt(n) u + n u^2 / (1 - u)) - 1 ~ lambda sqrt(n) u,
    the relative error of n independent mean-zero roundings |d_i| <= u with probability
    1 - 2 exp(-lambda^2 (1 - u)^2 / 2), lambda = CONFIDENCE (Higham and Mary, SIAM J. Sci. Comput.
    41(5), 2019, Theorem 2.4). n: the longest chain of roundings behind the result (a sum of k
    terms rounds k - 1 times), summed over the layers it passes (forward_operations)."""
    if operations < 1:
        raise ValueError(f"operations={operations} must be at least 1")
    u = unit_roundoff(precision)
    gamma = math.expm1(CONFIDENCE * math.sqrt(operations) * u + operations * u * u / (1 - u))
    return 2 * gamma * magnitude


def forward_operations(model_cfg: ModelConfig, seq_length: int) -> int:
    """The roundings on the longest path from the embedding to one token's logits: in each layer
    the two norms (a sum of h squares each), the qkv and output projections (h each), the
    attention scores (head dim), the softmax's sum and the weighted sum of values (s each), fc1
    (h) and fc2 (ffn); then the final norm (h) and the output layer (h)."""
    h, s, f = model_cfg.hidden_size, seq_length, model_cfg.ffn_hidden_size
    per_layer = 2 * h + 2 * h + h // model_cfg.num_attention_heads + 2 * s + h + f
    return model_cfg.num_layers * per_layer + 2 * h


def adam_step_bound(beta1: float, beta2: float, step: int) -> float:
    """The largest |m_hat / sqrt(v_hat)| AdamW can reach at `step` (1-based), whatever the
    gradients: m_hat = sum_i a_i g_i and v_hat = sum_i c_i g_i^2 (a_i, c_i: the bias-corrected
    weights (1 - b1) b1^(t-i) / (1 - b1^t) and likewise with b2), so by Cauchy-Schwarz
    |m_hat| <= sqrt(sum a_i^2 / c_i) sqrt(v_hat). 1 at step 1 (the update is lr * sign(g))."""
    a = [(1 - beta1) * beta1 ** (step - i) / (1 - beta1 ** step) for i in range(1, step + 1)]
    c = [(1 - beta2) * beta2 ** (step - i) / (1 - beta2 ** step) for i in range(1, step + 1)]
    return math.sqrt(sum(ai * ai / ci for ai, ci in zip(a, c)))


def cast_layout_tolerance(grid: str, tokens: int, vocab_size: int, train_cfg: TrainConfig,
                          largest_gradient: float, gradient_grid: str | None = None, cast_gemms: int = 1
                          ) -> Tolerance:
    """The tolerance of a layout whose casts to a coarse grid ("e4m3", "e5m2", "bfloat16", "float16")
    may use other scales than one device's (FP8 delayed scaling over replicas, chapter 06 §5);
    everything else as on one device. `grid`: the forward's casts; `gradient_grid`: the output
    gradients' (default `grid`); `cast_gemms`: cast GEMMs on the longest backward path (4 a layer).

    Derivation (u = unit_roundoff of a grid; two casts of one element differ by <= 2u relative):
      loss       each of `tokens` token losses (ln(vocab_size) at the start) moves by <= one grid
                 step, independently, mean zero: Hoeffding bounds the mean's change by
                 CONFIDENCE * 2u * ln(vocab_size) / sqrt(tokens).
      gradients  a GEMM of two cast operands moves its products by 2 (u_grid + u_gradient_grid);
                 a scale change moves a whole tensor, so no averaging over tokens; over cast_gemms
                 GEMMs, sqrt(cast_gemms) times that (an estimate, lambda 1). rtol that; atol that of
                 `largest_gradient`. Clamping at the format's largest value is left out.
      parameters AdamW moves a parameter by <= lr * adam_step_bound a step: atol twice that,
                 summed over train_iters steps."""
    u, t = unit_roundoff(grid), train_cfg
    u_gradient = unit_roundoff(gradient_grid or grid)
    mean_change = CONFIDENCE * 2 * max(u, u_gradient) / math.sqrt(tokens)
    gradient_change = 2 * (u + u_gradient) * math.sqrt(cast_gemms)
    drift = sum(2 * t.lr * adam_step_bound(t.adam_beta1, t.adam_beta2, step) for step in range(1, t.train_iters + 1))
    return Tolerance(loss=mean_change * math.log(vocab_size), rtol=gradient_change,
                     atol=gradient_change * largest_gradient, param_atol=drift, param_rtol=0.0)


@dataclass
class RunRecord:
    """What an equivalence test compares. Tensors use single-device names and full shapes."""
    losses: list[float]
    grads: dict[str, torch.Tensor]                 # gradients of the first step
    params: dict[str, torch.Tensor]                # parameters after the last step


@dataclass
class EquivalenceReport:
    dtype: torch.dtype
    tolerance: Tolerance
    max_loss_diff: float
    max_grad_diff: float
    max_param_diff: float
    worst_grad: str = ""
    worst_param: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        verdict = "MATCH" if self.ok else "MISMATCH"
        t = self.tolerance
        lines = [f"{verdict} with the single-device run ({str(self.dtype).replace('torch.', '')})",
                 f"  loss       max |diff| = {self.max_loss_diff:.3e}   (tolerance {t.loss:.0e})",
                 f"  gradients  max |diff| = {self.max_grad_diff:.3e}   (rtol {t.rtol:.0e}, atol {t.atol:.0e}) {self.worst_grad}",
                 f"  parameters max |diff| = {self.max_param_diff:.3e}   (rtol {t.parameters_rtol:.0e}, "
                 f"atol {t.parameters_atol:.0e}) {self.worst_param}"]
        lines += [f"  problem: {p}" for p in self.problems]
        return "\n".join(lines)


def _compare_tensors(kind: str, ref: dict[str, torch.Tensor], other: dict[str, torch.Tensor],
                     tol: Tolerance, problems: list[str]) -> tuple[float, str]:
    atol, rtol = (tol.parameters_atol, tol.parameters_rtol) if kind == "parameter" else (tol.atol, tol.rtol)
    if set(ref) != set(other):
        missing, extra = sorted(set(ref) - set(other)), sorted(set(other) - set(ref))
        problems.append(f"{kind}: names differ (missing {missing[:3]}, unexpected {extra[:3]})")
    worst, worst_name = 0.0, ""
    for name in sorted(set(ref) & set(other)):
        a, b = ref[name].detach().double(), other[name].detach().double()
        if a.shape != b.shape:
            problems.append(f"{kind} {name}: shape {tuple(b.shape)} != {tuple(a.shape)}")
            continue
        diff = (a - b).abs()
        if diff.numel() and diff.max().item() > worst:
            worst, worst_name = diff.max().item(), name
        if not torch.all(diff <= atol + rtol * a.abs()):
            problems.append(f"{kind} {name}: max |diff| {diff.max().item():.3e} out of tolerance")
    return worst, worst_name


def compare_runs(reference: RunRecord, candidate: RunRecord, dtype: torch.dtype,
                 tolerance: Tolerance | None = None) -> EquivalenceReport:
    """Largest loss, gradient and parameter differences of `candidate` against `reference`,
    judged by TOLERANCES[dtype] (or `tolerance`, a caller's stated one)."""
    tol = tolerance or TOLERANCES[dtype]
    problems: list[str] = []
    if len(reference.losses) != len(candidate.losses):
        problems.append(f"{len(candidate.losses)} losses, expected {len(reference.losses)}")
    loss_diff = max((abs(a - b) for a, b in zip(reference.losses, candidate.losses)), default=0.0)
    if loss_diff > tol.loss:
        problems.append(f"loss differs by {loss_diff:.3e} > {tol.loss:.0e}")
    grad_diff, worst_grad = _compare_tensors("gradient", reference.grads, candidate.grads, tol, problems)
    param_diff, worst_param = _compare_tensors("parameter", reference.params, candidate.params, tol, problems)
    return EquivalenceReport(dtype, tol, loss_diff, grad_diff, param_diff, worst_grad, worst_param, problems)


def assert_equivalent(reference: RunRecord, candidate: RunRecord, dtype: torch.dtype) -> EquivalenceReport:
    report = compare_runs(reference, candidate, dtype)
    assert report.ok, "\n" + str(report)
    return report


def make_batches(model_cfg: ModelConfig, steps: int, batch_size: int, seq_length: int,
                 seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Random global batches {"tokens", "labels"} [batch_size, seq_length], one per step."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, model_cfg.vocab_size, (batch_size, seq_length + 1), generator=g) for _ in range(steps)]
    return [{"tokens": x[:, :-1], "labels": x[:, 1:]} for x in rows]


def global_batches(model_cfg: ModelConfig, train_cfg: TrainConfig, dp: int = 1,
                   seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """make_batches for a data-parallel run: one global batch per step (train_iters of them) of
    micro_batch_size * grad_accum_steps * dp sequences: what the single device sees."""
    t = train_cfg
    return make_batches(model_cfg, t.train_iters, t.micro_batch_size * t.grad_accum_steps * dp, t.seq_length, seed=seed)


def local_microbatch(batch: dict[str, torch.Tensor], train_cfg: TrainConfig, m: int, dp_rank: int,
                     dp: int) -> dict[str, torch.Tensor]:
    """Data-parallel rank dp_rank's micro-batch m of a global batch: the rows the training
    loop's data order gives it (data.gpt_dataset.global_sample_indices, Megatron's order)."""
    rows = global_sample_indices(0, train_cfg.micro_batch_size, m, train_cfg.grad_accum_steps, dp_rank, dp)
    return {k: v[rows] for k, v in batch.items()}


def train_layout(model_cfg: ModelConfig, train_cfg: TrainConfig, dp: int, batches: list[dict[str, torch.Tensor]],
                 tags: tuple[str, ...] = (), after_build=None, load_balance: bool = True, split_batch=None
                 ) -> tuple[dict, list, object, object]:
    """Train `model_cfg` on this rank's share of `batches` (one global batch a step) on `train_cfg`'s
    layout over the whole world, with the loop's own pieces (initialize_layout, build_model then
    `after_build(chunks, layout)`, build_optimizer, train_step on this rank's micro-batches, split by
    `split_batch`, default cp.get_batch_on_this_cp_rank). Collective over every rank.

    Returns (out, chunks, layout, optimizer); out: "tp_rank", "cp_rank", "pp_rank", "dp_rank",
    "ep_rank", "etp_rank", "expert_dp_rank", "losses" (global means), "grads" (first step) and
    "params" (final) under single-device names, "ledger" (the first step's (op, tag, bytes) for
    `tags`), "records" (its CommRecords, without this function's gathers), "microbatches"."""
    split_batch = split_batch or get_batch_on_this_cp_rank
    world = dist.get_world_size() if dist.is_initialized() else 1
    t = train_cfg
    needed = t.tensor_model_parallel_size * t.context_parallel_size * t.pipeline_model_parallel_size * dp
    if world != needed:
        raise ValueError(f"this layout needs tp x cp x pp x dp = {needed} ranks, the world has {world}")
    layout = initialize_layout(t)
    chunks = build_model(model_cfg, t, layout)
    if after_build is not None:
        after_build(chunks, layout)
    optimizer = build_optimizer(chunks, t, layout)
    local_seq = t.seq_length // layout.cp // (layout.tp if t.sequence_parallel else 1)
    p2p = (PipelineComm(layout.pp_ranks, layout.pp_rank, len(chunks), (t.micro_batch_size, local_seq, model_cfg.hidden_size),
                        model_cfg.dtype, overlap_p2p_comm=t.overlap_p2p_comm) if layout.pp > 1 else None)
    out = {"tp_rank": layout.tp_rank, "cp_rank": layout.cp_rank, "pp_rank": layout.pp_rank,
           "dp_rank": layout.data_parallel_rank, "ep_rank": layout.ep_rank, "etp_rank": layout.etp_rank,
           "expert_dp_rank": comm.group_rank(layout.expert_dp_group) if layout.expert_dp_group is not None else 0,
           "losses": [], "grads": {}}
    for step, batch in enumerate(batches):
        microbatches = [split_batch(local_microbatch(batch, t, m, layout.data_parallel_rank, dp), layout.cp,
                                    layout.cp_rank, load_balance) for m in range(t.grad_accum_steps)]

        def keep_grads():          # the loss's gradients: a loss scaler's factor divided out (exact: a power of 2)
            if not out["grads"]:
                out["grads"] = {n: g / optimizer.loss_scale for n, g in full_model_tensors(chunks, layout, grads=True).items()}
        with comm.record_communication() as ledger, before_optimizer_step(optimizer, keep_grads):
            loss, _ = train_step(chunks, optimizer, microbatches, layout, learning_rate(step, t), p2p,
                                 t.pipeline_schedule)
        if step == 0:
            out["ledger"] = [(r.op, r.tag, r.nbytes) for r in ledger if r.tag in tags]
            out["records"] = [r for r in ledger if r.tag not in ("full", "inspect")]    # the step's own
        mean = torch.tensor([loss], dtype=torch.float64)
        comm.all_reduce(mean, layout.dp_group, op="avg", tag="loss")     # over dp x cp: the global mean
        out["losses"].append(mean.item())
    out["params"] = full_model_tensors(chunks, layout)
    out["microbatches"] = microbatches
    return out, chunks, layout, optimizer


def saved_activation_bytes_per_rank(cases: list[tuple]) -> list[int]:
    """Spawn target: for each (model_cfg, train_cfg, b, s), build this rank's model over the whole
    world, run one train-mode forward with random labels, and return the bytes it saved for backward
    (analysis.measure_saved_activation_bytes). Collective: every rank passes the same cases."""
    out = []
    for model_cfg, train_cfg, b, s in cases:
        layout = initialize_layout(train_cfg)
        model = build_model(model_cfg, train_cfg, layout)[0].train()
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, model_cfg.vocab_size, (b, s), generator=g)
        labels = torch.randint(0, model_cfg.vocab_size, (b, s), generator=g)
        torch.manual_seed(1)
        model_parallel_manual_seed(1234, tp_rank=layout.tp_rank)
        out.append(measure_saved_activation_bytes(model, tokens, labels))
    return out


def split_microbatches(batch: dict[str, torch.Tensor], num: int) -> list[dict[str, torch.Tensor]]:
    """Cut a global batch [B, s] into `num` micro-batches [B/num, s] along the batch dim."""
    B = batch["tokens"].shape[0]
    if B % num:
        raise ValueError(f"batch size {B} is not divisible by {num} micro-batches")
    return [{k: v[i * (B // num):(i + 1) * (B // num)] for k, v in batch.items()} for i in range(num)]


def one_device_config(cfg: TrainConfig) -> TrainConfig:
    """`cfg` for one process: every parallel size 1 (tp, cp, pp, ep, etp), no sequence
    parallelism, no interleaving (1F1B), no ZeRO; everything else (precision, optimizer,
    batch) as it was. A parallel run's single-device reference trains with it."""
    return replace(cfg, tensor_model_parallel_size=1, context_parallel_size=1, pipeline_model_parallel_size=1,
                   sequence_parallel=False, expert_model_parallel_size=1, expert_tensor_parallel_size=None,
                   num_virtual_stages_per_pipeline_rank=1, pipeline_schedule="1f1b", zero_stage=0)


def single_device_run(model_cfg: ModelConfig, batches: list[dict[str, torch.Tensor]],
                      train_cfg: TrainConfig | None = None, grad_accum_steps: int = 1) -> RunRecord:
    """The reference: train the single-device model one step per global batch with the loop's own
    build_model, build_optimizer and train.train_step on one process (one_device_config), AdamW and
    the schedule of `train_cfg` (default: TrainConfig(train_iters=len(batches)), no clipping). Mixed
    precision: float32 main_grad, main parameters, loss scaler; the recorded gradients are the
    main ones, a loss scaler's power of 2 divided out."""
    cfg = one_device_config(train_cfg or TrainConfig(train_iters=len(batches), lr_warmup_iters=0, clip_grad=0.0))
    alone = Layout.alone()                    # also inside a distributed run (run_report's check)
    model = build_model(model_cfg, cfg, alone)[0]
    optimizer = build_optimizer([model], cfg, alone)
    losses, first_grads = [], {}

    def keep_first_grads():
        if not first_grads:
            grads = full_model_tensors([model], alone, grads=True)
            first_grads.update({n: g / optimizer.loss_scale for n, g in grads.items()})

    for step, batch in enumerate(batches):
        with before_optimizer_step(optimizer, keep_first_grads):
            loss, _ = train_step([model], optimizer, split_microbatches(batch, grad_accum_steps), Layout(),
                                 learning_rate(step, cfg))
        losses.append(loss)
    params = {n: t.detach().clone() for n, t in unwrap(model).state_dict().items()}   # with saved buffers (expert bias)
    return RunRecord(losses, first_grads, params)


def wait_until(done: Callable[[], bool], timeout: float = 0.5, poll: float = 0.001) -> bool:
    """Poll `done()` every `poll` seconds until it is true or `timeout` seconds have passed; return its
    last value. For what is still alive after gloo lets go of a finished collective's tensors
    (FullyShardedDataParallel.memory_profile(settle=wait_until)): a real leak survives and shows."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True
