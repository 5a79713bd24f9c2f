"""Loaded by pytest before any test module. Importing minimegatron first sets TRITON_INTERPRET=1
on a CPU (minimegatron/triton_mode.py) before any test imports a torch module that imports triton
on its own (tests/test_analysis.py's torch.utils.flop_counter does): otherwise chapter 07's
kernel tests would find Triton in compiled mode and skip."""

import minimegatron  # noqa: F401
