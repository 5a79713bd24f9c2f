"""Where chapter 07's Triton kernels run: without a CUDA device, in Triton's interpreter. Importing
`minimegatron` imports this module early; it sets TRITON_INTERPRET=1 before anything can import
triton (torch.utils.flop_counter does). TRITON_IMPORTED_FIRST records a process where triton
came first (kernels.available names it).
"""

import os
import sys

import torch

TRITON_IMPORTED_FIRST = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
