"""minimegatron: a runnable textbook of Megatron-LM's 5D parallelism (see the README).

On a machine without a CUDA device, importing the package sets TRITON_INTERPRET=1, so that
chapter 07's Triton kernels (minimegatron/kernels/) run in Triton's interpreter. Triton reads the
variable when it is first imported, and some of torch's own modules import it (e.g.
torch.utils.flop_counter), so it is set here, as early as the package can.
"""

import os as _os
import sys as _sys

import torch as _torch

# triton imported before this package could set the variable: kernels.available() says so
TRITON_IMPORTED_FIRST = "triton" in _sys.modules and _os.environ.get("TRITON_INTERPRET") != "1"
if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")
