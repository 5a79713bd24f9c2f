"""Chapter 07's kernel paths inside the model on one NVIDIA GPU: the same LLaMA (h 256, 2 layers, V
1024, s 256, b 4, float32) trained 3 steps on CUDA with --kernels torch, triton (the Triton
kernels compiled for the GPU, the fused loss among them) and compile (Inductor writing Triton),
from the same weights; prints each one's losses and its largest loss and parameter difference
to the torch run. Triton's tl.dot rounds float32 to TF32 in the attention, so the triton run
differs by more than float32 rounding; AdamW's lr-sized steps then carry that into the
parameters. Without CUDA it says so and exits 2.

    python benchmarks/gpu_kernels_in_model.py

Run once, 2026-11-27, on an H200 (benchmarks/README.md, "gpu_check.py").
"""
import sys

import torch

if not torch.cuda.is_available():
    print("gpu_kernels_in_model.py needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
    sys.exit(2)

import dataclasses, time, torch
import minimegatron
from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.parallel_state import Layout
from minimegatron.parallelize import build_model, build_optimizer
from minimegatron.train import train_step
cfg = ModelConfig.llama(hidden_size=256, num_layers=2, num_attention_heads=8, num_query_groups=2, vocab_size=1024,
                        max_position_embeddings=256, params_dtype="float32")
g = torch.Generator().manual_seed(0)
x = torch.randint(0, 1024, (4, 257), generator=g)
batch = {"tokens": x[:, :-1].contiguous().cuda(), "labels": x[:, 1:].contiguous().cuda()}
res = {}
for kernels in ("torch", "triton", "compile"):
    tc = TrainConfig(seq_length=256, micro_batch_size=4, lr=1e-3, device="cuda", kernels=kernels, progress=False)
    torch.manual_seed(0)
    layout = Layout()
    chunks = build_model(cfg, tc, layout)
    opt = build_optimizer(chunks, tc, layout)
    t = time.time()
    losses = [train_step(chunks, opt, [batch], layout, tc.lr)[0] for _ in range(3)]
    torch.cuda.synchronize()
    params = {n: p.detach().float().cpu() for n, p in chunks[0].named_parameters()}
    res[kernels] = (losses, params)
    print(f"{kernels:<8} losses {['%.6f' % l for l in losses]}  ({time.time() - t:.1f} s, compile included)", flush=True)
for k in ("triton", "compile"):
    dl = max(abs(a - b) for a, b in zip(res[k][0], res["torch"][0]))
    dp = max((res[k][1][n] - p).abs().max().item() for n, p in res["torch"][1].items())
    print(f"{k} vs torch on CUDA: loss {dl:.1e}, parameters {dp:.1e}")
