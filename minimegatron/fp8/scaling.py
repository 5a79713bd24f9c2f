"""The FP8 recipe (which scaling, which formats) and delayed scaling's state (chapter 06).

    recipe = Fp8Recipe(scaling="delayed", fp8_format="hybrid", margin=0, amax_history_len=16,
                       amax_compute_algo="max")
    recipe.format_of("grad_output")         # "e5m2" (hybrid: the backward's gradients)

`scaling` is Megatron's --fp8-recipe ("current" for its "tensorwise"; `from_megatron` maps
the flags); the delayed fields are --fp8-margin, --fp8-amax-history-len,
--fp8-amax-compute-algo with Megatron's defaults (0, 1, "most_recent").

Delayed scaling keeps per tensor ROLE of a layer (input, weight, output gradient) an amax
history and a scale starting at 1. A cast uses the CURRENT scale and records its amax; before
the role's next cast `update_delayed_scale` turns the history into the next scale and rolls it.
Megatron / TE: transformer_engine's DelayedScaling (via megatron/core/fp8_utils.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quantize import FORMATS, Quantized, cast_to_fp8

__all__ = ["Fp8Recipe", "DelayedScaling", "update_delayed_scale", "ROLES", "SCALINGS"]

ROLES = ("input", "weight", "grad_output")
SCALINGS = ("current", "delayed", "blockwise", "mxfp8")


@dataclass(frozen=True)
class Fp8Recipe:
    """scaling: "current" (tensorwise), "delayed", "blockwise" or "mxfp8". fp8_format: "hybrid"
    (e4m3 forward, e5m2 output gradients) or "e4m3" (everywhere). The delayed fields are read
    with scaling="delayed" only."""
    scaling: str = "delayed"
    fp8_format: str = "hybrid"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"

    def __post_init__(self):
        checks = [(self.scaling in SCALINGS, f"scaling={self.scaling!r} is not one of {', '.join(SCALINGS)}"),
                  (self.fp8_format in ("hybrid", "e4m3"), f"fp8_format={self.fp8_format!r} is not 'hybrid' or 'e4m3'"),
                  (self.margin >= 0, f"margin={self.margin} must be >= 0"),
                  (self.amax_history_len >= 1, f"amax_history_len={self.amax_history_len} must be >= 1"),
                  (self.amax_compute_algo in ("max", "most_recent"),
                   f"amax_compute_algo={self.amax_compute_algo!r} is not 'max' or 'most_recent'")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @classmethod
    def from_megatron(cls, fp8_format: str, fp8_recipe: str = "delayed", fp8_margin: int = 0,
                      fp8_amax_history_len: int = 1, fp8_amax_compute_algo: str = "most_recent") -> "Fp8Recipe":
        """From Megatron's flags: --fp8-recipe tensorwise is the book's scaling="current"."""
        return cls("current" if fp8_recipe == "tensorwise" else fp8_recipe, fp8_format, fp8_margin,
                   fp8_amax_history_len, fp8_amax_compute_algo)

    def format_of(self, role: str) -> str:
        """e4m3 for inputs and weights; e5m2 for output gradients under "hybrid"."""
        return "e5m2" if role == "grad_output" and self.fp8_format == "hybrid" else "e4m3"


def update_delayed_scale(history: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int,
                         algo: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Delayed scaling's update (Transformer Engine's DelayedScaling): history [L] float32 holds
    the recorded amaxes, the newest in slot 0; scale is the role's current scale (float32, []).
    Returns (the next scale, the next history):

      amax      = max(history) for algo "max", history[0] for "most_recent"
      new scale = fp8_max / amax / 2^margin, computed in float32 tensors (no float64 step, unlike
                  tensorwise_scale); the old scale when amax is 0 or not finite
      history   rolled by one (slot 0 moves to the end, slot 1 to 0, ...), then slot 0 set to 0,
                the empty place the next cast records its amax in; a non-finite amax stays in
                the history like any other (a circular buffer: after the roll, slot 1 holds the
                oldest entry)

    The inputs are not modified."""
    # BEGIN EXERCISE 6.3: delayed scaling's amax-history update | hint: which amax does each compute algo read, what does the margin do to the scale, and when must the old scale be kept? Then make room for the next amax.
    amax = history.max() if algo == "max" else history[0]
    new = scale
    if bool(amax > 0) and bool(torch.isfinite(amax)):
        new = (fp8_max / amax / 2.0 ** margin).to(torch.float32)
    rolled = torch.roll(history, -1)
    rolled[0] = 0.0
    return new, rolled
    # END EXERCISE


class DelayedScaling:
    """One role's amax history and scale (the module docstring's rules), for format `fmt`."""

    def __init__(self, recipe: Fp8Recipe, fmt: str):
        self.recipe, self.fmt = recipe, fmt
        self.history = torch.zeros(recipe.amax_history_len, dtype=torch.float32)
        self.scale = torch.ones((), dtype=torch.float32)
        self.pending = False                      # an amax recorded and not yet turned into a scale

    def update(self) -> None:
        """Turn the recorded amaxes into the next scale, then roll the history."""
        self.scale, self.history = update_delayed_scale(self.history, self.scale, FORMATS[self.fmt][1],
                                                        self.recipe.margin, self.recipe.amax_compute_algo)
        self.pending = False

    def cast(self, x: torch.Tensor, amax: torch.Tensor) -> Quantized:
        """x in FP8 with the role's scale, after the pending update; x's `amax` (reduced over
        the ranks that share the tensor) is recorded for the next one."""
        if self.pending:
            self.update()
        out = Quantized(cast_to_fp8(x, self.scale, self.fmt), self.scale.clone())
        self.history[0] = amax
        self.pending = True
        return out

    def load_state_dict(self, state: dict) -> None:
        self.history, self.scale, self.pending = state["history"].clone(), state["scale"].clone(), state["pending"]
