"""minimegatron: a runnable textbook of Megatron-LM's 5D parallelism (see the README).

Importing it first ties a torchrun rank's life to torchrun's (lifeline.py, before torch's slow
import), then sets where chapter 07's Triton kernels run (triton_mode.py) before anything can
import triton.
"""

from .lifeline import hold_on_to_launcher as _hold_on_to_launcher

_hold_on_to_launcher()

from . import triton_mode  # noqa: E402,F401
