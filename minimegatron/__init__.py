"""minimegatron: a runnable textbook of Megatron-LM's 5D parallelism (see the README).

Importing the package first decides where chapter 07's Triton kernels run (triton_mode.py: on a
CPU, Triton's interpreter), before anything else can import triton.
"""

from . import triton_mode  # noqa: F401
