"""Tokens/s and MFU of the book's training step on one GPU, next to plain PyTorch (issue 32, item 7).

    python benchmarks/bench_mfu.py                               # make bench-mfu: 3 shapes x 6 paths, bf16
    python benchmarks/bench_mfu.py --shapes 1b --paths eager reference
    python benchmarks/bench_mfu.py --shapes 1b --paths eager --profile eager   # + a torch.profiler table
    python benchmarks/bench_mfu.py --smoke                       # the CPU, tiny shapes, every path (seconds)

One step is what `minimegatron.train` does for one global batch on one device
(`train.train_step` on `Layout()`, the model and optimizer from `parallelize.build_model` and
`build_optimizer`): forward, per-token loss, backward, the gradient norm and clipping, AdamW on
float32 main parameters, the bf16 parameters refreshed, zero_grad. The paths:

  eager          --bf16, --kernels torch, --adam-impl default (torch's AdamW picks its foreach form on a GPU)
  fused-adam     the same, --adam-impl fused (torch.optim.AdamW(fused=True) on the main parameters)
  compile        --kernels compile (each transformer layer through torch.compile)
  compile+fused  --kernels compile --adam-impl fused: the book's fastest combination, against the reference
  triton         --kernels triton (chapter 07's FlashAttention-2, RMSNorm, SwiGLU and fused loss)
  reference      the same network written the usual way in plain PyTorch (`PlainLlama` below):
                 float32 parameters under torch.autocast(bf16), nn.RMSNorm, one q|k|v Linear,
                 F.scaled_dot_product_attention(is_causal, enable_gqa), gate|up Linear + SiLU,
                 each block torch.compile'd, the loss in float32, clip_grad_norm_(foreach),
                 torch.optim.AdamW(fused=True); torch.utils.checkpoint per block when the shape
                 recomputes

The shapes (LLaMA blocks: RMSNorm, SwiGLU, RoPE, grouped-query attention, untied output layer):

  1b     TinyLlama-1.1B's layers: h 2048, L 22, a 32, g 4, f 5632, V 32000; s 2048, b 4 (the goal: MFU >= 45%)
  125m   GPT-3 Small's width and depth: h 768, L 12, a 12, g 4, f 2048, V 32000; s 2048, b 8
  3b     Llama-3.2-3B's layers with V 32000: h 3072, L 28, a 24, g 8, f 8192; s 2048, b 4, full recompute
         of every layer. Its 3.0e9 parameters take 20 bytes each in the book's bf16 step (2 bf16 + 4 main
         + 2 grad + 4 main grad + 8 Adam): 60 GB of the 80, the largest LLaMA shape of this family
         that leaves room for the recomputed layer and the logits (an estimate, not yet measured)

The 1b shape runs first, and in each shape eager, compile+fused and the reference run before the
other paths: a session with little device time left still measures the goal.

Before timing, each shape checks that the reference is the same network (check_same_network): a
float32 copy of both (the shape's widths, 2 layers), the book's initial weights loaded into the
reference, give the same per-token losses at initialization, the same gradients of every
parameter and the same losses over 3 training steps, within FP32_TOLERANCE; the parameter counts
and the elements AdamW decays are equal; both are charged the same FLOPs (one formula, one
config). Then every path's loss at step 0 (the initial weights, the same batch, bf16) must agree
with the eager path's within BF16_LOSS_TOLERANCE.

--smoke runs two tiny shapes (one with full recompute) on the CPU: every path, the Triton kernels
in Triton's interpreter for one step, and the reference compiled with the aot_eager backend (the
same graphs captured, without Inductor's C++ build, a minute of a loaded 2-core CPU).

MFU = analysis.training_flops(config, b, s)["total"] (the book's count: every matmul, forward
and backward, attention over all s^2 scores, no recompute, no optimizer) / median step time /
the device's dense bf16 peak (gpu_check.PEAK_TFLOPS, from the device name; --peak-tflops for
another card). Warm-up steps are not timed (the first includes compiling: its time is shown);
each timed step is bracketed by torch.cuda.synchronize. The whole run stops starting new runs
after --budget seconds (default 420: under 8 minutes on an H100 with the imports).

Exit status: 0 when every run ran, or was skipped with its reason printed (a layout the book
refuses, out of memory, out of time), and the checks agreed; 1 when a check disagreed or a run
failed; 2 without a CUDA device unless --smoke (or --device cpu).

Not yet run on a GPU (written on a CPU-only machine, 2026-12-07): the numbers, the 3b shape's
fit, and the profiler's GPU breakdown are untested until a GPU session runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import minimegatron  # noqa: E402,F401 - first: on a CPU it sets TRITON_INTERPRET before anything imports triton
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from gpu_check import PEAK_TFLOPS, no_gpu_reason  # noqa: E402 - benchmarks/gpu_check.py
from machine import cpu_model, load_average  # noqa: E402 - benchmarks/machine.py
from minimegatron.analysis import training_flops  # noqa: E402
from minimegatron.config import ConfigError, ModelConfig, TrainConfig  # noqa: E402
from minimegatron.dp import unwrap  # noqa: E402
from minimegatron.kernels import compile_cache_for_this_capability  # noqa: E402
from minimegatron.parallel_state import Layout  # noqa: E402
from minimegatron.parallelize import build_model, build_optimizer, validate_layout  # noqa: E402
from minimegatron.testing import make_batches  # noqa: E402
from minimegatron.train import before_optimizer_step, train_step  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """A LLaMA-style model and the batch it is timed on (shape legend of model/gpt.py)."""
    name: str
    hidden: int                  # h
    layers: int                  # L
    heads: int                   # a
    groups: int                  # g
    ffn: int | None              # f (None: the book's default, about 8h/3)
    vocab: int                   # V
    seq: int                     # s
    batch: int                   # b (one micro-batch: the step's global batch)
    recompute: bool              # full recompute of every layer (--recompute-granularity full)
    warmup: int                  # untimed steps
    steps: int                   # timed steps
    what: str
    paths: tuple[str, ...] | None = None    # the paths it runs (None: all that are asked for)


SHAPES = {
    "1b": Shape("1b", 2048, 22, 32, 4, 5632, 32000, 2048, 4, False, 3, 10, "TinyLlama-1.1B's layers"),
    "125m": Shape("125m", 768, 12, 12, 4, 2048, 32000, 2048, 8, False, 3, 10, "GPT-3 Small's width and depth"),
    "3b": Shape("3b", 3072, 28, 24, 8, 8192, 32000, 2048, 4, True, 2, 5,
                "Llama-3.2-3B's layers, V 32000, full recompute"),
}
SMOKE_SHAPES = {   # --smoke: the same code on tiny models, one without and one with recompute (the 3b's paths;
    # Triton's interpreter takes seconds a step, so it runs once)
    "tiny": Shape("tiny", 64, 2, 4, 2, None, 257, 32, 2, False, 1, 2, "--smoke"),
    "tiny-recompute": Shape("tiny-recompute", 64, 2, 4, 2, None, 257, 32, 2, True, 1, 2, "--smoke, full recompute",
                            paths=("eager", "fused-adam", "compile", "reference")),
}
PATHS = {   # name -> (TrainConfig.kernels, TrainConfig.adam_impl); None: the plain-PyTorch reference.
    # In the order they run: the three the goal compares first, so that --budget cuts the others.
    "eager": ("torch", "default"),
    "compile+fused": ("compile", "fused"),
    "reference": None,
    "fused-adam": ("torch", "fused"),
    "compile": ("compile", "default"),
    "triton": ("triton", "default"),
}
BUDGET_S = 420
LR = 1e-4

# float32: the two networks differ only in the order of their sums (RMSNorm's kernel or the book's four
# ops, one SDPA kernel or another). A sum of n float32 terms is off by about sqrt(n) 2^-24 of its size
# (random rounding); the longest chain here is ~10 matmuls and softmaxes (2 layers and the head) of up to
# h = 3072 terms: 10 sqrt(3072) 6e-8 = 3e-5 relative, for the gradients (compared relative to each
# tensor's largest) and the losses (~ln V ~ 10 absolute: 3e-4). 1e-3 sits above both. What it must
# catch (tests/test_benchmarks.py, at the --smoke shape): a reference without RoPE, or with query heads
# reading another group's keys and values, misses it over ten times in the gradients, while the same
# network stays a hundred times under it.
FP32_TOLERANCE = 1e-3
# bf16 keeps 8 significant bits: one rounding is 2^-8 = 0.4% of a value. The paths round differently
# (fp32 or bf16 residuals, fused or unfused norms), so their initial losses (~ln V) may differ by a
# rounding of the logits, each token's by up to 2^-8 |z|, averaged over b s tokens; 2^-8 of the loss
# itself bounds that. It does not tell networks apart (any initialization gives ~ln V): FP32_TOLERANCE does.
BF16_LOSS_TOLERANCE = 2.0 ** -8


def model_config(shape: Shape, layers: int | None = None, dtype: str = "bfloat16") -> ModelConfig:
    return ModelConfig.llama(hidden_size=shape.hidden, num_layers=layers or shape.layers,
                             num_attention_heads=shape.heads, num_query_groups=shape.groups,
                             ffn_hidden_size=shape.ffn, vocab_size=shape.vocab, max_position_embeddings=shape.seq,
                             params_dtype=dtype).validate()


def train_config(shape: Shape, device: str, kernels: str = "torch", adam_impl: str = "default",
                 bf16: bool = True, seq: int | None = None, batch: int | None = None) -> TrainConfig:
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
        if shape.recompute else {}
    return TrainConfig(seq_length=seq or shape.seq, micro_batch_size=batch or shape.batch, train_iters=1000,
                       lr=LR, min_lr=LR, lr_warmup_iters=0, clip_grad=1.0, bf16=bf16, kernels=kernels,
                       adam_impl=adam_impl, device=device, progress=False, **recompute)


# ---------------------------------------------------------------------------------------
# the plain-PyTorch reference
# ---------------------------------------------------------------------------------------
class PlainBlock(nn.Module):
    """A LLaMA block the usual way: x + attn(rmsnorm(x)), then x + mlp(rmsnorm(x)). [b, s, h] -> [b, s, h].
    qkv: one Linear, rows [q (a d) | k (g d) | v (g d)]; gate_up: one Linear, rows [gate (f) | up (f)].
    recompute: the block under torch.utils.checkpoint (non-reentrant) while training, inside forward,
    so that torch.compile of the block traces the checkpoint too."""

    def __init__(self, cfg: ModelConfig, recompute: bool = False):
        super().__init__()
        h, a, g, d, f = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.kv_channels, cfg.ffn_size
        self.a, self.g, self.d, self.f, self.recompute = a, g, d, f, recompute
        self.attn_norm = nn.RMSNorm(h, eps=cfg.layernorm_epsilon)
        self.qkv = nn.Linear(h, (a + 2 * g) * d, bias=False)
        self.out = nn.Linear(a * d, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=cfg.layernorm_epsilon)
        self.gate_up = nn.Linear(h, 2 * f, bias=False)
        self.down = nn.Linear(f, h, bias=False)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE, channel j paired with j + d/2: x [b, n, s, d], cos and sin [s, d]."""
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-second, first], dim=-1) * sin

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self.layer, x, cos, sin, use_reentrant=False)
        return self.layer(x, cos, sin)

    def layer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        a, g, d = self.a, self.g, self.d
        q, k, v = self.qkv(self.attn_norm(x)).split([a * d, g * d, g * d], dim=-1)
        q = q.view(b, s, a, d).transpose(1, 2)                                      # [b, a, s, d]
        k = k.view(b, s, g, d).transpose(1, 2)                                      # [b, g, s, d]
        v = v.view(b, s, g, d).transpose(1, 2)                                      # [b, g, s, d]
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=g != a)   # [b, a, s, d]
        x = x + self.out(y.transpose(1, 2).reshape(b, s, a * d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)                  # [b, s, f] each
        return x + self.down(F.silu(gate) * up)


class PlainLlama(nn.Module):
    """The book's LLaMA (ModelConfig.llama) in plain PyTorch: tokens [b, s] -> final hidden states
    [b, s, h]; `token_losses(tokens, labels)` the per-token cross-entropy [b, s] in float32 (through
    `head_losses`). `recompute`: each block under torch.utils.checkpoint."""

    def __init__(self, cfg: ModelConfig, recompute: bool = False):
        super().__init__()
        h, d = cfg.hidden_size, cfg.kv_channels
        self.embed = nn.Embedding(cfg.vocab_size, h)
        self.blocks = nn.ModuleList(PlainBlock(cfg, recompute) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(h, eps=cfg.layernorm_epsilon)
        self.head = nn.Linear(h, cfg.vocab_size, bias=False)
        angles = torch.arange(cfg.max_position_embeddings, dtype=torch.float64)[:, None] \
            * cfg.rotary_base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)          # [s, d/2]
        angles = torch.cat([angles, angles], dim=-1)                                        # [s, d]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x, cos, sin = self.embed(tokens), self.cos[:s], self.sin[:s]
        for block in self.blocks:
            x = block(x, cos, sin)                                                          # [b, s, h]
        return x

    def head_losses(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last block's output [b, s, h] -> per-token losses [b, s]: final norm, logits, cross-entropy."""
        logits = self.head(self.norm(x))                                                    # [b, s, V]
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)

    def token_losses(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.head_losses(self(tokens), labels)


@torch.no_grad()
def load_book_weights(ref: PlainLlama, book: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Copy the book's parameters (GPTModel names) into the reference. The book's linear_qkv rows
    go group by group, [q of a/g heads | k | v] per group (model/attention.py); the reference
    wants all q, then all k, then all v. Query head i of group i // (a/g) stays head i."""
    a, g, d, h = cfg.num_attention_heads, cfg.query_groups, cfg.kv_channels, cfg.hidden_size
    per_group = a // g
    for i, block in enumerate(ref.blocks):
        pre = f"decoder.layers.{i}."
        qkv = book[pre + "self_attention.linear_qkv.weight"].view(g, per_group + 2, d, h)
        block.qkv.weight.copy_(torch.cat([qkv[:, :per_group].reshape(a * d, h), qkv[:, per_group].reshape(g * d, h),
                                          qkv[:, per_group + 1].reshape(g * d, h)]))
        block.out.weight.copy_(book[pre + "self_attention.linear_proj.weight"])
        block.attn_norm.weight.copy_(book[pre + "input_layernorm.weight"])
        block.mlp_norm.weight.copy_(book[pre + "pre_mlp_layernorm.weight"])
        block.gate_up.weight.copy_(book[pre + "mlp.linear_fc1.weight"])          # [gate; up], as the book's
        block.down.weight.copy_(book[pre + "mlp.linear_fc2.weight"])
    ref.embed.weight.copy_(book["embedding.word_embeddings.weight"])
    ref.norm.weight.copy_(book["decoder.final_layernorm.weight"])
    ref.head.weight.copy_(book["output_layer.weight"])


def as_book_tensors(ref: PlainLlama, cfg: ModelConfig, grads: bool = False) -> dict[str, torch.Tensor]:
    """The reference's parameters (or their gradients) under the book's names and layouts: the
    inverse of load_book_weights."""
    a, g, d, h = cfg.num_attention_heads, cfg.query_groups, cfg.kv_channels, cfg.hidden_size
    get = (lambda p: p.grad) if grads else (lambda p: p.detach())                 # noqa: E731
    out = {"embedding.word_embeddings.weight": get(ref.embed.weight),
           "decoder.final_layernorm.weight": get(ref.norm.weight), "output_layer.weight": get(ref.head.weight)}
    for i, block in enumerate(ref.blocks):
        pre = f"decoder.layers.{i}."
        q, k, v = get(block.qkv.weight).split([a * d, g * d, g * d])
        out[pre + "self_attention.linear_qkv.weight"] = torch.cat(
            [q.reshape(g, a // g, d, h), k.reshape(g, 1, d, h), v.reshape(g, 1, d, h)], dim=1).reshape(-1, h)
        out |= {pre + "self_attention.linear_proj.weight": get(block.out.weight),
                pre + "input_layernorm.weight": get(block.attn_norm.weight),
                pre + "pre_mlp_layernorm.weight": get(block.mlp_norm.weight),
                pre + "mlp.linear_fc1.weight": get(block.gate_up.weight),
                pre + "mlp.linear_fc2.weight": get(block.down.weight)}
    return out


def reference_optimizer(ref: nn.Module, cfg: TrainConfig, fused: bool) -> torch.optim.AdamW:
    """AdamW as the book sets it (optim.Optimizer): weight decay on the matrices only."""
    params = [p for p in ref.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             fused=fused)


def reference_step(ref: PlainLlama, optimizer: torch.optim.Optimizer, batch: dict, clip: float,
                   autocast: torch.dtype | None, on_grads=None):
    """One training step of the reference; returns the loss (a 0-dim tensor: no host sync).
    on_grads(), if given, runs between the backward and the clipping (as train.before_optimizer_step's)."""
    device_type = batch["tokens"].device.type
    with torch.autocast(device_type, dtype=autocast) if autocast else torch.autocast(device_type, enabled=False):
        loss = ref.token_losses(batch["tokens"], batch["labels"]).mean()
    loss.backward()
    if on_grads is not None:
        on_grads()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), clip, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def compile_reference(ref: PlainLlama, backend: str = "inductor") -> None:
    """torch.compile each block (its checkpoint included) and the head with the loss: regional
    compilation, one graph for every block of a shape, compiled once. backend "aot_eager" (--smoke):
    the same graphs captured (Dynamo, AOTAutograd), run without Inductor's code generation."""
    compile_cache_for_this_capability()
    for block in ref.blocks:
        block.compile(backend=backend)
    ref.head_losses = torch.compile(ref.head_losses, backend=backend)


# ---------------------------------------------------------------------------------------
# is the reference the same network?
# ---------------------------------------------------------------------------------------
@dataclass
class Check:
    parameters: tuple[int, int]          # book, reference
    decayed: tuple[int, int]             # elements AdamW decays, book and reference
    token_loss_diff: float               # max |per-token initial loss, book - reference|
    grad_diff: float                     # max over the tensors of max |grad, book - ref| / max |grad, book|, step 0
    step_loss_diff: float                # max over the steps of |mean loss, book - reference|
    steps: int
    tolerance: float = FP32_TOLERANCE

    @property
    def same(self) -> bool:
        return (self.parameters[0] == self.parameters[1] and self.decayed[0] == self.decayed[1]
                and max(self.token_loss_diff, self.grad_diff, self.step_loss_diff) <= self.tolerance)

    def __str__(self) -> str:
        return (f"parameters {self.parameters[0]:,} and {self.parameters[1]:,}, decayed {self.decayed[0]:,} and "
                f"{self.decayed[1]:,}; per-token initial loss max |book - reference| = {self.token_loss_diff:.1e}; "
                f"gradients max |book - reference| / max |book| = {self.grad_diff:.1e}; mean loss over {self.steps} "
                f"steps max |book - reference| = {self.step_loss_diff:.1e} (tolerance {self.tolerance:.0e}): "
                f"{'SAME' if self.same else 'DIFFERENT'}")


def check_same_network(shape: Shape, device: str, reference_class=PlainLlama, steps: int = 3,
                       seq: int = 256, batch: int = 2) -> Check:
    """The book's model and `reference_class`, float32, `shape`'s widths with 2 layers, the book's
    initial weights copied in: parameter counts, the elements AdamW decays, per-token losses at
    initialization, every gradient of the first step, and the losses of `steps` training steps
    (the book's train_step; the reference's step with AdamW, not fused, not compiled)."""
    cfg = model_config(shape, layers=min(2, shape.layers), dtype="float32")
    seq = min(seq, shape.seq)
    tcfg = train_config(shape, device, bf16=False, seq=seq, batch=batch)
    validate_layout(cfg, tcfg, 1)
    chunks = build_model(cfg, tcfg, Layout())
    optimizer = build_optimizer(chunks, tcfg, Layout())
    book = unwrap(chunks[0])                     # (bf16 would wrap it: its float32 gradient buffer)
    ref = reference_class(cfg, recompute=shape.recompute).to(device)
    load_book_weights(ref, {n: p.detach() for n, p in book.named_parameters()}, cfg)
    ref_opt = reference_optimizer(ref, tcfg, fused=False)
    data = [{k: v.to(device) for k, v in b.items()} for b in make_batches(cfg, steps, batch, seq, seed=1)]
    with torch.no_grad():
        ours = book(data[0]["tokens"], labels=data[0]["labels"])                         # [b, s]
        theirs = ref.token_losses(data[0]["tokens"], data[0]["labels"])                  # [b, s]
    token_diff = (ours.double() - theirs.double()).abs().max().item()
    ours_grads, theirs_grads = {}, {}                  # the first step's, before clipping, by the book's names

    def keep_ours():
        ours_grads.update({n: p.grad.clone() for n, p in book.named_parameters()})

    def keep_theirs():
        theirs_grads.update({n: t.clone() for n, t in as_book_tensors(ref, cfg, grads=True).items()})
    step_diff = 0.0
    for i, b in enumerate(data):
        with before_optimizer_step(optimizer, keep_ours if i == 0 else lambda: None):
            ours_loss = train_step(chunks, optimizer, [b], Layout(), tcfg.lr)[0]
        theirs_loss = reference_step(ref, ref_opt, b, tcfg.clip_grad, autocast=None,
                                     on_grads=keep_theirs if i == 0 else None).item()
        step_diff = max(step_diff, abs(ours_loss - theirs_loss))
    grad_diff = max(((ours_grads[n] - theirs_grads[n]).abs().max() / ours_grads[n].abs().max().clamp_min(1e-30)).item()
                    if n in theirs_grads and theirs_grads[n].shape == ours_grads[n].shape else math.inf
                    for n in ours_grads)
    counts = (sum(p.numel() for p in book.parameters()), sum(p.numel() for p in ref.parameters()))
    decayed = (sum(seg.param.numel() for seg in optimizer.segments if seg.decay),
               sum(p.numel() for group in ref_opt.param_groups if group["weight_decay"] > 0 for p in group["params"]))
    return Check(counts, decayed, token_diff, grad_diff, step_diff, steps)


# ---------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------
@dataclass
class Result:
    shape: str
    path: str
    status: str = "ok"                   # ok | SKIP | OOM | FAIL
    why: str = ""
    step_s: float = math.nan             # median timed step
    first_s: float = math.nan            # the first (untimed) step: compiling included
    losses: list[float] = field(default_factory=list)
    peak_gib: float = math.nan


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_steps(step, shape: Shape, device: str, result: Result, profile_to: Path | None) -> None:
    """shape.warmup untimed steps, then shape.steps timed ones, each between two synchronizations;
    the median into result. With profile_to: 3 more steps under torch.profiler, written there."""
    times = []
    for _ in range(shape.warmup + shape.steps):
        synchronize(device)
        start = time.perf_counter()
        loss = step()
        synchronize(device)
        times.append(time.perf_counter() - start)
        result.losses.append(float(loss))
    result.first_s, result.step_s = times[0], statistics.median(times[shape.warmup:])
    if not all(math.isfinite(x) for x in result.losses):
        result.status, result.why = "FAIL", f"a loss is not finite: {result.losses}"
    if device.startswith("cuda"):
        result.peak_gib = torch.cuda.max_memory_allocated() / 2 ** 30
    if profile_to is not None:
        profile_steps(step, device, profile_to, result.step_s)


def book_run(shape: Shape, path: str, device: str, snapshot: dict, profile_to: Path | None) -> Result:
    """The book's step on `path`; on the first book run of a shape, its initial weights into `snapshot`."""
    kernels, adam_impl = PATHS[path]
    result = Result(shape.name, path)
    cfg, tcfg = model_config(shape), train_config(shape, device, kernels, adam_impl)
    try:
        validate_layout(cfg, tcfg, 1)            # build_model trusts its caller to have checked
        chunks = build_model(cfg, tcfg, Layout())
    except ConfigError as exc:                   # a combination the book refuses, by name
        result.status, result.why = "SKIP", f"the book refuses it: {exc}"
        return result
    optimizer = build_optimizer(chunks, tcfg, Layout())
    if not snapshot:
        snapshot.update({n: p.detach().to("cpu", copy=True) for n, p in unwrap(chunks[0]).named_parameters()})
    batch = {k: v.to(device) for k, v in make_batches(cfg, 1, shape.batch, shape.seq)[0].items()}
    time_steps(lambda: train_step(chunks, optimizer, [batch], Layout(), tcfg.lr)[0], shape, device, result,
               profile_to)
    return result


def reference_run(shape: Shape, device: str, snapshot: dict, profile_to: Path | None, backend: str) -> Result:
    result = Result(shape.name, "reference")
    cfg, tcfg = model_config(shape), train_config(shape, device)
    if not snapshot:                             # no book path ran: the book's initial weights from a fresh model
        from minimegatron.model import GPTModel
        snapshot.update({n: p.detach() for n, p in GPTModel(cfg).named_parameters()})
    with torch.device(device):
        ref = PlainLlama(dataclasses.replace(cfg, params_dtype="float32"), recompute=shape.recompute)
    load_book_weights(ref, snapshot, cfg)
    compile_reference(ref, backend)
    optimizer = reference_optimizer(ref, tcfg, fused=True)
    batch = {k: v.to(device) for k, v in make_batches(cfg, 1, shape.batch, shape.seq)[0].items()}
    time_steps(lambda: reference_step(ref, optimizer, batch, tcfg.clip_grad, torch.bfloat16), shape, device,
               result, profile_to)
    return result


def run(shape: Shape, path: str, device: str, snapshot: dict, profile_to: Path | None,
        backend: str = "inductor") -> Result:
    """One (shape, path): its Result; out of memory and errors become a row, not the end of the run."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    try:
        if path == "reference":
            return reference_run(shape, device, snapshot, profile_to, backend)
        if path.startswith("triton") and device == "cpu":
            from minimegatron.kernels import available
            why = available()
            if why is not None:
                return Result(shape.name, path, "SKIP", why)
            # Triton's interpreter (kernels/__init__.py): seconds a step even at a tiny shape; one step shows it runs
            shape = dataclasses.replace(shape, warmup=0, steps=1)
        return book_run(shape, path, device, snapshot, profile_to)
    except torch.OutOfMemoryError as exc:
        return Result(shape.name, path, "OOM", str(exc).splitlines()[0][:160])
    except Exception as exc:                     # noqa: BLE001 - the next run still runs; the exit status says it
        import traceback
        traceback.print_exc()
        return Result(shape.name, path, "FAIL", f"{type(exc).__name__}: {str(exc).strip()[:200]}")
    finally:
        gc.collect()
        torch._dynamo.reset()                    # each path compiles afresh (and frees the compiled graphs)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------
# --profile: where one path's step time goes
# ---------------------------------------------------------------------------------------
CATEGORIES = [   # (category, substrings of an operator or kernel name), the first match wins
    ("attention", ("flash", "attention", "fmha", "sdpa")),
    ("matmul", ("gemm", "aten::mm", "aten::addmm", "aten::bmm", "matmul", "cutlass", "xmma", "nvjet", "cublas",
                "aten::linear", "triton_tem")),
    ("optimizer / foreach", ("adam", "multi_tensor", "foreach")),
    ("compiled (Inductor)", ("triton_poi", "triton_red", "triton_per")),
    ("activation (SwiGLU)", ("swiglu", "silu")),
    ("norms (RMSNorm, gradient norm)", ("norm", "rsqrt")),
    ("loss", ("softmax", "cross_entropy", "nll")),
    ("copy / cast", ("copy", "aten::to", "cast", "aten::cat", "clone")),
]                # the rest: "other" (eager elementwise kernels and reductions)


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def profile_steps(step, device: str, out: Path, step_s: float, steps: int = 3) -> None:
    """`steps` steps under torch.profiler: the operator table (sorted by GPU time on a GPU, CPU
    self time on the CPU) and a breakdown by CATEGORIES, printed and written to out (.txt), the
    Chrome trace beside it (.json). On the CPU the breakdown counts aten operators only (AdamW's
    foreach ops land in "other"). On a GPU the breakdown also says how busy the GPU was: a
    step whose kernels add up to much less than its wall time is waiting for the CPU to launch them."""
    from torch.profiler import ProfilerActivity, profile
    gpu = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    synchronize(device)
    with profile(activities=activities, record_shapes=False) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    averages = prof.key_averages()
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    table = averages.table(sort_by=key, row_limit=30)
    totals: dict[str, float] = {}
    for evt in averages:
        is_kernel = gpu and getattr(evt, "device_type", None) is not None and "CUDA" in str(evt.device_type)
        if gpu and not is_kernel:
            continue
        if not gpu and not evt.key.startswith("aten::"):
            continue
        totals[category(evt.key)] = totals.get(category(evt.key), 0.0) + getattr(evt, key) / 1e6   # s
    busy = sum(totals.values())
    lines = [f"profile of {steps} steps ({'GPU kernel' if gpu else 'CPU operator self'} time, s, by category; "
             f"timed step {step_s * 1e3:.1f} ms):"]
    for cat, sec in sorted(totals.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {cat:<31} {sec:8.4f} s  {sec / busy:6.1%}" if busy else f"  {cat:<31} {sec:8.4f} s")
    if gpu:
        lines.append(f"  the GPU was busy {busy / (steps * step_s):.0%} of the timed step time "
                     f"(the rest: waiting for the CPU to launch)")
    text = "\n".join(lines) + "\n\n" + table
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".txt.tmp")
    tmp.write_text(text + "\n")
    tmp.replace(out)
    prof.export_chrome_trace(str(out.with_suffix(".json")))
    print(text)
    print(f"profile written: {out} (table), {out.with_suffix('.json')} (Chrome trace: ui.perfetto.dev)")


# ---------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------
def describe_device(device: str) -> tuple[str, float | None]:
    """(a line naming the device and the software, its dense bf16 peak in TFLOP/s or None)."""
    try:
        import triton
        triton_text = f"triton {triton.__version__}"
    except ImportError:
        triton_text = "no triton"
    software = f"torch {torch.__version__}, {triton_text}, python {platform.python_version()}"
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name()
        props = torch.cuda.get_device_properties(0)
        peak = next((bf16 for key, bf16, _ in PEAK_TFLOPS if key.lower() in name.lower()), None)
        return (f"{name} ({props.total_memory / 2 ** 30:.1f} GiB, capability {props.major}.{props.minor}), "
                f"CUDA {torch.version.cuda}, {software}"), peak
    return (f"cpu: {cpu_model()}, {torch.get_num_threads()} threads, load {load_average()}, {software}"), None


def fmt(x: float, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(results: list[Result], shapes: dict[str, Shape], peak: float | None) -> list[str]:
    lines = ["| shape | path | status | ms/step | tokens/s | model TFLOP/s | MFU | vs reference | first step s "
             "| peak GiB | loss step 0 | loss last |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ref_time = {r.shape: r.step_s for r in results if r.path == "reference" and r.status == "ok"}
    notes = []
    for r in results:
        shape = shapes[r.shape]
        flops = training_flops(model_config(shape), shape.batch, shape.seq)["total"]
        ok = r.status == "ok"
        tflops = flops / r.step_s / 1e12 if ok else math.nan
        mfu = f"{tflops / peak:.1%}" if ok and peak else "-"
        vs = f"{ref_time[r.shape] / r.step_s:.2f}x" if ok and r.shape in ref_time else "-"
        status = r.status if ok else f"{r.status} [{len(notes) + 1}]"
        if not ok:
            notes.append(f"[{len(notes) + 1}] {r.shape} {r.path}: {r.why}")
        lines.append(f"| {r.shape} | {r.path} | {status} | {fmt(r.step_s * 1e3, '.1f')} "
                     f"| {fmt(shape.batch * shape.seq / r.step_s, ',.0f')} | {fmt(tflops, '.3g')} | {mfu} | {vs} "
                     f"| {fmt(r.first_s, '.1f')} | {fmt(r.peak_gib, '.1f')} "
                     f"| {fmt(r.losses[0] if r.losses else math.nan, '.4f')} "
                     f"| {fmt(r.losses[-1] if r.losses else math.nan, '.4f')} |")
    return lines + notes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="default: all, 1b first")
    p.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS), help="default: all")
    p.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (default: from its name)")
    p.add_argument("--warmup", type=int, help="untimed steps per run (default: the shape's, 2-3)")
    p.add_argument("--steps", type=int, help="timed steps per run (default: the shape's, 5-10)")
    p.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds after which no run starts "
                                                                   f"(default {BUDGET_S})")
    p.add_argument("--profile", choices=list(PATHS), help="also profile this path (3 steps, each shape run)")
    p.add_argument("--profile-dir", default="runs/bench_mfu", help="where --profile writes (default runs/bench_mfu)")
    p.add_argument("--device", choices=["cuda", "cpu"], help="cuda (default) or cpu (--smoke's default)")
    p.add_argument("--reference-backend", choices=["inductor", "aot_eager"],
                   help="torch.compile's backend for the reference (default inductor; --smoke: aot_eager, the "
                        "graphs without Inductor's C++ build, a minute of a loaded 2-core CPU)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks that every path runs")
    args = p.parse_args(argv)
    for name, value, low in (("--warmup", args.warmup, 0), ("--steps", args.steps, 1)):
        if value is not None and value < low:
            p.error(f"{name} {value}: must be at least {low}")
    for name, value in (("--peak-tflops", args.peak_tflops), ("--budget", args.budget)):
        if value is not None and not (math.isfinite(value) and value > 0):
            p.error(f"{name} {value}: must be a positive number")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device or ("cpu" if args.smoke else "cuda")
    backend = args.reference_backend or ("aot_eager" if args.smoke else "inductor")
    if device.startswith("cuda"):
        why = no_gpu_reason()
        if why is not None:
            print(f"bench_mfu.py times the training step on an NVIDIA GPU, and {why}. `--smoke` runs its code on "
                  f"tiny shapes on the CPU. Nothing was timed.")
            return 2
    shapes = dict(SMOKE_SHAPES) if args.smoke else {name: SHAPES[name] for name in args.shapes}
    if args.warmup is not None or args.steps is not None:
        shapes = {n: dataclasses.replace(s, warmup=args.warmup if args.warmup is not None else s.warmup,
                                         steps=args.steps if args.steps is not None else s.steps)
                  for n, s in shapes.items()}
    paths = list(dict.fromkeys(args.paths + ([args.profile] if args.profile else [])))
    device_line, peak = describe_device(device)
    peak = args.peak_tflops or peak
    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    print(f"command: {cmd}")
    print(f"device: {device_line}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"peak: {f'{peak:g} TFLOP/s dense bf16' if peak else 'none known for this device: no MFU (--peak-tflops)'}"
          "; FLOPs per step: analysis.training_flops (every matmul forward and backward, all s^2 attention "
          f"scores, no recompute, no optimizer); the reference compiled with {backend}")
    torch.manual_seed(0)
    start, results, checks_ok = time.monotonic(), [], True
    for shape in shapes.values():
        cfg = model_config(shape)
        print(f"\n== {shape.name}: LLaMA h {cfg.hidden_size}, L {cfg.num_layers}, a {cfg.num_attention_heads}, "
              f"g {cfg.query_groups}, d {cfg.kv_channels}, f {cfg.ffn_size}, V {cfg.vocab_size}; s {shape.seq}, "
              f"b {shape.batch}; bf16, {'full recompute' if shape.recompute else 'no recompute'} ({shape.what}); "
              f"{training_flops(cfg, shape.batch, shape.seq)['total']:.3e} FLOPs per step; "
              f"{shape.warmup} warm-up + {shape.steps} timed steps", flush=True)
        if "reference" in paths:
            check = check_same_network(shape, device)
            checks_ok &= check.same
            print(f"   same network? float32, {min(2, shape.layers)} layers, the book's initial weights in both: "
                  f"{check}", flush=True)
        snapshot: dict = {}
        shape_results = []
        for path in [p for p in paths if shape.paths is None or p in shape.paths]:
            left = args.budget - (time.monotonic() - start)
            if left <= 0:
                result = Result(shape.name, path, "SKIP", f"out of time: the {args.budget:g} s budget is spent")
            else:
                profile_to = (Path(args.profile_dir) / f"profile_{shape.name}_{path}.txt"
                              if path == args.profile else None)
                result = run(shape, path, device, snapshot, profile_to, backend)
            shape_results.append(result)
            print(f"   {path:<14} {result.status:<4} "
                  + (f"{result.step_s * 1e3:9.1f} ms/step, first step {result.first_s:.1f} s, losses "
                     f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}" if result.status == "ok" else result.why),
                  flush=True)
        firsts = {r.path: r.losses[0] for r in shape_results if r.status == "ok"}
        if len(firsts) > 1:
            base = firsts.get("eager", next(iter(firsts.values())))
            diff = max(abs(x - base) for x in firsts.values())
            agree = diff <= BF16_LOSS_TOLERANCE * abs(base)
            checks_ok &= agree
            print(f"   initial losses (step 0, bf16) of {len(firsts)} paths: max |path - eager| = {diff:.1e} "
                  f"(tolerance 2^-8 x {abs(base):.2f} = {BF16_LOSS_TOLERANCE * abs(base):.1e}): "
                  f"{'AGREE' if agree else 'DISAGREE'}")
        results += shape_results
    print(f"\n{'=' * 10} {device_line}; {time.monotonic() - start:.0f} s")
    print(f"command: {cmd}")
    for line in table(results, shapes, peak):
        print(line)
    failed = [r for r in results if r.status == "FAIL"]
    print(f"bench_mfu: {sum(r.status == 'ok' for r in results)} ran, "
          f"{sum(r.status in ('SKIP', 'OOM') for r in results)} skipped, {len(failed)} failed; checks "
          f"{'agree' if checks_ok else 'DISAGREE'}")
    return 0 if checks_ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
