"""The benchmarks still run (smoke size). Their speed is reported, never asserted."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script, args", [
    ("benchmarks/bench_baseline.py", ["--smoke"]),
    ("benchmarks/bench_ddp.py", ["--smoke", "--ranks", "1", "2"]),
    ("benchmarks/bench_ddp.py", ["--smoke", "--ranks", "2", "--variants", "zero1-overlap", "zero2-overlap"]),
    ("benchmarks/bench_tp.py", ["--smoke", "--tp", "1", "2"]),
    ("benchmarks/bench_precision.py", ["--smoke"]),
    ("benchmarks/bench_packing.py", ["--smoke"]),
    ("benchmarks/bench_case_study.py", ["--smoke", "--presets", "tiny"]),
    ("benchmarks/bench_overlap.py", ["--smoke"]),
    ("benchmarks/bench_generate.py", ["--smoke"]),
])
def test_benchmark_runs(script, args):
    proc = subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "tokens/s" in proc.stdout or "ms/step" in proc.stdout or "x the baseline" in proc.stdout


def test_bench_vs_hf_runs():
    """The comparison with Hugging Face transformers (an optional benchmark dependency)."""
    pytest.importorskip("transformers", reason="bench_vs_hf.py needs transformers: "
                                               "pip install -r requirements-bench.txt")
    proc = subprocess.run([sys.executable, "benchmarks/bench_vs_hf.py", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "tokens/s" in proc.stdout or "ms/step" in proc.stdout and "ratio minimegatron / transformers" in proc.stdout
    assert "attn_implementation='sdpa'" in proc.stdout     # each library as shipped


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU machine runs the check itself")
def test_the_transformer_engine_check_says_it_needs_a_gpu():
    """benchmarks/check_fp8_te.py (chapter 06) on a machine without CUDA: exit 2, saying why."""
    proc = subprocess.run([sys.executable, "benchmarks/check_fp8_te.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "needs a CUDA GPU with Transformer Engine: no CUDA device" in proc.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU machine runs it itself")
def test_the_kernels_in_the_model_on_a_gpu_say_they_need_one():
    proc = subprocess.run([sys.executable, "benchmarks/gpu_kernels_in_model.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "needs an NVIDIA GPU" in proc.stderr, proc.stdout + proc.stderr


GPU_CHECKS = ("environment", "kernels", "libraries", "baseline", "multirank", "capstone")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU machine runs the check itself")
def test_the_gpu_check_says_it_needs_a_gpu():
    """benchmarks/gpu_check.py (make gpu-check) without CUDA: exit 2 with one message naming the
    GPU and what it would check; where the machine has no NVIDIA driver, before importing torch."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "benchmarks/gpu_check.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    assert "needs an NVIDIA GPU with CUDA" in proc.stdout and "Nothing was checked" in proc.stdout
    assert len(proc.stdout.strip().splitlines()) == 1                   # one paragraph
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    if not gpu_check.nvidia_driver_present():
        imported = [line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
        assert "torch" not in imported and "minimegatron" not in imported


def test_the_gpu_check_lists_its_checks():
    """--list names every check, in order, and runs none (on any machine)."""
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--list"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for i, name in enumerate(GPU_CHECKS, 1):
        assert lines[i - 1].startswith(f"{i}. {name} "), proc.stdout


# The GPU runs' numbers quoted in benchmarks/README.md and chapter 08, each beside the line of the
# recorded log it comes from (CI has no GPU to rerun them; it checks the quotes against the logs).
GPU_QUOTES = {
    "benchmarks/gpu_runs/2026-11-28_h100_gpu_check.log": [
        ("worst error 2.9e-3 in bf16", "flash_attention documents b2 s1024 bfloat16      2.4e-03 2.9e-03"),
        ("1.8e-3 in float32", "flash_attention documents b2 s1024 float32       9.9e-04 1.6e-03 1.8e-03"),
        ("within 8.9e-16", "largest difference 8.9e-16 (float64)"),
        ("by 5.1e-8", "logits differ by 5.1e-08; greedy generate the same tokens"),
        ("165,819 tokens/s (49.4 ms a step, MFU 13.9%)", "median step 49.4 ms, 165,819 tokens/s"),
        ("fp32 at 41,730 (MFU 51.6%)", "41,730 tokens/s, 34.5 model TFLOP/s, MFU 51.6%"),
    ],
    "benchmarks/gpu_runs/2026-11-28_h200_bench_generate.log": [
        ("1251.1 tokens/s with the cache and 1185.7 without: 1.1x", "with / without: 1.1 x the tokens/s"),
        ("1251.1 tokens/s with the cache", "with the KV cache     1251.1 tokens/s"),
        ("and 1185.7 without", "without a cache       1185.7 tokens/s"),
        ("1040.9 tokens/s against 611.5, 1.7x", "with / without: 1.7 x the tokens/s"),
        ("1040.9 tokens/s against", "with the KV cache     1040.9 tokens/s"),
        ("against 611.5", "without a cache        611.5 tokens/s"),
        ("with a 50,331,648-byte cache", "the cache: 50,331,648 bytes = formula"),
    ],
}


def test_the_quoted_gpu_numbers_are_in_the_recorded_logs():
    import re
    readme = (ROOT / "benchmarks/README.md").read_text()
    chapter = (ROOT / "chapters/08_capstone/README.md").read_text()
    assert "within 8.9e-16 in float64" in chapter
    assert "the same shape gains only 1.1x" in chapter and "the cache gives 1.7x" in chapter
    for log, quotes in GPU_QUOTES.items():
        text = (ROOT / log).read_text()
        for quoted, recorded in quotes:
            assert quoted in readme, quoted
            assert recorded in text, recorded
        if "gpu_check" in log:
            assert "gpu_check: 6 PASS, 0 FAIL, 0 SKIP" in text
            total = sum(float(x) for x in re.findall(r"^PASS \w+ \(([\d.]+) s\)", text, re.M))
            assert f"all six checks PASS in {round(total)} s" in readme, total      # the sum of the checks' times
        else:
            assert text.count("; the same tokens") == 2                            # both runs agreed
