"""One GEMM seam (model/linear.py's Gemm): every weight matmul of the model, on every layout,
goes through a layer's `gemm`, so chapter 06's FP8 and chapter 07's kernels plug in by swapping
it, as a transformation. Shown with a Gemm that never gives a weight a gradient: swapped into a
tensor- and sequence-parallel GPT-MoE (experts cut over etp, both experts' forms, a shared expert,
the router) and into a tensor-parallel dense GPT without sequence parallelism, every weight matrix
ends without a gradient; with the plain Gemm every one has one."""

from minimegatron.launch import spawn
from workers import gemm_seam as W


def _all_cases() -> dict:
    return {(grouped, swap): W.weight_grads(grouped, swap) for grouped in (False, True, None) for swap in (False, True)}


def test_every_weight_matmul_goes_through_the_layers_gemm():
    for rank in spawn(_all_cases, 2, timeout=240):
        for grouped in (False, True, None):
            plain, swapped = rank[(grouped, False)], rank[(grouped, True)]
            assert set(plain) == set(swapped) and len(plain) >= 9 and "output_layer.weight" in plain
            assert all(v > 0 for v in plain.values()), plain
            assert all(v == 0 for v in swapped.values()), {n: v for n, v in swapped.items() if v}
            if grouped is not None:
                assert any("experts.local_experts" in n for n in plain) and any("router" in n for n in plain)
                assert any("shared_experts" in n for n in plain)
