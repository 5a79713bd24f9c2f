"""FP8 GEMMs for the one model: `apply_fp8` gives each transformer layer's linear layer its own
`Fp8Gemm` at the GEMM seam of model/linear.py (chapter 06).

    model = apply_fp8(model, Fp8Recipe(scaling="current"), amax_group=layout.tp_cp_group)

A linear layer's three products, each with its two operands in FP8 and the sum in float32:

    fprop   y  = x W^T       x: role "input" (e4m3)        W: role "weight" (e4m3)
    dgrad   dx = dy W        dy: role "grad_output" (e5m2 under "hybrid")
    wgrad   dW = dy^T x      both summed over the tokens

Each operand is quantized along the dimension its GEMM sums over (fp8/quantize.py): x along
its features for fprop and along its tokens for wgrad, W along its inputs for fprop and its
outputs for dgrad. That matters only for the blocked recipes (blockwise, mxfp8); one scale per
tensor does not care. The product is emulated: dequantize both and multiply in float32 (on this
CPU bit for bit torch._scaled_mm's tensorwise result), then round to the layer's dtype.

One scale per tensor (current, delayed) needs the amax of the WHOLE tensor, which under tensor
or context parallelism no rank holds: a weight's shard, a row-parallel input's features, an
output gradient's columns, a context-parallel rank's tokens. Each cast therefore all-reduces
its amax (max, one float, tag "fp8-amax") over `amax_group`: the tp x cp ranks, so every shard
casts with the scale one device would use for the same micro-batch. That is the book's choice,
for both recipes; Transformer Engine differs per recipe:

  delayed  every role's amax over the group Megatron passes to fp8_autocast: tp x dp x cp
           (parallel_state.get_amax_reduction_group(with_context_parallel=True), fp8_utils.py;
           TE's DelayedScaling.reduce_amax), or tp x cp with TransformerConfig.tp_only_amax_red
           (a config field, no command-line flag). Data-parallel replicas then share one scale
           for the global batch, which one device running the micro-batches in turn would not.
  current  only a column-parallel layer's sequence-parallel input and a row-parallel layer's
           sequence-parallel output gradient, over tp (TE's linear.py,
           set_quantizer_amax_reduction_group); weight shards and cp ranks keep their own amax,
           so a TE run under tp is not one device's.

The blocked recipes need no reduction (each block has its own scale), so they equal one
device under every layout.

Which layers: the transformer layers' linear_qkv, linear_proj, linear_fc1, linear_fc2 (the
experts' and the shared expert's too). The embedding, the output layer and the router stay in
the model's dtype, as in Megatron by default (its output layer is a plain ColumnParallelLinear
unless fp8_output_proj, with the mxfp8 recipe only, makes it a Transformer Engine layer; TE's
grouped experts take FP8). The experts' grouped form (one batched product) is refused: its
stacked weights would share one scale.

With one scale per tensor the backward re-casts the forward's input and weight with the scales
that forward used (no second amax): each forward with autograd on (`backward_follows`, noted
by a pre-hook of its layer) queues its two scales (`forward_scales`), and the backwards, which
run in the forwards' order in every schedule of the book (one micro-batch after another per
model chunk), take them in turn; the weight gradient reuses the output gradient's scale of the
input gradient. So each role costs one amax reduction per micro-batch: 3 per layer.
Transformer Engine keeps the forward's FP8 copies instead; the numbers are the same.

Megatron-LM / Transformer Engine: megatron/core/extensions/transformer_engine.py (TELinear,
TEColumnParallelLinear, TERowParallelLinear, TEGroupedLinear), megatron/core/fp8_utils.py
(get_fp8_context, the recipe from --fp8-recipe), and TE's quantizers
(transformer_engine/pytorch/tensor/: Float8Quantizer, Float8CurrentScalingQuantizer,
Float8BlockQuantizer, MXFP8Quantizer).
"""

from __future__ import annotations

from collections import deque

import torch
from torch import nn

from .. import comm
from ..comm import all_gather
from ..model.linear import Gemm
from .quantize import Quantized, cast_to_fp8, quantize_blockwise, quantize_mxfp8, quantize_tensorwise
from .scaling import DelayedScaling, Fp8Recipe, ROLES

__all__ = ["Fp8Gemm", "apply_fp8", "tensor_amax", "FP8_LAYERS"]

FP8_LAYERS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def tensor_amax(x: torch.Tensor, group, tag: str = "fp8-amax") -> torch.Tensor:
    """The amax (largest |element|) of the whole tensor this rank's `x` is a part of: a [] float32
    tensor, the same on every rank of `group` (the ranks that hold the other parts: a weight's
    shards, a row-parallel input's features, a context-parallel rank's tokens; a replicated
    tensor's copies agree anyway). One all-reduce of one float, tagged `tag`; nothing for a
    group of one rank. Autograd does not see it (the amax only chooses a scale)."""
    # BEGIN EXERCISE 6.4: spot the bug in the FP8 amax | hint: a scale chosen from this rank's part alone is not the scale one device would choose for the whole tensor; which collective makes every part agree, and with which reduction?
    amax = x.detach().abs().max().to(torch.float32).reshape(1)
    comm.all_reduce(amax, group, op="max", tag=tag)
    return amax[0]
    # END EXERCISE


class Fp8Gemm(Gemm):
    """The three products of one linear layer in FP8 (the module docstring), with the layer's
    scaling state: `delayed[role]` (recipe "delayed"), and for both one-scale recipes the
    scales of the forwards whose backward has not run (`forward_scales`) and of the output
    gradient the last dgrad cast (`grad_scale`, which its wgrad reuses). `stats`, when a dict,
    collects per role (relative error, non-zero elements that underflow to 0, elements that
    saturate) over every scale-setting cast (the chapter's quantisation table)."""

    def __init__(self, recipe: Fp8Recipe, amax_group=None, amax_tag: str = "fp8-amax"):
        self.recipe, self.amax_group, self.amax_tag = recipe, amax_group, amax_tag
        self.one_scale = recipe.scaling in ("current", "delayed")
        self.delayed = ({role: DelayedScaling(recipe, recipe.format_of(role)) for role in ROLES}
                        if recipe.scaling == "delayed" else None)
        self.stats: dict | None = None
        self.forward_scales: deque = deque()      # (input, weight) scales of forwards awaiting their backward
        self.grad_scale: torch.Tensor | None = None
        self.backward_follows = True              # set before each forward of its layer (apply_fp8's hook)
        self.gathered: tuple | None = None        # (input, its scale, the model's dtype) gather_input made
        self.recompute: str | None = None         # chapter 07's phase (Gemm.set_recompute)

    def set_recompute(self, phase: str | None) -> None:
        """Under activation recompute a forward runs twice: "checkpointed" (no autograd, but a
        backward follows: its scales are queued) and "recomputing" (the same forward in the
        backward: it casts with the scales queued for it, takes no amax and records no history),
        so the backward sees the numbers a run without recompute would (Transformer Engine keeps
        the first forward's FP8 metadata for its recompute the same way)."""
        self.recompute = phase

    def _replayed_scales(self) -> tuple | None:
        """(input scale, weight scale) of the forward being recomputed, or None."""
        return self.forward_scales[0] if self.one_scale and self.recompute == "recomputing" else None

    def cast(self, x: torch.Tensor, role: str, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x [.., K] in FP8 along its last dimension K, dequantized; the scale(s) used). The
        dequantized values are float32 (the GEMM's accumulation), float64 for a float64 model
        (the book's exact checks). One-scale recipes: with `scale` (one this layer set before
        for the same tensor) no amax is taken; without, the amax is all-reduced over
        amax_group (tag "fp8-amax") and sets the scale (current) or is recorded (delayed)."""
        fmt, scaling = self.recipe.format_of(role), self.recipe.scaling
        if scaling == "blockwise":
            q = quantize_blockwise(x, fmt, two_d=role == "weight" and x.dim() == 2)
        elif scaling == "mxfp8":
            q = quantize_mxfp8(x, fmt)
        elif scale is not None:
            q = Quantized(cast_to_fp8(x, scale, fmt), scale)
        else:
            amax = tensor_amax(x, self.amax_group, self.amax_tag)
            q = quantize_tensorwise(x, fmt, amax) if scaling == "current" else self.delayed[role].cast(x, amax)
        out = q.dequantize(torch.float64 if x.dtype == torch.float64 else torch.float32)
        if self.stats is not None and scale is None:
            _collect(self.stats, role, x, out, q)
        return out, q.scale

    def gather_input(self, x: torch.Tensor, group, dim: int, tag: str) -> torch.Tensor:
        """The sequence-parallel all-gather in FP8 (one-scale recipes; the blocked ones gather in
        the model's dtype): cast this rank's tokens with the scale of the whole input (its amax
        reduced over amax_group, which holds the tp group), all-gather their FP8 bytes (a uint8
        view: gloo has no FP8 type; the ledger records 1 byte an element), and hand fprop the
        dequantized result, which it does not cast again. The backward's regather of the
        input (tag "regather", chapter 04's exercise 4.3) stays in the model's dtype; cast
        with the forward's scale it gives the same FP8 values."""
        if not self.one_scale:
            return super().gather_input(x, group, dim, tag)
        fmt, replayed = self.recipe.format_of("input"), self._replayed_scales()
        if replayed is not None:
            q = Quantized(cast_to_fp8(x, replayed[0], fmt), replayed[0])
        else:
            amax = tensor_amax(x, self.amax_group, self.amax_tag)
            q = (quantize_tensorwise(x, fmt, amax) if self.recipe.scaling == "current"
                 else self.delayed["input"].cast(x, amax))
        data = all_gather(q.data.view(torch.uint8), group, dim=dim, tag=tag).view(q.data.dtype)   # [b, s, in]
        total = Quantized(data, q.scale).dequantize(torch.float64 if x.dtype == torch.float64 else torch.float32)
        if self.stats is not None and replayed is None:
            _collect(self.stats, "input", x, Quantized(q.data, q.scale).dequantize(), q)
        self.gathered = (total, q.scale, x.dtype)
        return total

    def fprop(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        replayed = self._replayed_scales() or (None, None)
        if self.gathered is not None and x is self.gathered[0]:       # gathered in FP8 already
            x_q, x_scale, dtype = self.gathered
        else:
            (x_q, x_scale), dtype = self.cast(x, "input", replayed[0]), x.dtype
        self.gathered = None
        w_q, w_scale = self.cast(w, "weight", replayed[1])
        if self.one_scale and (self.backward_follows or self.recompute == "checkpointed") \
                and self.recompute != "recomputing":      # this micro-batch's backward re-casts with them
            self.forward_scales.append((x_scale, w_scale))
        y = x_q @ w_q.t()                                                         # [.., out], float32
        return (y if b is None else y + b).to(dtype)

    def dgrad(self, dy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        w_scale = self.forward_scales[0][1] if self.one_scale else None
        w_k, _ = self.cast(w.t(), "weight", w_scale)                              # W cut along out
        dy_q, self.grad_scale = self.cast(dy, "grad_output")
        return (dy_q @ w_k.t()).to(dy.dtype)                                      # [.., in]

    def wgrad(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x_scale, grad_scale = (self.forward_scales.popleft()[0], self.grad_scale) if self.one_scale else (None, None)
        dy_t, _ = self.cast(dy.reshape(-1, dy.shape[-1]).t(), "grad_output", grad_scale)   # [out, T]
        x_t, _ = self.cast(x.reshape(-1, x.shape[-1]).t(), "input", x_scale)               # [in, T]
        return (dy_t @ x_t.t()).to(x.dtype)                                                 # [out, in]

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if w.dim() != 2:
            raise ValueError("FP8 experts run one at a time (MoELayer grouped=False): the grouped product's "
                             "stacked weights would share one scale")
        return _Fp8Linear.apply(x, w, b, self)


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T + b through an Fp8Gemm's fprop; backward through its dgrad and wgrad."""

    @staticmethod
    def forward(ctx, x, w, b, gemm):
        ctx.save_for_backward(x, w)
        ctx.gemm, ctx.has_bias = gemm, b is not None
        return gemm.fprop(x, w, b)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = ctx.gemm.dgrad(dy, w)
        dw = ctx.gemm.wgrad(dy, x)
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None
        return dx, dw, db, None


def _collect(stats: dict, role: str, x: torch.Tensor, out: torch.Tensor, q) -> None:
    """Add one cast to `stats[role]`: its relative error, the non-zero elements it turned into 0,
    and the elements it saturated (clamped at the format's largest value: |x s| beyond it)."""
    x32 = x.detach().to(torch.float32)
    data = q.data.to(torch.float32)[tuple(slice(0, n) for n in x.shape)]     # blocked data is padded
    fmt_max = 448.0 if q.data.dtype == torch.float8_e4m3fn else 57344.0
    saturated = (data.abs() == fmt_max) & (x32.abs() > out.abs().to(torch.float32) * (1 + 1e-6))
    entry = stats.setdefault(role, {"casts": 0, "rel_error": 0.0, "underflow": 0, "saturated": 0, "elements": 0})
    entry["casts"] += 1
    entry["rel_error"] += float((out - x32).norm() / x32.norm().clamp(min=1e-30))
    entry["underflow"] += int(((x32 != 0) & (out == 0)).sum())
    entry["saturated"] += int(saturated.sum())
    entry["elements"] += x32.numel()


def apply_fp8(model: nn.Module, recipe: Fp8Recipe | None, amax_group=None, expert_amax_group=None) -> nn.Module:
    """Give every transformer-layer linear layer of `model` (FP8_LAYERS, by the last part of its
    name) its own Fp8Gemm: the dense ones reducing their amaxes over `amax_group`, the routed
    experts' over `expert_amax_group` (the ranks that cut one expert: etp). None: no FP8 (the
    model unchanged). Returns the model."""
    if recipe is None:
        return model
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in FP8_LAYERS and hasattr(module, "gemm"):
            expert = ".local_experts." in f".{name}"
            module.gemm = (Fp8Gemm(recipe, expert_amax_group, "fp8-amax-experts") if expert
                           else Fp8Gemm(recipe, amax_group))
            # autograd switches grad mode off inside the layers' own autograd functions, where
            # fprop runs: the layer tells its GEMM beforehand whether a backward will follow
            module.register_forward_pre_hook(_note_grad_mode)
    return model


def _note_grad_mode(module: nn.Module, args) -> None:
    module.gemm.backward_follows = torch.is_grad_enabled()


# ---------------------------------------------------------------------------------------
# delayed scaling's state in a checkpoint (chapter 08)
# ---------------------------------------------------------------------------------------
def _delayed_layers(model: nn.Module) -> dict[str, Fp8Gemm]:
    """{single-device name of a linear layer (its weight's placement name, less ".weight"):
    its Fp8Gemm}, for the layers of `model` (a chunk) under delayed scaling."""
    return {m.weight.placement.name.removesuffix(".weight"): m.gemm for m in model.modules()
            if isinstance(getattr(m, "gemm", None), Fp8Gemm) and m.gemm.delayed is not None}


def delayed_scaling_states(model: nn.Module) -> dict[str, torch.Tensor]:
    """Delayed scaling's state of every FP8 linear layer of `model` (a chunk of any layout):
    {the layer's single-device name: [3, 2 + L] float32}, one row per role in ROLES order
    (input, weight, grad_output): the scale, 1.0 when an amax is recorded and not yet turned
    into a scale (DelayedScaling.pending), then the amax history (L = --fp8-amax-history-len).
    Empty without delayed scaling. Every tp and cp rank of a layer holds the same state (the
    amaxes are reduced over tp x cp); data-parallel replicas hold their own. Transformer Engine
    keeps the same numbers (fp8 meta: scale, amax_history) in each layer's `_extra_state`,
    which Megatron saves once, from the first replica (a ShardedObject with replica_id)."""
    return {name: torch.stack([torch.cat([s.scale.reshape(1), torch.tensor([float(s.pending)]), s.history])
                               for s in (gemm.delayed[role] for role in ROLES)])
            for name, gemm in _delayed_layers(model).items()}


def load_delayed_scaling_states(model: nn.Module, states: dict[str, torch.Tensor]) -> int:
    """Set the delayed scaling of `model`'s FP8 layers from `states` (delayed_scaling_states'
    form, from any layout); a layer `states` lacks keeps its fresh state (scale 1, as at the
    start of training). Returns how many layers were set. ValueError when a saved history has
    another length than this run's --fp8-amax-history-len."""
    done = 0
    for name, gemm in _delayed_layers(model).items():
        if name not in states:
            continue
        saved, length = states[name], gemm.recipe.amax_history_len
        if saved.shape != (len(ROLES), 2 + length):
            raise ValueError(f"the checkpoint's amax history of {name} holds {saved.shape[-1] - 2} entries, this run's "
                             f"fp8_amax_history_len={length}: resume with --fp8-amax-history-len {saved.shape[-1] - 2}")
        for row, role in zip(saved.float(), ROLES):
            gemm.delayed[role].load_state_dict({"scale": row[0], "pending": bool(row[1]), "history": row[2:]})
        done += 1
    return done
