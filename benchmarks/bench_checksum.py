"""What the checkpoint checksums cost a save (and a load): checkpoint.with_checksums and
verify_checksums around torch.save / torch.load of a training checkpoint's state.

    .venv/bin/python benchmarks/bench_checksum.py                 # 16, 64 and 256 MiB of state
    .venv/bin/python benchmarks/bench_checksum.py --mib 1024      # other sizes
    .venv/bin/python benchmarks/bench_checksum.py --smoke         # 1 MiB, one window: checks that it runs

The state is what a one-process save writes (resume.save_state): the parameters, AdamW's two
moments (so 3 float32 tensors per parameter), a loss history and the configs, with the
tensors shaped as a LLaMA-style model's (per layer: qkv, proj, fc1, fc2, two norms). Each
row times, best of --repeats windows, interleaved so that a busy moment of the machine hits
every variant:

  save           torch.save of the state to a file in --dir (the page cache: no fsync)
  + crc32        checkpoint.with_checksums (CRC-32 of every tensor and of the rest), then the save
  + sha256       the same with hashlib.sha256 (what the book does not use: checkpoint.checksums says why)
  load / verify  torch.load(weights_only=True), and checkpoint.verify_checksums of what it loaded

Measurements, not tests: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minimegatron.checkpoint import _leaves, verify_checksums, with_checksums  # noqa: E402


def state_of(mib: float) -> dict:
    """A checkpoint state of about `mib` MiB: layers of a LLaMA-style model of hidden size h
    (qkv 3h x h, proj h x h, fc1 2f x h, fc2 h x f, two norms, f = 8h/3) as parameters and two
    AdamW moments, with as many layers as reach the size."""
    h = 256 if mib < 64 else 512
    f = (8 * h // 3 + 7) // 8 * 8
    shapes = [(3 * h, h), (h, h), (2 * f, h), (h, f), (h,), (h,)]
    per_layer = 3 * 4 * sum(torch.Size(s).numel() for s in shapes)          # 3 float32 tensors each
    layers = max(1, round(mib * 2 ** 20 / per_layer))
    gen = torch.Generator().manual_seed(0)
    params = {f"layer{i}.{j}": torch.randn(s, generator=gen) for i in range(layers) for j, s in enumerate(shapes)}
    return {"model": params,
            "optimizer": {"exp_avg": {k: torch.randn_like(v) for k, v in params.items()},
                          "exp_avg_sq": {k: torch.rand_like(v) for k, v in params.items()}},
            "history": {"losses": [5.0 - 0.01 * i for i in range(1000)]}, "train_config": {"lr": 3e-3}}


def sha256_sums(state: dict) -> dict:
    return {path: hashlib.sha256(v.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
            for path, v in _leaves(state) if isinstance(v, torch.Tensor)}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, nargs="+", default=[16, 64, 256], help="state sizes, MiB")
    parser.add_argument("--repeats", type=int, default=5, help="windows per variant (the best is shown)")
    parser.add_argument("--dir", default=None, help="where the files go [default: a temporary directory]")
    parser.add_argument("--smoke", action="store_true", help="1 MiB, one window")
    args = parser.parse_args(argv)
    if args.smoke:
        args.mib, args.repeats = [1], 1
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "iter.pt"
        print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, files in {tmp}; best of {args.repeats} windows")
        print("| state MiB | save s | + crc32 s | crc32 cost | + sha256 s | sha256 cost | load s | verify s |")
        print("|---|---|---|---|---|---|---|---|")
        for mib in args.mib:
            state = state_of(mib)
            size = sum(v.numel() * v.element_size() for _, v in _leaves(state) if isinstance(v, torch.Tensor))
            best = {k: float("inf") for k in ("save", "crc", "sha", "load", "verify")}
            for _ in range(args.repeats):
                best["save"] = min(best["save"], timed(lambda: torch.save(state, path)))
                best["crc"] = min(best["crc"], timed(lambda: torch.save(with_checksums(state), path)))
                best["sha"] = min(best["sha"], timed(lambda: torch.save({**state, "sha": sha256_sums(state)}, path)))
                torch.save(with_checksums(state), path)
                loaded = {}
                best["load"] = min(best["load"], timed(lambda: loaded.update(torch.load(path, weights_only=True))))
                best["verify"] = min(best["verify"], timed(lambda: verify_checksums(loaded, path)))
            save = best["save"]
            print(f"| {size / 2 ** 20:,.0f} | {save:.3f} | {best['crc']:.3f} | {best['crc'] / save - 1:+.0%} | "
                  f"{best['sha']:.3f} | {best['sha'] / save - 1:+.0%} | {best['load']:.3f} | {best['verify']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
