"""Where chapter 07's Triton kernels run: on a machine without a CUDA device, in Triton's
interpreter. Importing `minimegatron` imports this module first (minimegatron/__init__.py), and
it sets TRITON_INTERPRET=1 there. Triton reads the variable when it is first imported, and some
of torch's own modules import it (e.g. torch.utils.flop_counter), so it is set as early as the
package can; TRITON_IMPORTED_FIRST records a process where triton came first (kernels.available
names it)."""

import os
import sys

import torch

TRITON_IMPORTED_FIRST = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
