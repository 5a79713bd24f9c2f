"""What each precision costs on this CPU: one training step (forward, backward, AdamW) of the same
model in fp32, bf16 (float32 main parameters and gradients), fp16 (and its loss scaler) and FP8
with each recipe (emulated: the casts, then float32 GEMMs), one process.

    python benchmarks/bench_precision.py                  # h 256, 4 layers, b 8 x s 256, one thread
    python benchmarks/bench_precision.py --repeats 7 --hidden 512
    python benchmarks/bench_precision.py --smoke          # tiny sizes, one short window

Timing: `--warmup` untimed steps per precision, then `--repeats` timed windows of `--steps`
steps, the precisions interleaved window by window (a slow moment of a shared machine hurts all
alike); reported: the best and the median window's milliseconds per step and the ratio to fp32.
This is a measurement, not a test: nothing asserts a speed. On a GPU the ranking reverses for
the GEMMs (an H100's FP8 tensor cores run at twice its bf16 rate); this CPU has no 16- or 8-bit
matrix units that PyTorch uses for these shapes, so the extra casts are pure cost here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minimegatron.config import ModelConfig, TrainConfig          # noqa: E402
from minimegatron.optim import learning_rate                      # noqa: E402
from minimegatron.parallel_state import Layout                    # noqa: E402
from minimegatron.parallelize import build_model, build_optimizer  # noqa: E402
from minimegatron.testing import make_batches                     # noqa: E402
from minimegatron.train import train_step                         # noqa: E402

PRECISIONS = {   # name -> (params_dtype, TrainConfig overrides)
    "fp32": ("float32", {}),
    "bf16": ("bfloat16", {"bf16": True}),
    "fp16": ("float16", {"fp16": True, "initial_loss_scale": 2.0 ** 12}),
    **{f"fp8 {r}": ("float32", {"fp8_format": "hybrid", "fp8_recipe": r}) for r in ("tensorwise", "delayed",
                                                                                    "blockwise", "mxfp8")},
}


def make_step(name: str, hidden: int, layers: int, batch: int, seq: int):
    dtype, overrides = PRECISIONS[name]
    model_cfg = ModelConfig.llama(hidden_size=hidden, num_layers=layers, num_attention_heads=max(hidden // 64, 2),
                                  max_position_embeddings=seq, vocab_size=260, params_dtype=dtype)
    cfg = TrainConfig(seq_length=seq, micro_batch_size=batch, lr_warmup_iters=0, progress=False, eval_interval=0,
                      adam_eps=1e-3, **overrides)
    chunks = build_model(model_cfg, cfg, Layout())
    optimizer = build_optimizer(chunks, cfg, Layout())
    data = make_batches(model_cfg, 1, batch, seq)[0]

    def step():
        train_step(chunks, optimizer, [data], Layout(), learning_rate(0, cfg))
    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="h 64, 2 layers, b 2 x s 64, one window")
    args = parser.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.batch, args.seq, args.warmup, args.steps, args.repeats = 64, 2, 2, 64, 1, 1, 1
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s); h {args.hidden}, {args.layers} layers, "
          f"b {args.batch} x s {args.seq}; {args.repeats} windows of {args.steps} steps")
    steps = {name: make_step(name, args.hidden, args.layers, args.batch, args.seq) for name in PRECISIONS}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    windows = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            windows[name].append((time.perf_counter() - start) / args.steps * 1e3)
    base = min(windows["fp32"])
    print(f"{'precision':<16}{'best ms/step':>14}{'median':>10}{'best / fp32':>13}")
    for name, ms in windows.items():
        print(f"{name:<16}{min(ms):>14.1f}{statistics.median(ms):>10.1f}{min(ms) / base:>12.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
