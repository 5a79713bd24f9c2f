"""The book's check on one NVIDIA GPU: what the CPU path cannot show, in under 10 minutes.

    .venv/bin/python benchmarks/gpu_check.py                # make gpu-check: every check, in order
    .venv/bin/python benchmarks/gpu_check.py --list         # name the checks, run nothing (any machine)
    .venv/bin/python benchmarks/gpu_check.py --only kernels baseline --peak-tflops 989

Six checks, in order, each in a Python process of its own under its own time limit (a hung
kernel, or a CUDA error that poisons a process, ends that check only), each printing its numbers
and then one line: PASS, FAIL or SKIP, its name, the reason.

  environment  torch, CUDA, the device (name, capability, memory); whether triton, flash_attn and
               transformer_engine import (the last two optional: requirements-gpu.txt).
  kernels      chapter 07's Triton kernels (flash_attention, rms_norm, swiglu, linear_cross_entropy)
               compiled for the GPU (TRITON_INTERPRET is removed from the checks' environment),
               forward and gradients, float32 and bf16 inputs, against the book's PyTorch functions
               in float64 on the same inputs. Error: max |x - ref| / max |ref| per tensor, within
               TOLERANCE (float32 attention is looser: Triton's tl.dot rounds float32 to TF32).
  libraries    bf16 attention (s 2048, d 128) against the naive attention in float64: the naive one
               and SDPA in bf16 (the yardsticks), the book's Triton FlashAttention and flash_attn's
               flash_attn_func; Transformer Engine's RMSNorm and LayerNorm against the book's. A
               library that does not import is named and skipped.
  baseline     the single-device step (build_model, build_optimizer, train.train_step with
               TrainConfig(device="cuda")): 3 steps of a small LLaMA in float64 on CUDA against the
               same on the CPU (testing.compare_runs: MATCH); then tokens/s and MFU of a larger one in
               bf16 and fp32: analysis.training_flops / step time / PEAK_TFLOPS (--peak-tflops: bf16).
  multirank    2 gloo ranks from the book's launcher (launch.spawn), TrainConfig(device="cuda"), both
               on GPU 0: dp 2, then tp 2, 3 steps in float64 (testing.train_layout) against the
               single-device run on the CPU: MATCH. (The training CLI's --device cuda means NCCL, one
               GPU per rank, which two ranks on one GPU cannot use.)
  capstone     chapter 08's commands with the GPU in them: `torchrun -m minimegatron.train --device
               cuda` (NCCL, a world of one) trains a float64 LLaMA 2 steps and saves a torch_dist
               checkpoint; 2 gloo ranks on the CPU resume it under tp 2 to step 4; the losses equal
               one CPU process's 4 uninterrupted steps. Then that checkpoint on the GPU: greedy
               generation with the KV cache = without it = the CPU's tokens; exported to Hugging
               Face (when transformers imports), its logits on the GPU = the book's, and its
               greedy generate = the book's tokens.

Exit status: 0 when CUDA is present and no check failed (SKIP is no failure), 1 when one failed,
2 without a usable CUDA device: it says so, and what it would check, before importing torch where
the machine has no NVIDIA driver. The checks stop after --budget seconds (570) together.

First run, 2026-11-27, on one NVIDIA H200 (torch 2.11.0+cu130, triton 3.6.0; flash-attn and
Transformer Engine not installed, so their comparisons have never run): baseline and multirank
failed for the LLaMA models, because model/rope.py's rope_cos_sin built its frequency table on
the CPU; fixed, and the second run on the same machine PASSed all five in 82 s
(benchmarks/README.md, "gpu_check.py"; gpu_runs/ has its output). On 2026-11-28, on one H100
(torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0), all six PASSed in 147 s, capstone and the
packed-documents attention included (gpu_runs/2026-11-28_h100_gpu_check.log).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHECKS = {   # name -> (time limit in seconds, what it checks)
    "environment": (120, "torch, CUDA, device name and capability; do triton, flash_attn, transformer_engine import"),
    "kernels": (240, "the Triton kernels compiled for CUDA against their PyTorch references, float32 and bf16"),
    "libraries": (180, "flash_attn, the Triton FlashAttention against naive and SDPA attention; TE's norms (bf16)"),
    "baseline": (240, "the single-device train step on CUDA = the CPU's (float64); tokens/s and MFU, bf16 and fp32"),
    "multirank": (240, "2 gloo ranks with CUDA tensors sharing the GPU (dp 2, tp 2) against one device: MATCH"),
    "capstone": (240, "chapter 08 on CUDA: train under NCCL, resume on the CPU under tp 2; generate; transformers"),
}
BUDGET_S = 570
# Dense peak TFLOP/s (no 2:4 sparsity; the datasheets print bf16 with sparsity, twice these) from NVIDIA's
# datasheets "H100 Tensor Core GPU" (SXM, NVL, PCIe), "H200 Tensor Core GPU" (SXM, NVL), "A100 Tensor Core
# GPU". fp32: the CUDA cores' FP32 rate (torch's float32 matmuls use no TF32 by default).
PEAK_TFLOPS = [   # (part of torch.cuda.get_device_name(), bf16, fp32): the first match wins
    ("H100 NVL", 835.5, 60.0), ("H100 PCIe", 756.5, 51.2), ("H100", 989.4, 66.9),
    ("H200 NVL", 835.5, 60.0), ("H200", 989.4, 66.9), ("A100", 312.0, 19.5),
]
TOLERANCE = {"float32": 1e-4, "float32 attention": 1e-2, "bfloat16": 2e-2}
EPS = 1e-5
SIZES = dict(attention=(2, 8, 2, 1024, 64),            # b, a, g, s, d
             rows=4096, hidden=1024,                    # the norms' and SwiGLU's inputs
             tokens=4096, ce_hidden=1024, vocab=32000,  # the fused loss's
             lib_attention=(2, 8, 2, 2048, 128),        # libraries: b, a, g, s, d
             equal=(128, 2, 128, 4), speed=(1024, 8, 1024, 8, 32000), rank=(64, 2, 32))   # h, L, s(, b, V)
DEVICE = "cuda"


def nvidia_driver_present() -> bool:
    """Is there an NVIDIA driver on this machine at all? (no torch import)"""
    return (os.path.exists("/proc/driver/nvidia/version") or bool(glob.glob("/dev/nvidia[0-9]*"))
            or shutil.which("nvidia-smi") is not None)


def no_gpu_reason() -> str | None:
    if not nvidia_driver_present():
        return "this machine has no NVIDIA driver (no /proc/driver/nvidia, /dev/nvidia*, nor nvidia-smi)"
    import torch
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA device: "
                "torch.cuda.is_available() is False")
    return None


def no_gpu_message(why: str) -> str:
    return (f"gpu_check.py needs an NVIDIA GPU with CUDA, and {why}. On one GPU (an H100: under 10 minutes) it "
            "would check the CUDA environment; the book's Triton kernels compiled for the GPU against their "
            "PyTorch references; flash-attn and Transformer Engine against the book's attention and norms; the "
            "single-device training step on CUDA against the CPU, with its tokens/s and MFU; two gloo ranks "
            "sharing the GPU against one device; and chapter 08's training under NCCL resumed on the CPU, generation and "
            "the Hugging Face export on the GPU. Nothing was checked (--list names the checks).")


# helpers, inside a check's process
def say(line: str) -> None:
    print("    " + line, flush=True)


def err(x, ref) -> float:
    """max |x - ref| / max |ref|."""
    ref = ref.detach().double()
    return ((x.detach().double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def with_grads(fn, inputs, dout):
    """[fn(*inputs), its gradient to each input] under the incoming gradient dout."""
    import torch
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout.to(out.dtype))]


def judge(label: str, got, ref, tol: float, failed: list[str]) -> float:
    """Print the errors of got against ref (lists of tensors); record a failure; the worst error."""
    errors = [err(g, r) for g, r in zip(got, ref)]
    failed += [] if max(errors) <= tol else [f"{label}: error {max(errors):.1e} > {tol:.0e}"]
    say(f"{'ok ' if max(errors) <= tol else 'BAD'} {label:<48} " + " ".join(f"{e:.1e}" for e in errors)
        + f"  (tolerance {tol:.0e})")
    return max(errors)


def naive_attention(q, k, v):
    """The book's written-out attention (exercise 0.1), k and v repeated to q's heads (GQA)."""
    from minimegatron.model.attention import causal_attention
    r = q.shape[1] // k.shape[1]
    return causal_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1))


def randn(*shape, dtype=None, scale=1.0, shift=0.0):
    import torch
    return (shift + scale * torch.randn(*shape, device=DEVICE)).to(dtype or torch.float32)


def book_norm(kind: str):
    """The book's RMSNorm or LayerNorm (model/linear.py) as a function of (x, weight[, bias])."""
    from torch.func import functional_call
    from minimegatron.model.linear import LayerNorm, RMSNorm

    def norm(x, w, b=None):
        module = (RMSNorm if kind == "RMSNorm" else LayerNorm)(x.shape[-1], EPS)
        return functional_call(module, {"weight": w} | ({"bias": b} if b is not None else {}), (x,))
    return norm


# the checks, each in its own process: each returns (status, reason)
def check_environment(args):
    import torch
    props = torch.cuda.get_device_properties(0)
    say(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s); device 0: "
        f"{props.name}, capability {props.major}.{props.minor}, {props.total_memory / 2**30:.1f} GiB, "
        f"{props.multi_processor_count} SMs")
    found = {}
    for module in ("triton", "flash_attn", "transformer_engine"):
        try:
            found[module] = getattr(__import__(module), "__version__", "?")
        except Exception as exc:                     # noqa: BLE001 - ImportError, or a broken build
            found[module] = None
            say(f"{module}: not importable ({type(exc).__name__}: {str(exc)[:160]})")
    x = torch.randn(256, 256, dtype=torch.float64)
    say(f"a float64 matmul on the GPU against the CPU's: error {err((x.to(DEVICE) @ x.to(DEVICE)).cpu(), x @ x):.1e}")
    libs = ", ".join(f"{m} {v}" if v else f"{m} missing" for m, v in found.items())
    return "PASS", f"{props.name} (capability {props.major}.{props.minor}), torch {torch.__version__}; {libs}"


def check_kernels(args):
    import torch
    import triton
    from minimegatron.kernels.cross_entropy import linear_cross_entropy
    from minimegatron.kernels.flash_attention import flash_attention
    from minimegatron.kernels.rmsnorm import rms_norm
    from minimegatron.kernels.swiglu import swiglu
    from minimegatron.model.attention import document_attention
    from minimegatron.model.gpt import language_model_loss
    from minimegatron.model.mlp import mlp_activation
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "FAIL", "TRITON_INTERPRET=1: the kernels would run in Triton's interpreter, not compiled"
    torch.manual_seed(0)
    (b, a, g, s, d), n, h = SIZES["attention"], SIZES["rows"], SIZES["hidden"]
    t, hc, vocab = SIZES["tokens"], SIZES["ce_hidden"], SIZES["vocab"]
    say(f"triton {triton.__version__}, compiled for {DEVICE}; errors max|x - ref| / max|ref| of [output, input "
        "gradients] against the book's PyTorch in float64 on the same inputs")
    worst, failed = 0.0, []
    # packed documents (chapter 07 §5), per row summing to s: one starting inside a block, one a token long
    lengths = [[100, 300, 1, 64, s - 465], [s // 2, s - s // 2]][:b] + [[s]] * max(0, b - 2)
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in lengths]).to(DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        labels = torch.randint(0, vocab, (t,), device=DEVICE)
        cases = {   # label -> (kernel, reference, inputs, incoming gradient)
            f"flash_attention b{b} a{a} g{g} s{s} d{d}": (
                flash_attention, naive_attention, [randn(b, m, s, d, dtype=dtype) for m in (a, g, g)],
                randn(b, a, s, d, dtype=dtype)),
            f"flash_attention documents b{b} s{s}": (
                lambda q, k, v: flash_attention(q, k, v, document_ids=ids),
                lambda q, k, v: document_attention(q, k, v, ids), [randn(b, m, s, d, dtype=dtype) for m in (a, g, g)],
                randn(b, a, s, d, dtype=dtype)),
            f"rms_norm {n}x{h}": (lambda x, w: rms_norm(x, w, EPS), book_norm("RMSNorm"),
                                  [randn(n, h, dtype=dtype), randn(h, dtype=dtype, scale=0.1, shift=1.0)],
                                  randn(n, h, dtype=dtype)),
            f"swiglu {n}x2*{h}": (swiglu, lambda y: mlp_activation(y, swiglu=True), [randn(n, 2 * h, dtype=dtype)],
                                  randn(n, h, dtype=dtype)),
            f"linear_cross_entropy T{t} h{hc} V{vocab}": (
                lambda x, w: linear_cross_entropy(x, w, labels),
                lambda x, w: language_model_loss((x @ w.t())[None], labels[None])[0],
                [randn(t, hc, dtype=dtype), randn(vocab, hc, dtype=dtype, scale=0.02)],
                torch.rand(t, device=DEVICE) / t),
        }
        for case, (fn, ref_fn, inputs, grad) in cases.items():
            tol = TOLERANCE[name + (" attention" if case.startswith("flash") and name == "float32" else "")]
            got, ref = with_grads(fn, inputs, grad), with_grads(ref_fn, [x.double() for x in inputs], grad.double())
            worst = max(worst, judge(f"{case} {name}", got, ref, tol, failed))
    if failed:
        return "FAIL", "; ".join(failed)
    return "PASS", f"4 kernels (attention also over packed documents) x (float32, bf16), forward and gradients: " \
                   f"worst error {worst:.1e}"


def check_libraries(args):
    import torch
    from minimegatron.kernels.flash_attention import flash_attention
    from minimegatron.model.attention import sdpa_attention
    torch.manual_seed(0)
    b, a, g, s, d = SIZES["lib_attention"]
    bf16, tol, notes, failed = torch.bfloat16, TOLERANCE["bfloat16"], [], []
    qkv, dout = [randn(b, m, s, d, dtype=bf16) for m in (a, g, g)], randn(b, a, s, d, dtype=bf16)
    candidates = {"naive (book, bf16)": naive_attention, "sdpa (book, bf16)": sdpa_attention,
                  "Triton FlashAttention (book)": flash_attention}
    try:
        from flash_attn import flash_attn_func
        candidates["flash_attn.flash_attn_func"] = lambda q, k, v: flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2)
    except Exception as exc:                          # noqa: BLE001
        notes.append(f"flash_attn skipped ({type(exc).__name__}: {str(exc)[:80]})")
    say(f"attention b{b} a{a} g{g} s{s} d{d} in bf16 against the naive attention in float64: [out, dq, dk, dv]")
    ref = with_grads(naive_attention, [x.double() for x in qkv], dout.double())
    for name, fn in candidates.items():
        try:
            judge(name, with_grads(fn, qkv, dout), ref, tol, failed)
        except Exception as exc:                      # noqa: BLE001 - one candidate's failure, named
            failed.append(f"{name}: {type(exc).__name__}: {str(exc)[:120]}")
    try:
        import transformer_engine.pytorch as te
    except Exception as exc:                          # noqa: BLE001
        te = None
        notes.append(f"transformer_engine skipped ({type(exc).__name__}: {str(exc)[:80]})")
    n, h = SIZES["rows"], SIZES["hidden"]
    for kind in ("RMSNorm", "LayerNorm") if te is not None else ():
        try:                                          # [y, dx, dweight(, dbias)] against the book's in float64
            params = [randn(h, dtype=bf16, scale=0.1, shift=1.0)] + ([randn(h, dtype=bf16, scale=0.1)] if kind ==
                                                                     "LayerNorm" else [])
            x, dy = randn(n, h, dtype=bf16), randn(n, h, dtype=bf16)
            theirs = getattr(te, kind)(h, eps=EPS, params_dtype=bf16).to(DEVICE)
            with torch.no_grad():
                for attr, p in zip(("weight", "bias"), params):
                    getattr(theirs, attr).copy_(p)
            leaf = x.clone().requires_grad_(True)
            y = theirs(leaf)
            te_out = [y.detach(), *torch.autograd.grad(y, [leaf, *(getattr(theirs, attr) for attr in
                                                                   ("weight", "bias")[:len(params)])], dy)]
            ref = with_grads(book_norm(kind), [x.double(), *(p.double() for p in params)], dy.double())
            judge(f"te.{kind} {n}x{h}", te_out, ref, tol, failed)
            judge(f"book {kind} {n}x{h} (bf16)", with_grads(book_norm(kind), [x, *params], dy), ref, tol, failed)
        except Exception as exc:                      # noqa: BLE001
            failed.append(f"te.{kind}: {type(exc).__name__}: {str(exc)[:120]}")
    tail = "".join(f"; {note}" for note in notes)
    if failed:
        return "FAIL", "; ".join(failed) + tail
    return "PASS", f"{len(candidates)} attention implementations{' and TE norms' if te else ''} within {tol:.0e}{tail}"


def build(model_cfg, cfg):
    """The single-device model and optimizer as the training loop builds them, on cfg.device."""
    from minimegatron.parallel_state import Layout
    from minimegatron.parallelize import build_model, build_optimizer
    chunks = build_model(model_cfg, cfg, Layout())
    return chunks, build_optimizer(chunks, cfg, Layout())


def run_steps(model_cfg, cfg, batches):
    """train.train_step on Layout() over one batch per step: a testing.RunRecord (on the CPU)."""
    from minimegatron.optim import learning_rate
    from minimegatron.parallel_state import Layout
    from minimegatron.parallelize import full_model_tensors
    from minimegatron.testing import RunRecord
    from minimegatron.train import before_optimizer_step, train_step
    (chunks, optimizer), losses, grads = build(model_cfg, cfg), [], {}
    keep = lambda: grads or grads.update(full_model_tensors(chunks, Layout(), grads=True))   # noqa: E731
    for step, batch in enumerate(batches):
        batch = {k: v.to(cfg.device) for k, v in batch.items()}
        with before_optimizer_step(optimizer, keep):
            losses.append(train_step(chunks, optimizer, [batch], Layout(), learning_rate(step, cfg))[0])
    return RunRecord(losses, {n: g.cpu() for n, g in grads.items()},
                     {n: p.detach().cpu() for n, p in full_model_tensors(chunks, Layout()).items()})


def time_steps(precision: str, peak: float | None) -> str:
    """Tokens/s and MFU of SIZES["speed"]'s LLaMA in bf16 (float32 main parameters) or fp32."""
    import torch
    from minimegatron.analysis import training_flops
    from minimegatron.config import ModelConfig, TrainConfig
    from minimegatron.parallel_state import Layout
    from minimegatron.testing import make_batches
    from minimegatron.train import train_step
    h, layers, s, b, vocab = SIZES["speed"]
    model_cfg = ModelConfig.llama(hidden_size=h, num_layers=layers, num_attention_heads=16, num_query_groups=4,
                                  max_position_embeddings=s, vocab_size=vocab,
                                  params_dtype="bfloat16" if precision == "bf16" else "float32")
    cfg = TrainConfig(seq_length=s, micro_batch_size=b, train_iters=100, clip_grad=1.0, bf16=precision == "bf16",
                      device=DEVICE, progress=False)
    chunks, optimizer = build(model_cfg, cfg)
    batch = {k: v.to(DEVICE) for k, v in make_batches(model_cfg, 1, b, s)[0].items()}
    times = []
    for _ in range(13):                                       # 3 warm-up steps, then 10 timed
        torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(chunks, optimizer, [batch], Layout(), cfg.lr)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    step = sorted(times[3:])[5]                               # the median of the 10
    flops = training_flops(model_cfg, b, s)["total"]
    mfu = f"MFU {flops / step / (peak * 1e12):.1%} of {peak:g}" if peak else "MFU: peak unknown (--peak-tflops)"
    say(f"{precision}: LLaMA h{h} L{layers} V{vocab} s{s} b{b}: median step {step * 1e3:.1f} ms, "
        f"{b * s / step:,.0f} tokens/s, {flops / step / 1e12:.1f} model TFLOP/s, {mfu}")
    return f"{precision} {b * s / step:,.0f} tokens/s, {mfu.split(' of')[0]}"


def small_model(style: str, h: int, layers: int, s: int):
    """A float64 GPT-2-style (learned positions) or LLaMA-style (RoPE, GQA g 2) model of 4 heads."""
    from minimegatron.config import ModelConfig
    common = dict(hidden_size=h, num_layers=layers, num_attention_heads=4, max_position_embeddings=s,
                  params_dtype="float64")
    return ModelConfig.llama(num_query_groups=2, **common) if style == "llama" else ModelConfig.gpt2(**common)


def short(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"


def check_baseline(args):
    import torch
    from minimegatron.config import TrainConfig
    from minimegatron.testing import compare_runs, make_batches
    h, layers, s, b = SIZES["equal"]
    failed, diffs = [], []
    for style in ("gpt2", "llama"):          # GPT-2 first: apart from RoPE, what the LLaMA adds
        try:
            model_cfg = small_model(style, h, layers, s)
            batches = make_batches(model_cfg, 3, b, s)
            runs = {dev: run_steps(model_cfg, TrainConfig(seq_length=s, micro_batch_size=b, train_iters=3,
                                                          lr_warmup_iters=0, clip_grad=1.0, device=dev,
                                                          progress=False), batches) for dev in ("cpu", DEVICE)}
            report = compare_runs(runs["cpu"], runs[DEVICE], torch.float64)
            say(f"{style} h{h} L{layers} s{s} b{b} float64, 3 steps on {DEVICE} against the CPU: losses "
                + " ".join(f"{x:.6f}" for x in runs[DEVICE].losses))
            for line in str(report).splitlines():
                say("  " + line)
            failed += [] if report.ok else [f"{style}: {'; '.join(report.problems[:2])}"]
            diffs.append(f"{style} loss {report.max_loss_diff:.0e}, params {report.max_param_diff:.0e}")
        except Exception as exc:                      # noqa: BLE001 - the next part still runs
            traceback.print_exc()
            failed.append(f"{style} on {DEVICE}: {short(exc)}")
    name = torch.cuda.get_device_name()
    bf16, fp32 = next(((bf, fp) for key, bf, fp in PEAK_TFLOPS if key.lower() in name.lower()), (None, None))
    speeds = []
    for precision, peak in (("bf16", args.peak_tflops or bf16), ("fp32", fp32)):
        try:
            speeds.append(time_steps(precision, peak))
        except Exception as exc:                      # noqa: BLE001
            traceback.print_exc()
            failed.append(f"{precision} timing: {short(exc)}")
    say("MFU: analysis.training_flops per step (the matmuls; attention over all s^2 scores, as the written-out "
        "attention computes them, where a causal kernel does about half; not the optimizer) / time / peak")
    if failed:
        return "FAIL", "; ".join(failed)
    return "PASS", f"CUDA = CPU in float64 ({'; '.join(diffs)}); " + "; ".join(speeds)


def _rank_worker(runs):
    """On each spawned rank: each (model_cfg, train_cfg, dp, batches) through testing.train_layout,
    on GPU 0 for cuda; a failure is returned as its text (both ranks fail alike, before a collective)."""
    import torch
    from minimegatron.testing import train_layout
    out = []
    for model_cfg, cfg, dp, steps in runs:
        if cfg.device == "cuda":
            torch.cuda.set_device(0)                          # both ranks on the one GPU
        try:
            record = train_layout(model_cfg, cfg, dp, [{k: v.to(cfg.device) for k, v in b.items()} for b in steps])[0]
            out.append({k: record[k] for k in ("losses", "grads", "params")})
        except Exception as exc:                              # noqa: BLE001
            out.append({"error": short(exc)})
    return out


def check_multirank(args):
    import dataclasses
    import torch
    from minimegatron.config import TrainConfig
    from minimegatron.launch import spawn
    from minimegatron.testing import RunRecord, compare_runs, make_batches, one_device_config, single_device_run
    h, layers, s = SIZES["rank"]
    base = TrainConfig(seq_length=s, micro_batch_size=2, grad_accum_steps=2, train_iters=3, lr_warmup_iters=0,
                       clip_grad=0.05, device=DEVICE, progress=False)
    runs = {}                                                 # name -> (model, train config, dp, batches)
    for style in ("gpt2", "llama"):
        for name, tp, dp in (("dp 2", 1, 2), ("tp 2", 2, 1)):
            model_cfg = small_model(style, h, layers, s)
            runs[f"{style} {name}"] = (model_cfg, dataclasses.replace(base, tensor_model_parallel_size=tp), dp,
                                       make_batches(model_cfg, 3, 2 * 2 * dp, s))
    results = spawn(_rank_worker, 2, list(runs.values()), timeout=max(30.0, args.limit - 40))[0]
    failed = []
    for (name, (model_cfg, cfg, dp, steps)), got in zip(runs.items(), results):
        if "error" in got:
            say(f"{name}: FAILED on the ranks: {got['error']}")
            failed.append(f"{name}: {got['error']}")
            continue
        one = dataclasses.replace(one_device_config(cfg), device="cpu")
        reference = single_device_run(model_cfg, steps, one, grad_accum_steps=cfg.grad_accum_steps * dp)
        report = compare_runs(reference, RunRecord(got["losses"], got["grads"], got["params"]), torch.float64)
        say(f"{name} (2 gloo ranks, {cfg.device} tensors) against one process on the CPU, h{h} L{layers} s{s}:")
        for line in str(report).splitlines():
            say("  " + line)
        failed += [] if report.ok else [f"{name}: MISMATCH"]
    if failed:
        return "FAIL", "; ".join(failed)
    return "PASS", f"MATCH: {', '.join(runs)} on 2 gloo ranks sharing the GPU equal the single-device run"


CAPSTONE_MODEL = ["--preset", "tiny", "--num-query-groups", "2", "--params-dtype", "float64", "--train-iters", "4",
                  "--eval-interval", "0", "--no-progress"]
TORCHRUN = ["-m", "torch.distributed.run", "--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
            "--local-addr=127.0.0.1"]


def run_command(args: list[str], limit: float) -> None:
    """Run `python ARGS` from the repository's root; RuntimeError with its output's tail if it fails."""
    say("$ python " + " ".join(args))
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=limit,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        print((proc.stdout + proc.stderr)[-2500:])
        raise RuntimeError(f"exit status {proc.returncode}: python {' '.join(args[:3])} ...")


def check_capstone(args):
    import copy
    import json
    import torch
    from minimegatron.convert import export_hf
    from minimegatron.data import build_tokenizer
    from minimegatron.generate import generate, load_model
    from minimegatron.launch import init_from_torchrun
    work, failed, notes = Path(tempfile.mkdtemp(prefix="gpu-check-capstone-")), [], []
    ckpt, limit = work / "ckpt", max(30.0, (args.limit - 60) / 3)
    run_command([*TORCHRUN, "--nproc-per-node=1", "-m", "minimegatron.train", *CAPSTONE_MODEL, "--device", DEVICE,
                 "--ckpt-format", "torch_dist", "--save", str(ckpt), "--exit-interval", "2",
                 "--out-dir", str(work / "resumed")], limit)
    run_command([*TORCHRUN, "--nproc-per-node=2", "-m", "minimegatron.train", *CAPSTONE_MODEL, "--device", "cpu",
                 "--tensor-model-parallel-size", "2", "--load", str(ckpt), "--out-dir", str(work / "resumed")], limit)
    run_command(["-m", "minimegatron.train", *CAPSTONE_MODEL, "--device", "cpu", "--out-dir", str(work / "cpu")], limit)
    resumed, cpu = (json.loads((work / run / "losses.json").read_text())["train"] for run in ("resumed", "cpu"))
    gap = max(abs(x - y) for x, y in zip(resumed, cpu)) if len(resumed) == len(cpu) == 4 else float("inf")
    say(f"losses, 2 steps on {DEVICE} (NCCL) + 2 resumed on 2 CPU ranks under tp 2: {' '.join(f'{x:.9f}' for x in resumed)}")
    say(f"losses, 4 steps in one CPU process:                            {' '.join(f'{x:.9f}' for x in cpu)}")
    say(f"largest difference {gap:.1e} (float64)")
    failed += [] if gap < 1e-9 else [f"the resumed losses differ from the CPU's by {gap:.1e}"]

    init_from_torchrun(device="cpu")                           # a world of one in memory, for load_model
    model = load_model(str(ckpt))[0].eval()                    # iteration 2, as the GPU saved it
    gpu = copy.deepcopy(model).to(DEVICE)
    tokenizer = build_tokenizer("byte")
    prompts = [tokenizer.encode("Pipeline parallel"), tokenizer.encode("The")]
    with torch.no_grad():
        tokens = {"cpu, cache": generate(model, prompts, 12)[0], f"{DEVICE}, cache": generate(gpu, prompts, 12)[0],
                  f"{DEVICE}, no cache": generate(gpu, prompts, 12, use_cache=False)[0]}
    for name, got in tokens.items():
        say(f"greedy tokens ({name}): {got}")
    failed += [] if len({str(t) for t in tokens.values()}) == 1 else ["the greedy tokens differ (above)"]
    try:
        import transformers
    except ImportError as exc:
        notes.append(f"transformers skipped ({type(exc).__name__})")
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(export_hf(ckpt, work / "hf")),
                                                               dtype=torch.float64).to(DEVICE).eval()
        ids = torch.tensor([prompts[0]], device=DEVICE)
        with torch.no_grad():
            theirs = hf(ids).logits                                                   # [1, s, V]
            ours = gpu(ids)[..., :theirs.shape[-1]]
            text = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        logit_gap, same = (theirs - ours).abs().max().item(), text[0, ids.shape[1]:].tolist() == tokens["cpu, cache"][0]
        say(f"transformers {transformers.__version__} {type(hf).__name__} on {DEVICE}: logits differ by "
            f"{logit_gap:.1e}; greedy generate {'the same tokens' if same else 'DIFFERENT: ' + str(text[0].tolist())}")
        # 1e-6, not float64's 1e-12: transformers builds RoPE's inverse frequencies in float32 (measured 4e-8 on the CPU)
        failed += [] if logit_gap < 1e-6 and same else ["transformers' logits or tokens differ (above)"]
    tail = "".join(f"; {note}" for note in notes)
    shutil.rmtree(work, ignore_errors=True)
    if failed:
        return "FAIL", "; ".join(failed) + tail
    return "PASS", (f"NCCL training resumed on the CPU under tp 2 = one CPU process ({gap:.0e}); greedy tokens "
                    f"equal with and without the cache, on {DEVICE} and the CPU" + ("" if notes else
                    ", and in transformers") + tail)


CHECK_FUNCTIONS = {"environment": check_environment, "kernels": check_kernels, "libraries": check_libraries,
                   "baseline": check_baseline, "multirank": check_multirank, "capstone": check_capstone}


# the parent: one process per check
def run_child(args) -> int:
    """Inside a check's own process: run it, write "STATUS<tab>reason" to args.verdict."""
    import minimegatron  # noqa: F401 - before any triton import (on a CUDA machine it sets nothing)
    try:
        status, why = CHECK_FUNCTIONS[args.child](args)
    except Exception as exc:                          # noqa: BLE001 - every failure becomes a FAIL line
        traceback.print_exc()
        status, why = "FAIL", short(exc)
    Path(args.verdict).write_text(f"{status}\t{why}")
    return 0


def run_check(name: str, limit: float, args) -> tuple[str, str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        verdict = Path(tmp) / "verdict"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--verdict", str(verdict),
               "--limit", str(limit)] + (["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else [])
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONUNBUFFERED": "1"}
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            code = None
        finally:                                          # the check and whatever it started (Ctrl-C too)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        seconds = time.monotonic() - start
        if code is None:
            return "FAIL", f"timed out after {limit:g} s (its output so far is above)", seconds
        if not verdict.exists():
            return "FAIL", f"its process exited with status {code} before a verdict (output above)", seconds
        status, _, why = verdict.read_text().partition("\t")
        return status, why, seconds


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="print the checks and exit (runs nothing)")
    p.add_argument("--only", nargs="+", choices=list(CHECKS), help="run these checks only")
    p.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak for MFU (default: PEAK_TFLOPS)")
    p.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for all checks (default {BUDGET_S})")
    p.add_argument("--child", choices=list(CHECKS), help=argparse.SUPPRESS)
    p.add_argument("--verdict", help=argparse.SUPPRESS)
    p.add_argument("--limit", type=float, default=240.0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for i, (name, (limit, what)) in enumerate(CHECKS.items(), 1):
            print(f"{i}. {name:<12} (at most {limit} s) {what}")
        print(f"The checks stop after {BUDGET_S} s together; each runs in a process of its own.")
        return 0
    if args.child:
        return run_child(args)
    why = no_gpu_reason()
    if why is not None:
        print(no_gpu_message(why))
        return 2
    deadline = time.monotonic() + args.budget
    verdicts = []
    for name, (limit, what) in CHECKS.items():
        if args.only and name not in args.only:
            continue
        left = deadline - time.monotonic()
        print(f"== {name}: {what}", flush=True)
        if left < 20:
            status, reason, seconds = "SKIP", f"out of time: {left:.0f} s of the {args.budget:.0f} s budget left", 0.0
        else:
            status, reason, seconds = run_check(name, min(limit, left), args)
        verdicts.append(status)
        print(f"{status} {name} ({seconds:.1f} s): {reason}", flush=True)
    counts = {s: verdicts.count(s) for s in ("PASS", "FAIL", "SKIP")}
    failed = counts["FAIL"] or any(v not in counts for v in verdicts)
    print(f"gpu_check: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
