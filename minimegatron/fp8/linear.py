"""FP8 GEMMs for the one model: `apply_fp8` gives each transformer layer's linear layer its own
`Fp8Gemm` at the GEMM seam of model/linear.py (chapter 06).

    model = apply_fp8(model, Fp8Recipe(scaling="current"), amax_group=layout.tp_cp_group)

A linear layer's three products, both operands in FP8, the sum in float32:

    fprop   y  = x W^T       x: role "input" (e4m3)        W: role "weight" (e4m3)
    dgrad   dx = dy W        dy: role "grad_output" (e5m2 under "hybrid")
    wgrad   dW = dy^T x      both summed over the tokens

Each operand is quantized along the dimension its GEMM sums over (matters for the blocked
recipes only). Emulated: dequantize both, multiply in float32 (bit for bit torch._scaled_mm's
tensorwise result on this CPU), round to the layer's dtype.

One-scale recipes (current, delayed) all-reduce each cast's amax (max, one float, tag
"fp8-amax") over `amax_group` = tp x cp, so every shard casts with one device's scale
(Transformer Engine reduces differently: chapter 06, section 5). Blocked recipes need no
reduction. The backward re-casts the forward's input and weight with the scales that forward
used (`forward_scales`, queued in forward order); wgrad reuses dgrad's output-gradient scale:
one amax reduction per role and micro-batch.

FP8 layers: linear_qkv, linear_proj, linear_fc1, linear_fc2 (experts' and shared expert's
too); the embedding, output layer and router stay in the model's dtype; grouped experts are
refused (their stacked weights would share one scale).

Megatron-LM / TE: megatron/core/extensions/transformer_engine.py (TELinear and kin), fp8_utils.py."""

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
    """The three FP8 products of one linear layer, with its scaling state: `delayed[role]` (recipe
    "delayed"), `forward_scales` (forwards whose backward has not run), `grad_scale` (dgrad's, reused
    by wgrad). `stats`, when a dict, collects per role (relative error, underflows to 0,
    saturations) over every scale-setting cast."""

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
        """"checkpointed": no autograd but a backward follows (scales queued); "recomputing": the
        backward's rerun casts with the queued scales, takes no amax, records no history; so recompute
        changes no number."""
        self.recompute = phase

    def _replayed_scales(self) -> tuple | None:
        """(input scale, weight scale) of the forward being recomputed, or None."""
        return self.forward_scales[0] if self.one_scale and self.recompute == "recomputing" else None

    def cast(self, x: torch.Tensor, role: str, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x [.., K] cast to FP8 along K and dequantized, float32 (float64 for a float64 model); the
        scale(s) used). With `scale` no amax is taken; without, one-scale recipes all-reduce the amax
        over amax_group (tag "fp8-amax") and set the scale (current) or record it (delayed)."""
        q = self.quantize(x, role, scale)
        out = q.dequantize(torch.float64 if x.dtype == torch.float64 else torch.float32)
        if self.stats is not None and scale is None:
            _collect(self.stats, role, x, out, q)
        return out, q.scale

    def quantize(self, x: torch.Tensor, role: str, scale: torch.Tensor | None = None) -> Quantized:
        """x in FP8 as the recipe casts `role` (cast's rules for `scale`), not dequantized."""
        fmt, scaling = self.recipe.format_of(role), self.recipe.scaling
        if scaling == "blockwise":
            return quantize_blockwise(x, fmt, two_d=role == "weight" and x.dim() == 2)
        if scaling == "mxfp8":
            return quantize_mxfp8(x, fmt)
        if scale is not None:
            return Quantized(cast_to_fp8(x, scale, fmt), scale)
        amax = tensor_amax(x, self.amax_group, self.amax_tag)
        return quantize_tensorwise(x, fmt, amax) if scaling == "current" else self.delayed[role].cast(x, amax)

    def gather_input(self, x: torch.Tensor, group, dim: int, tag: str) -> torch.Tensor:
        """The sequence-parallel all-gather in FP8 (one-scale recipes; blocked ones gather in the model's
        dtype): cast this rank's tokens with the whole input's scale, all-gather the FP8 bytes as uint8
        (1 byte an element in the ledger), return the dequantized [b, s, in] for fprop. The backward's
        regather (tag "regather") stays in the model's dtype."""
        if not self.one_scale:
            return super().gather_input(x, group, dim, tag)
        replayed = self._replayed_scales()
        q = self.quantize(x, "input", None if replayed is None else replayed[0])
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
    """Add one cast to `stats[role]`: relative error, non-zero elements turned 0, elements saturated."""
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
    """Give every transformer-layer linear of `model` (FP8_LAYERS, by name) its own Fp8Gemm: dense
    layers reduce amaxes over `amax_group`, routed experts over `expert_amax_group` (etp).
    recipe None: the model unchanged. Returns the model."""
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
    """{single-device layer name: [3, 2 + L] float32} for `model`'s FP8 layers under delayed scaling,
    one row per role in ROLES order: scale, pending (1.0 when an amax is not yet a scale), amax
    history (L = --fp8-amax-history-len). Empty otherwise. Equal on a layer's tp and cp ranks.
    Megatron keeps it in TE's `_extra_state`, saved from the first data-parallel replica."""
    return {name: torch.stack([torch.cat([s.scale.reshape(1), torch.tensor([float(s.pending)]), s.history])
                               for s in (gemm.delayed[role] for role in ROLES)])
            for name, gemm in _delayed_layers(model).items()}


def load_delayed_scaling_states(model: nn.Module, states: dict[str, torch.Tensor]) -> int:
    """Set `model`'s delayed scaling from `states` (delayed_scaling_states' form, any layout); layers
    missing from it keep scale 1. Returns how many were set. ValueError when a history's length is
    not this run's --fp8-amax-history-len."""
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
