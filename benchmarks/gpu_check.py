"""The book's check on one NVIDIA GPU: what the CPU path cannot show, in under 10 minutes.

    .venv/bin/python benchmarks/gpu_check.py                  # make gpu-check: every check, in order
    .venv/bin/python benchmarks/gpu_check.py --list           # name the checks, run nothing (any machine)
    .venv/bin/python benchmarks/gpu_check.py --only kernels baseline --peak-tflops 989

Five checks, in this order, each in a Python process of its own with its own time limit (a
hung kernel, or a CUDA error that poisons a process, ends that check only), each printing its
numbers, then one line: PASS, FAIL or SKIP, the check's name, and the reason.

  environment  torch, CUDA, the device's name, capability and memory; whether triton, flash_attn
               and transformer_engine import (the last two optional: requirements-gpu.txt).
  kernels      chapter 07's Triton kernels (flash_attention, rms_norm, swiglu,
               linear_cross_entropy) compiled for the GPU, not the interpreter (TRITON_INTERPRET
               is removed from the checks' environment), against the book's PyTorch functions
               evaluated in float64 on the same inputs: forward and gradients, float32 and bf16
               inputs. Error: max |x - ref| / max |ref| per tensor. Tolerances (TOLERANCE): 1e-4
               for float32, 1e-2 for float32 attention (Triton's tl.dot rounds float32 to TF32),
               2e-2 for bf16 (outputs round to bf16).
  libraries    bf16 attention at s 2048, d 128 against the book's naive attention in float64: the
               naive one and SDPA in bf16 (the yardsticks), the book's Triton FlashAttention and
               flash_attn's flash_attn_func (if it imports); Transformer Engine's RMSNorm and
               LayerNorm (if it imports) against the book's, in bf16. SKIPped parts are named.
  baseline     the single-device training step (build_model, build_optimizer, train.train_step,
               TrainConfig(device="cuda")): 3 steps of a small LLaMA-style GPTModel in float64 on
               CUDA equal to the same steps on the CPU (testing.compare_runs: MATCH); then tokens/s
               and MFU of a larger one (h 1024, 8 layers, s 1024, b 8, V 32000) in bf16 and fp32.
               MFU = analysis.training_flops per step / step time / the peak of PEAK_TFLOPS (or
               --peak-tflops, for bf16); reported, never judged.
  multirank    2 gloo ranks started by the book's launcher (launch.spawn), TrainConfig(device=
               "cuda"), both on GPU 0: dp 2, then tp 2, 3 steps in float64 through
               testing.train_layout against the single-device run on the CPU: MATCH. (The
               training CLI's --device cuda means NCCL with one GPU per rank, which two ranks
               on one GPU cannot use, hence spawn.)

Exit status: 0 when CUDA is present and no check failed (a SKIP is no failure); 1 when one did;
2 when there is no usable CUDA device: the script says so and what it would check, before it
imports torch where the machine has no NVIDIA driver at all. The checks together stop after
--budget seconds (570); one that would start with under 20 s left is SKIPped.

Not yet run on a GPU by the session that wrote it (none was lent to it): its first run on one
is its test.
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
    "kernels": (240, "the Triton kernels compiled for CUDA against their PyTorch references: forward and gradients, "
                     "float32 and bf16"),
    "libraries": (180, "flash_attn and the book's Triton FlashAttention against naive attention and SDPA (bf16); "
                       "Transformer Engine's RMSNorm/LayerNorm against the book's"),
    "baseline": (240, "the single-device train step on CUDA equal to the CPU's (float64); tokens/s and MFU, bf16 and fp32"),
    "multirank": (240, "2 gloo ranks with CUDA tensors sharing the GPU (launch.spawn; dp 2, tp 2) against the "
                       "single-device run: MATCH"),
}
BUDGET_S = 570
# Dense peak TFLOP/s (no 2:4 sparsity: the datasheets print bf16 with sparsity, twice these), from
# NVIDIA's datasheets "H100 Tensor Core GPU" (SXM, NVL, PCIe), "H200 Tensor Core GPU" (SXM, NVL) and
# "A100 Tensor Core GPU". fp32: the CUDA cores' FP32 rate (torch's float32 matmuls use no TF32 by default).
PEAK_TFLOPS = [   # (part of torch.cuda.get_device_name(), bf16, fp32): the first match wins
    ("H100 NVL", 835.5, 60.0), ("H100 PCIe", 756.5, 51.2), ("H100", 989.4, 66.9),
    ("H200 NVL", 835.5, 60.0), ("H200", 989.4, 66.9), ("A100", 312.0, 19.5),
]
TOLERANCE = {"float32": 1e-4, "float32 attention": 1e-2, "bfloat16": 2e-2}
EPS = 1e-5
# the sizes: attention (b, a, g, s, d); the norms' and SwiGLU's rows x h; the loss's tokens, h, V
SIZES = dict(attention=(2, 8, 2, 1024, 64), rows=4096, hidden=1024, tokens=4096, ce_hidden=1024, vocab=32000,
             lib_attention=(2, 8, 2, 2048, 128), equal=(128, 2, 128, 4), speed=(1024, 8, 1024, 8, 32000),
             rank=(64, 2, 32))
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
            "single-device training step on CUDA against the CPU, with its tokens/s and MFU; and two gloo ranks "
            "sharing the GPU against one device. Nothing was checked (--list names the checks).")


# ---------------------------------------------------------------------------------------
# helpers, inside a check's process
# ---------------------------------------------------------------------------------------
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


def against_float64(fn, ref_fn, inputs, dout) -> list[float]:
    """The errors of fn's output and input gradients against ref_fn's in float64, same inputs."""
    got = with_grads(fn, inputs, dout)
    ref = with_grads(ref_fn, [t.double() for t in inputs], dout.double())
    return [err(g, r) for g, r in zip(got, ref)]


def naive_attention(q, k, v):
    """The book's written-out attention (exercise 0.1), k and v repeated to q's heads (GQA)."""
    from minimegatron.model.attention import causal_attention
    r = q.shape[1] // k.shape[1]
    return causal_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1))


def attention_inputs(b, a, g, s, d, dtype):
    import torch
    q, k, v, dout = (torch.randn(b, n, s, d, device=DEVICE).to(dtype) for n in (a, g, g, a))
    return [q, k, v], dout


def book_norm(kind: str):
    """The book's RMSNorm or LayerNorm (model/linear.py) as a function of (x, weight[, bias])."""
    from torch.func import functional_call
    from minimegatron.model.linear import LayerNorm, RMSNorm

    def norm(x, w, b=None):
        module = (RMSNorm if kind == "RMSNorm" else LayerNorm)(x.shape[-1], EPS)
        return functional_call(module, {"weight": w} | ({"bias": b} if b is not None else {}), (x,))
    return norm


# ---------------------------------------------------------------------------------------
# the checks: each returns (status, reason)
# ---------------------------------------------------------------------------------------
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
    product = (x.to(DEVICE) @ x.to(DEVICE)).cpu()
    say(f"a float64 matmul on the GPU against the CPU's: max error {err(product, x @ x):.1e}; "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}")
    libs = ", ".join(f"{m} {v}" if v else f"{m} missing" for m, v in found.items())
    return "PASS", f"{props.name} (capability {props.major}.{props.minor}), torch {torch.__version__}; {libs}"


def check_kernels(args):
    import torch
    import triton
    from minimegatron.kernels.cross_entropy import linear_cross_entropy
    from minimegatron.kernels.flash_attention import flash_attention
    from minimegatron.kernels.rmsnorm import rms_norm
    from minimegatron.kernels.swiglu import swiglu
    from minimegatron.model.gpt import language_model_loss
    from minimegatron.model.mlp import mlp_activation
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "FAIL", "TRITON_INTERPRET=1: the kernels would run in Triton's interpreter, not compiled"
    torch.manual_seed(0)
    (b, a, g, s, d), n, h = SIZES["attention"], SIZES["rows"], SIZES["hidden"]
    t, hc, vocab = SIZES["tokens"], SIZES["ce_hidden"], SIZES["vocab"]
    say(f"triton {triton.__version__}, compiled for {DEVICE} (TRITON_INTERPRET unset); error = max|x - ref| / "
        "max|ref| against the book's PyTorch in float64 on the same inputs, [output, input gradients]")
    worst, failed = 0.0, []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        cases = {}
        qkv, dout = attention_inputs(b, a, g, s, d, dtype)
        cases[f"flash_attention b{b} a{a} g{g} s{s} d{d}"] = (flash_attention, naive_attention, qkv, dout)
        x, w = torch.randn(n, h, device=DEVICE).to(dtype), (1 + 0.1 * torch.randn(h, device=DEVICE)).to(dtype)
        cases[f"rms_norm {n}x{h}"] = (lambda x, w: rms_norm(x, w, EPS), book_norm("RMSNorm"), [x, w],
                                      torch.randn(n, h, device=DEVICE).to(dtype))
        cases[f"swiglu {n}x2*{h}"] = (swiglu, lambda y: mlp_activation(y, swiglu=True),
                                      [torch.randn(n, 2 * h, device=DEVICE).to(dtype)],
                                      torch.randn(n, h, device=DEVICE).to(dtype))
        labels = torch.randint(0, vocab, (t,), device=DEVICE)
        cases[f"linear_cross_entropy T{t} h{hc} V{vocab}"] = (
            lambda x, w: linear_cross_entropy(x, w, labels),
            lambda x, w: language_model_loss((x @ w.t())[None], labels[None])[0],
            [torch.randn(t, hc, device=DEVICE).to(dtype), (0.02 * torch.randn(vocab, hc, device=DEVICE)).to(dtype)],
            torch.rand(t, device=DEVICE) / t)
        for case, (fn, ref_fn, inputs, grad) in cases.items():
            errors = against_float64(fn, ref_fn, inputs, grad)
            tol = TOLERANCE[name + (" attention" if case.startswith("flash") and name == "float32" else "")]
            ok = max(errors) <= tol
            worst = max(worst, max(errors))
            failed += [] if ok else [f"{case} {name}"]
            say(f"{'ok ' if ok else 'BAD'} {case:<40} {name:<8} errors " + " ".join(f"{e:.1e}" for e in errors)
                + f"  (tolerance {tol:.0e})")
    if failed:
        return "FAIL", "out of tolerance: " + "; ".join(failed)
    return "PASS", f"4 kernels x float32, bf16 on {torch.cuda.get_device_name()}: worst error {worst:.1e}"


def check_libraries(args):
    import torch
    from minimegatron.kernels.flash_attention import flash_attention
    from minimegatron.model.attention import sdpa_attention
    torch.manual_seed(0)
    b, a, g, s, d = SIZES["lib_attention"]
    qkv, dout = attention_inputs(b, a, g, s, d, torch.bfloat16)
    candidates = {"naive (book, bf16)": naive_attention, "sdpa (book, bf16)": sdpa_attention,
                  "Triton FlashAttention (book)": flash_attention}
    notes, failed, tol = [], [], TOLERANCE["bfloat16"]
    try:
        from flash_attn import flash_attn_func
        candidates["flash_attn.flash_attn_func"] = lambda q, k, v: flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2)
    except Exception as exc:                          # noqa: BLE001
        notes.append(f"flash_attn skipped ({type(exc).__name__})")
    say(f"attention b{b} a{a} g{g} s{s} d{d}, bf16, against the naive attention in float64: errors "
        "[out, dq, dk, dv]")
    for name, fn in candidates.items():
        try:
            errors = against_float64(fn, naive_attention, qkv, dout)
        except Exception as exc:                      # noqa: BLE001 - one candidate's failure, named
            failed.append(f"{name}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        failed += [] if max(errors) <= tol else [f"{name} error {max(errors):.1e}"]
        say(f"{name:<30} " + " ".join(f"{e:.1e}" for e in errors) + f"  (tolerance {tol:.0e})")
    try:
        import transformer_engine.pytorch as te
    except Exception as exc:                          # noqa: BLE001
        te = None
        notes.append(f"transformer_engine skipped ({type(exc).__name__})")
    if te is not None:
        n, h = SIZES["rows"], SIZES["hidden"]
        for kind in ("RMSNorm", "LayerNorm"):
            try:
                theirs = getattr(te, kind)(h, eps=EPS, params_dtype=torch.bfloat16).to(DEVICE)
                params = [(1 + 0.1 * torch.randn(h, device=DEVICE)).bfloat16()]
                params += [(0.1 * torch.randn(h, device=DEVICE)).bfloat16()] if kind == "LayerNorm" else []
                with torch.no_grad():
                    for name, p in zip(("weight", "bias"), params):
                        getattr(theirs, name).copy_(p)
                x, dy = torch.randn(n, h, device=DEVICE).bfloat16(), torch.randn(n, h, device=DEVICE).bfloat16()
                leaf = x.clone().requires_grad_(True)
                y = theirs(leaf)
                mine = [getattr(theirs, attr) for attr in ("weight", "bias")[:len(params)]]
                te_out = [y.detach(), *torch.autograd.grad(y, [leaf, *mine], dy)]
                ref = with_grads(book_norm(kind), [x.double(), *(p.double() for p in params)], dy.double())
                book = with_grads(book_norm(kind), [x, *params], dy)
                for label, got in ((f"te.{kind}", te_out), (f"book {kind} (bf16)", book)):
                    errors = [err(g, r) for g, r in zip(got, ref)]
                    failed += [] if max(errors) <= tol else [f"{label} error {max(errors):.1e}"]
                    say(f"{label:<30} {n}x{h} errors [y, dx, dw{', db' if params[1:] else ''}] "
                        + " ".join(f"{e:.1e}" for e in errors) + f"  (tolerance {tol:.0e})")
            except Exception as exc:                  # noqa: BLE001
                failed.append(f"te.{kind}: {type(exc).__name__}: {str(exc)[:120]}")
    tail = f"; {'; '.join(notes)}" if notes else ""
    if failed:
        return "FAIL", "; ".join(failed) + tail
    return "PASS", f"{len(candidates)} attention implementations{' and TE norms' if te else ''} within {tol:.0e}{tail}"


def run_steps(model_cfg, cfg, batches):
    """The book's single-device training (build_model, build_optimizer, train_step on Layout(),
    on cfg.device) over one batch per step: a testing.RunRecord."""
    from minimegatron.optim import learning_rate
    from minimegatron.parallel_state import Layout
    from minimegatron.parallelize import build_model, build_optimizer, full_model_tensors
    from minimegatron.testing import RunRecord
    from minimegatron.train import train_step
    layout = Layout()
    chunks = build_model(model_cfg, cfg, layout)
    optimizer = build_optimizer(chunks, cfg, layout)
    losses, grads = [], {}
    for step, batch in enumerate(batches):
        keep = lambda: grads or grads.update(full_model_tensors(chunks, layout, grads=True))   # noqa: E731
        batch = {k: v.to(cfg.device) for k, v in batch.items()}
        losses.append(train_step(chunks, optimizer, [batch], layout, learning_rate(step, cfg), on_grads=keep)[0])
    return RunRecord(losses, {n: g.cpu() for n, g in grads.items()},
                     {n: p.detach().cpu() for n, p in full_model_tensors(chunks, layout).items()})


def check_baseline(args):
    import torch
    from minimegatron.analysis import training_flops
    from minimegatron.config import ModelConfig, TrainConfig
    from minimegatron.testing import compare_runs, make_batches
    h, layers, s, b = SIZES["equal"]
    model_cfg = ModelConfig.llama(hidden_size=h, num_layers=layers, num_attention_heads=4, num_query_groups=2,
                                  max_position_embeddings=s, params_dtype="float64")
    batches = make_batches(model_cfg, 3, b, s)
    runs = {dev: run_steps(model_cfg, TrainConfig(seq_length=s, micro_batch_size=b, train_iters=3, lr_warmup_iters=0,
                                                  clip_grad=1.0, device=dev, progress=False),
                           batches) for dev in ("cpu", DEVICE)}
    report = compare_runs(runs["cpu"], runs[DEVICE], torch.float64)
    say(f"LLaMA h{h} L{layers} s{s} b{b} float64, 3 steps, {DEVICE} against cpu: losses "
        + " ".join(f"{x:.6f}" for x in runs[DEVICE].losses))
    for line in str(report).splitlines():
        say(line)
    name = torch.cuda.get_device_name()
    peaks = next(((bf, fp) for key, bf, fp in PEAK_TFLOPS if key.lower() in name.lower()), (None, None))
    peaks = (args.peak_tflops or peaks[0], peaks[1])
    h, layers, s, b, vocab = SIZES["speed"]
    speeds = []
    for precision, dtype, peak in (("bf16", "bfloat16", peaks[0]), ("fp32", "float32", peaks[1])):
        cfg = ModelConfig.llama(hidden_size=h, num_layers=layers, num_attention_heads=16, num_query_groups=4,
                                max_position_embeddings=s, vocab_size=vocab, params_dtype=dtype)
        train_cfg = TrainConfig(seq_length=s, micro_batch_size=b, train_iters=100, clip_grad=1.0,
                                bf16=precision == "bf16", device=DEVICE, progress=False)
        from minimegatron.parallel_state import Layout
        from minimegatron.parallelize import build_model, build_optimizer
        from minimegatron.train import train_step
        chunks = build_model(cfg, train_cfg, Layout())
        optimizer = build_optimizer(chunks, train_cfg, Layout())
        batch = {k: v.to(DEVICE) for k, v in make_batches(cfg, 1, b, s)[0].items()}
        times = []
        for i in range(13):                                  # 3 warm-up steps, then 10 timed
            torch.cuda.synchronize()
            start = time.perf_counter()
            train_step(chunks, optimizer, [batch], Layout(), train_cfg.lr)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        step = sorted(times[3:])[len(times[3:]) // 2]        # the median step
        flops = training_flops(cfg, b, s)["total"]
        mfu = f"MFU {flops / step / (peak * 1e12):.1%} of {peak:g} TFLOP/s" if peak else "MFU: peak unknown (--peak-tflops)"
        speeds.append(f"{precision} {b * s / step:,.0f} tokens/s")
        say(f"{precision}: LLaMA h{h} L{layers} V{vocab} s{s} b{b}: median step {step * 1e3:.1f} ms, "
            f"{b * s / step:,.0f} tokens/s, model {flops / step / 1e12:.1f} TFLOP/s, {mfu}")
        del chunks, optimizer
        torch.cuda.empty_cache()
    say("MFU counts analysis.training_flops (matmuls only, attention over all s^2 scores as the written-out "
        "attention computes them; a causal kernel does about half), not the optimizer")
    if not report.ok:
        return "FAIL", f"the CUDA run differs from the CPU's: {'; '.join(report.problems[:3])}"
    return "PASS", (f"CUDA = CPU in float64 (loss diff {report.max_loss_diff:.1e}, params {report.max_param_diff:.1e}); "
                    + ", ".join(speeds))


def _rank_worker(model_cfg, cfgs, dps, batches):
    """On each spawned rank: every layout of `cfgs` through testing.train_layout (on GPU 0 for cuda)."""
    import torch
    from minimegatron.testing import train_layout
    out = []
    for cfg, dp, steps in zip(cfgs, dps, batches):
        if cfg.device == "cuda":
            torch.cuda.set_device(0)                          # both ranks on the one GPU
        record = train_layout(model_cfg, cfg, dp, [{k: v.to(cfg.device) for k, v in b.items()} for b in steps])[0]
        out.append({k: record[k] for k in ("losses", "grads", "params")})
    return out


def check_multirank(args):
    import dataclasses
    import torch
    from minimegatron.config import ModelConfig, TrainConfig
    from minimegatron.launch import spawn
    from minimegatron.testing import RunRecord, compare_runs, make_batches, one_device_config, single_device_run
    h, layers, s = SIZES["rank"]
    model_cfg = ModelConfig.llama(hidden_size=h, num_layers=layers, num_attention_heads=4, num_query_groups=2,
                                  max_position_embeddings=s, params_dtype="float64")
    base = TrainConfig(seq_length=s, micro_batch_size=2, grad_accum_steps=2, train_iters=3, lr_warmup_iters=0,
                       clip_grad=0.05, device=DEVICE, progress=False)
    layouts = {"dp 2": (1, 2), "tp 2": (2, 1)}                # name -> (tp, dp)
    cfgs = [dataclasses.replace(base, tensor_model_parallel_size=tp) for tp, _ in layouts.values()]
    dps = [dp for _, dp in layouts.values()]
    batches = [make_batches(model_cfg, 3, 2 * 2 * dp, s) for dp in dps]
    results = spawn(_rank_worker, 2, model_cfg, cfgs, dps, batches, timeout=max(30.0, args.limit - 40))[0]
    failed = []
    for (name, (tp, dp)), cfg, steps, got in zip(layouts.items(), cfgs, batches, results):
        one = dataclasses.replace(one_device_config(cfg), device="cpu")
        reference = single_device_run(model_cfg, steps, one, grad_accum_steps=cfg.grad_accum_steps * dp)
        report = compare_runs(reference, RunRecord(got["losses"], got["grads"], got["params"]), torch.float64)
        say(f"{name} (2 gloo ranks, CUDA tensors on GPU 0) against one process on the CPU, LLaMA h{h} L{layers} "
            f"s{s}, 3 steps:")
        for line in str(report).splitlines():
            say("  " + line)
        failed += [] if report.ok else [name]
    if failed:
        return "FAIL", "MISMATCH: " + ", ".join(failed)
    return "PASS", "MATCH: " + ", ".join(layouts) + " on 2 gloo ranks sharing the GPU equal the single-device run"


CHECK_FUNCTIONS = {"environment": check_environment, "kernels": check_kernels, "libraries": check_libraries,
                   "baseline": check_baseline, "multirank": check_multirank}


# ---------------------------------------------------------------------------------------
# the parent: one process per check
# ---------------------------------------------------------------------------------------
def run_child(args) -> int:
    """Inside a check's own process: run it, write "STATUS<tab>reason" to args.verdict."""
    import minimegatron  # noqa: F401  (before any triton import; on a CUDA machine it sets nothing)
    try:
        status, why = CHECK_FUNCTIONS[args.child](args)
    except Exception as exc:                          # noqa: BLE001 - every failure becomes a FAIL line
        traceback.print_exc()
        status, why = "FAIL", f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc) else ''}"
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
            os.killpg(proc.pid, signal.SIGKILL)           # the check and whatever it started
            proc.wait()
            return "FAIL", f"timed out after {limit:.0f} s (its output so far is above)", time.monotonic() - start
        seconds = time.monotonic() - start
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
