"""minimegatron: a runnable textbook of Megatron-LM's 5D parallelism (see the README).

Importing the package first ties a torchrun rank's life to torchrun's (lifeline.py: before
torch's slow import, so a launcher killed in the first seconds leaves no orphan), then decides
where chapter 07's Triton kernels run (triton_mode.py: on a CPU, Triton's interpreter), before
anything else can import triton.
"""

from .lifeline import hold_on_to_launcher as _hold_on_to_launcher

_hold_on_to_launcher()

from . import triton_mode  # noqa: E402,F401
