"""Tokens per second of generation, with and without the KV cache (chapter 08).

    python benchmarks/bench_generate.py                 # the demo preset's shape, 4 prompts, 16 + 256 tokens
    python benchmarks/bench_generate.py --smoke         # tiny, a second
    python benchmarks/bench_generate.py --device cuda --hidden-size 2048 --num-layers 16 --batch 8 --prompt 128

The model is the book's LLaMA-style GPTModel at the `--preset demo` shape with its initial
weights (the speed does not depend on what was learned), float32, one thread. Greedy decoding
of --new tokens after a prompt of --prompt tokens, for --batch prompts, through
minimegatron.generate.generate: with the cache (one new position a step after the prompt's one
pass) and without (the whole sequence again every step). Both produce the same tokens, which the
script checks. Timing: --repeats runs of each, interleaved; the best. Also printed: the cache's
bytes against 2 L b (P + N) g d e. A measurement, not a test: nothing here asserts a speed.
On a GPU (--device cuda) each run is timed between torch.cuda.synchronize() calls, and the
tokens are compared rather than asserted equal: from random weights the logits are nearly
flat, and the GPU's kernels for one position and for the whole sequence may break a near-tie
differently.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shlex
import sys
import time
from datetime import datetime, timezone

import torch

from minimegatron.arguments import PRESETS
from minimegatron.config import ModelConfig
from minimegatron.generate import generate, kv_cache_bytes
from minimegatron.model import GPTModel
from machine import cpu_model, load_average  # benchmarks/machine.py


@dataclasses.dataclass
class GenerateBench:
    exit_code: int = 0
    tokens_per_s: dict = dataclasses.field(default_factory=dict)   # "cached", "uncached": as printed (1 decimal)
    positions: dict = dataclasses.field(default_factory=dict)      # "cached", "uncached": positions run
    cache_bytes: int = 0
    cache_formula: int = 0
    speedup: float = 0.0                                           # with / without, as printed (1 decimal)


def main(argv: list[str] | None = None) -> GenerateBench:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=16, help="P, prompt tokens (default 16)")
    p.add_argument("--new", type=int, default=256, help="N, new tokens (default 256)")
    p.add_argument("--batch", type=int, default=4, help="b, prompts (default 4)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each, interleaved (default 3)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one run")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--hidden-size", type=int, help="h (default: the demo preset's); heads h / 128, groups a / 4")
    p.add_argument("--num-layers", type=int, help="L (default: the demo preset's)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    preset = dict(PRESETS["demo"][0]) if not args.smoke else dict(hidden_size=32, num_layers=2, num_attention_heads=4)
    if args.hidden_size:
        heads = max(1, args.hidden_size // 128)
        preset.update(hidden_size=args.hidden_size, num_attention_heads=heads, num_query_groups=max(1, heads // 4))
    if args.num_layers:
        preset["num_layers"] = args.num_layers
    if args.smoke:
        args.prompt, args.new, args.batch, args.repeats = 4, 8, 2, 1
    preset["max_position_embeddings"] = args.prompt + args.new
    cfg = ModelConfig.llama(**preset).validate()
    model = GPTModel(cfg).to(args.device).eval()
    cuda = args.device.startswith("cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(args.batch)]
    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    print(f"command: {cmd}")
    where = (f"GPU: {torch.cuda.get_device_name()}" if cuda else
             f"CPU: {cpu_model()}, {os.cpu_count()} cores, one thread; load {load_average()}")
    print(f"date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; torch {torch.__version__}, python "
          f"{platform.python_version()}, {where}")
    print(f"model: LLaMA style h={cfg.hidden_size} L={cfg.num_layers} a={cfg.num_attention_heads} g={cfg.query_groups} "
          f"V={cfg.vocab_size}, float32; {args.batch} prompts of {args.prompt} tokens, {args.new} new tokens each, greedy")
    best, out = {}, {}
    for _ in range(args.repeats):
        for cached in (True, False):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            tokens, info = generate(model, prompts, args.new, use_cache=cached)
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            best[cached] = min(best.get(cached, float("inf")), seconds)
            out[cached] = (tokens, info)
    same = sum(a == b for x, y in zip(out[True][0], out[False][0]) for a, b in zip(x, y))
    if not cuda:
        assert out[True][0] == out[False][0], "the cache changed the tokens"
    count, got = args.batch * args.new, GenerateBench()
    for cached in (True, False):
        info = out[cached][1]
        key = "cached" if cached else "uncached"
        got.tokens_per_s[key], got.positions[key] = round(count / best[cached], 1), info["positions"]
        print(f"  {'with the KV cache' if cached else 'without a cache':<18} {count / best[cached]:9.1f} tokens/s "
              f"({best[cached]:.2f} s), {info['positions']:,} positions run")
    got.cache_formula = kv_cache_bytes(cfg.num_layers, args.batch, args.prompt + args.new, cfg.query_groups,
                                       cfg.kv_channels, 4)
    got.cache_bytes = out[True][1]["kv_cache_bytes"]
    print(f"the cache: {got.cache_bytes:,} bytes = formula 2 L b (P + N) g d e = {got.cache_formula:,}"
          if got.cache_bytes == got.cache_formula else "the cache's bytes differ from the formula")
    agree = "the same tokens" if same == count else f"{same} of {count} tokens the same (near-ties, see the docstring)"
    got.speedup = round(best[False] / best[True], 1)
    print(f"with / without: {best[False] / best[True]:.1f} x the tokens/s; {agree}")
    return got


if __name__ == "__main__":
    sys.exit(main().exit_code)
