"""FP8 training (chapter 06): the numbers and their scaling (quantize.py), the recipe and
delayed scaling's state (scaling.py), and the GEMMs of the one model in FP8 (linear.py).

    model = apply_fp8(model, Fp8Recipe(scaling="current"), amax_group=layout.tp_cp_group)

  quantize.py   FORMATS (e4m3, e5m2), Quantized, cast_to_fp8, tensorwise_scale,
                quantize_tensorwise / quantize_blockwise / quantize_mxfp8
  scaling.py    Fp8Recipe (Megatron's --fp8-format / --fp8-recipe / --fp8-margin /
                --fp8-amax-history-len / --fp8-amax-compute-algo), DelayedScaling
  linear.py     Fp8Gemm (fprop, dgrad, wgrad in FP8 at model/linear.py's seam), apply_fp8;
                delayed scaling's state for a checkpoint (chapter 08)
"""

from .linear import Fp8Gemm, apply_fp8, delayed_scaling_states, load_delayed_scaling_states
from .quantize import FORMATS, cast_to_fp8, quantize_blockwise, quantize_mxfp8, quantize_tensorwise, tensorwise_scale
from .scaling import DelayedScaling, Fp8Recipe


def fp8_recipe_of(cfg) -> Fp8Recipe | None:
    """The recipe a TrainConfig asks for (its fp8_* fields, Megatron's flags), or None."""
    if cfg.fp8_format is None:
        return None
    return Fp8Recipe.from_megatron(cfg.fp8_format, cfg.fp8_recipe, cfg.fp8_margin, cfg.fp8_amax_history_len,
                                   cfg.fp8_amax_compute_algo)


__all__ = ["FORMATS", "cast_to_fp8", "tensorwise_scale", "quantize_tensorwise", "quantize_blockwise", "quantize_mxfp8",
           "Fp8Recipe", "DelayedScaling", "Fp8Gemm", "apply_fp8", "fp8_recipe_of", "delayed_scaling_states",
           "load_delayed_scaling_states"]
