"""The book's FP8 emulation against Transformer Engine, on a machine with a CUDA GPU (chapter 06).

    python benchmarks/check_fp8_te.py            # needs CUDA and transformer_engine (requirements-gpu.txt)

For each recipe TE and the book share (current = TE's Float8CurrentScaling, delayed = its
DelayedScaling with a history of 1, "most_recent", margin 0; hybrid formats), one linear layer
with the same weights runs forward and backward three times on the same inputs: TE's te.Linear
under fp8_autocast, and the book's Linear with an Fp8Gemm (fp8/linear.py), on the GPU. It
prints the largest relative difference of the output, the input gradient and the weight gradient
per step (the casts are the same arithmetic; the GEMMs accumulate in a different order, so
expect float32 rounding, not bit equality), then times a bf16 GEMM against TE's FP8 one at
h = 8192. It exits 0 when every difference is below 1e-2 relative.

Without a CUDA device or without transformer_engine it says so and exits 2: this book's CPU
path never imports Transformer Engine. Not yet run on a GPU (no GPU was lent to the session
that wrote it): the first run on one is its test.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as exc:
        return f"transformer_engine is not importable ({exc}); pip install -r requirements-gpu.txt on a GPU machine"
    return None


def compare(recipe_name: str, steps: int = 3, h: int = 1024, tokens: int = 2048) -> list[tuple[float, float, float]]:
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format
    from minimegatron.fp8 import Fp8Gemm, Fp8Recipe
    from minimegatron.model.linear import Linear

    te_recipe = (Float8CurrentScaling(fp8_format=Format.HYBRID) if recipe_name == "current" else
                 DelayedScaling(fp8_format=Format.HYBRID, margin=0, amax_history_len=1, amax_compute_algo="most_recent"))
    torch.manual_seed(0)
    theirs = te.Linear(h, h, bias=False, params_dtype=torch.float32, device="cuda")
    mine = Linear(h, h, bias=False).cuda()
    mine.weight.data.copy_(theirs.weight.data)
    mine.gemm = Fp8Gemm(Fp8Recipe(recipe_name, "hybrid"))
    out = []
    for step in range(steps):
        x = torch.randn(tokens, h, device="cuda") * (1 + step)
        dy = torch.randn(tokens, h, device="cuda") * 1e-3
        x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        with te.fp8_autocast(enabled=True, fp8_recipe=te_recipe):
            y1 = theirs(x1)
        y1.backward(dy)
        y2 = mine(x2)
        y2.backward(dy)
        rel = lambda a, b: float((a - b).norm() / b.norm())           # noqa: E731
        out.append((rel(y2, y1), rel(x2.grad, x1.grad), rel(mine.weight.grad, theirs.weight.grad)))
        theirs.weight.grad = mine.weight.grad = None
    return out


def time_gemms(h: int = 8192, repeats: int = 20) -> tuple[float, float]:
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8CurrentScaling
    layer = te.Linear(h, h, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(h, h, device="cuda", dtype=torch.bfloat16)
    timings = []
    for fp8 in (False, True):
        with torch.no_grad(), te.fp8_autocast(enabled=fp8, fp8_recipe=Float8CurrentScaling()):
            for _ in range(3):
                layer(x)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(repeats):
                layer(x)
            torch.cuda.synchronize()
        timings.append((time.perf_counter() - start) / repeats)
    return tuple(2 * h ** 3 / t / 1e12 for t in timings)


def main() -> int:
    why = unavailable()
    if why is not None:
        print(f"check_fp8_te.py needs a CUDA GPU with Transformer Engine: {why}. Nothing checked.")
        return 2
    worst = 0.0
    for recipe in ("current", "delayed"):
        for step, diffs in enumerate(compare(recipe)):
            print(f"{recipe:8s} step {step}: relative difference y {diffs[0]:.2e}, dx {diffs[1]:.2e}, dW {diffs[2]:.2e}")
            worst = max(worst, *diffs)
    bf16, fp8 = time_gemms()
    print(f"{torch.cuda.get_device_name()}: bf16 GEMM {bf16:.0f} TFLOPS, TE FP8 GEMM {fp8:.0f} TFLOPS (h 8192, forward)")
    print(("MATCH" if worst < 1e-2 else "MISMATCH") + f": the book's FP8 against Transformer Engine, worst {worst:.2e}")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
