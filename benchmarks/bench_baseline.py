"""Tokens per second of one baseline training step on the CPU, next to plain PyTorch.

    python benchmarks/bench_baseline.py                       # both styles, default sizes
    python benchmarks/bench_baseline.py --threads 1           # pin the intra-op thread count
    python benchmarks/bench_baseline.py --styles llama --repeats 5
    python benchmarks/bench_baseline.py --smoke               # tiny sizes, one short window

A "step" is what `minimegatron.train` does for one global batch: forward, loss, backward,
gradient clipping, AdamW step, zero_grad. Three implementations of the same network run it:

  ours/naive   minimegatron's GPTModel, attention written out (the [b, a, s, s] score matrix
               is materialized, masked, soft-maxed and kept for the backward pass)
  ours/sdpa    the same model with attention_backend="sdpa" (PyTorch's fused kernel; the default
               since issue 11, what `minimegatron.train` runs)
  reference    the model written the obvious way in plain PyTorch: nn.MultiheadAttention (GPT-2)
               or F.scaled_dot_product_attention with enable_gqa (LLaMA), nn.LayerNorm /
               nn.RMSNorm, nn.Linear, GELU / SwiGLU

Before timing, the reference is loaded with our initial weights and the three initial losses
are printed on the same batch, with the parameter counts, so the reader sees that the rows
compute the same function with the same number of parameters. Timing: `--warmup` untimed steps, then `--repeats` timed windows of
`--steps` steps each, the implementations interleaved window by window (so a slow moment of a
shared machine hurts all of them alike). Reported per implementation: tokens/s of the best,
median and worst window. On a machine shared with other work, other processes can only make a
window slower, so the best window is the closest estimate of the uncontended speed (the
convention of Python's `timeit`); the median shows what a typical window got.

This is a measurement, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import math
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.model import GPTModel
from minimegatron.optim import Optimizer
from minimegatron.parallel_state import Layout
from minimegatron.train import train_step
from machine import cpu_model  # benchmarks/machine.py


# ---------------------------------------------------------------------------------------
# the plain-PyTorch references
# ---------------------------------------------------------------------------------------
class RefGPT2Block(nn.Module):
    def __init__(self, h: int, a: int, f: int, eps: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(h, eps=eps)
        self.attn = nn.MultiheadAttention(h, a, bias=True, batch_first=True)
        self.ln2 = nn.LayerNorm(h, eps=eps)
        self.fc1 = nn.Linear(h, f)
        self.fc2 = nn.Linear(f, h)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        x = x + self.attn(y, y, y, attn_mask=mask, is_causal=True, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class RefGPT2(nn.Module):
    """GPT-2: learned positions, LayerNorm, GELU, biases, output layer tied to the embedding."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.wte = nn.Embedding(cfg.vocab_size, h)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, h)
        self.blocks = nn.ModuleList(RefGPT2Block(h, cfg.num_attention_heads, cfg.ffn_size, cfg.layernorm_epsilon)
                                    for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(h, eps=cfg.layernorm_epsilon)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)        # True = may not attend
        x = self.wte(tokens) + self.wpe(torch.arange(s))
        for block in self.blocks:
            x = block(x, mask)
        return self.ln_f(x) @ self.wte.weight.t()                # [b, s, V]


class RefLlamaBlock(nn.Module):
    def __init__(self, h: int, a: int, g: int, f: int, eps: float):
        super().__init__()
        d = h // a
        self.a, self.g, self.d = a, g, d
        self.norm1 = nn.RMSNorm(h, eps=eps)
        self.q = nn.Linear(h, a * d, bias=False)
        self.k = nn.Linear(h, g * d, bias=False)
        self.v = nn.Linear(h, g * d, bias=False)
        self.o = nn.Linear(a * d, h, bias=False)
        self.norm2 = nn.RMSNorm(h, eps=eps)
        self.gate = nn.Linear(h, f, bias=False)
        self.up = nn.Linear(h, f, bias=False)
        self.down = nn.Linear(f, h, bias=False)

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.norm1(x)
        q = self.q(y).view(b, s, self.a, self.d).transpose(1, 2)
        k = self.k(y).view(b, s, self.g, self.d).transpose(1, 2)
        v = self.v(y).view(b, s, self.g, self.d).transpose(1, 2)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.g != self.a)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, self.a * self.d))
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class RefLlama(nn.Module):
    """LLaMA: RoPE, RMSNorm, SwiGLU, GQA, no biases, untied output layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.kv_channels
        self.embed = nn.Embedding(cfg.vocab_size, h)
        self.blocks = nn.ModuleList(
            RefLlamaBlock(h, cfg.num_attention_heads, cfg.query_groups, cfg.ffn_size, cfg.layernorm_epsilon)
            for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(h, eps=cfg.layernorm_epsilon)
        self.head = nn.Linear(h, cfg.vocab_size, bias=False)
        inv_freq = cfg.rotary_base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.arange(cfg.max_position_embeddings, dtype=torch.float64)[:, None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos[:s], self.sin[:s])
        return self.head(self.norm(x))


@torch.no_grad()
def copy_weights(ref: nn.Module, ours: GPTModel, cfg: ModelConfig) -> None:
    """Load our initial weights into the reference (translating the grouped QKV layout)."""
    p = dict(ours.named_parameters())
    a, g, d, h, f = cfg.num_attention_heads, cfg.query_groups, cfg.kv_channels, cfg.hidden_size, cfg.ffn_size
    n = a // g
    for i in range(cfg.num_layers):
        pre = f"decoder.layers.{i}."
        qkv = p[pre + "self_attention.linear_qkv.weight"].view(g, n + 2, d, h)   # per group: q.., k, v
        q, k, v = qkv[:, :n].reshape(a * d, h), qkv[:, n].reshape(g * d, h), qkv[:, n + 1].reshape(g * d, h)
        fc1 = p[pre + "mlp.linear_fc1.weight"]
        if isinstance(ref, RefGPT2):
            blk = ref.blocks[i]
            blk.attn.in_proj_weight.copy_(torch.cat([q, k, v]))
            bias = p[pre + "self_attention.linear_qkv.bias"].view(g, n + 2, d)
            blk.attn.in_proj_bias.copy_(torch.cat([bias[:, :n].reshape(-1), bias[:, n].reshape(-1),
                                                   bias[:, n + 1].reshape(-1)]))
            blk.attn.out_proj.weight.copy_(p[pre + "self_attention.linear_proj.weight"])
            blk.attn.out_proj.bias.copy_(p[pre + "self_attention.linear_proj.bias"])
            for mine, theirs in (("input_layernorm", blk.ln1), ("pre_mlp_layernorm", blk.ln2)):
                theirs.weight.copy_(p[pre + mine + ".weight"])
                theirs.bias.copy_(p[pre + mine + ".bias"])
            blk.fc1.weight.copy_(fc1)
            blk.fc1.bias.copy_(p[pre + "mlp.linear_fc1.bias"])
            blk.fc2.weight.copy_(p[pre + "mlp.linear_fc2.weight"])
            blk.fc2.bias.copy_(p[pre + "mlp.linear_fc2.bias"])
        else:
            blk = ref.blocks[i]
            blk.q.weight.copy_(q)
            blk.k.weight.copy_(k)
            blk.v.weight.copy_(v)
            blk.o.weight.copy_(p[pre + "self_attention.linear_proj.weight"])
            blk.norm1.weight.copy_(p[pre + "input_layernorm.weight"])
            blk.norm2.weight.copy_(p[pre + "pre_mlp_layernorm.weight"])
            blk.gate.weight.copy_(fc1[:f])                     # fc1 = [gate; up]
            blk.up.weight.copy_(fc1[f:])
            blk.down.weight.copy_(p[pre + "mlp.linear_fc2.weight"])
    if isinstance(ref, RefGPT2):
        ref.wte.weight.copy_(p["embedding.word_embeddings.weight"])
        ref.wpe.weight.copy_(p["embedding.position_embeddings.weight"])
        ref.ln_f.weight.copy_(p["decoder.final_layernorm.weight"])
        ref.ln_f.bias.copy_(p["decoder.final_layernorm.bias"])
    else:
        ref.embed.weight.copy_(p["embedding.word_embeddings.weight"])
        ref.norm.weight.copy_(p["decoder.final_layernorm.weight"])
        ref.head.weight.copy_(ours.output_weight())


# ---------------------------------------------------------------------------------------
# one training step of each implementation
# ---------------------------------------------------------------------------------------
@dataclass
class Runner:
    name: str
    model: nn.Module
    step: Callable[[], float]        # one training step; returns the loss

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def our_runner(name: str, cfg: ModelConfig, train_cfg: TrainConfig, batch: dict) -> Runner:
    model = GPTModel(cfg)
    opt = Optimizer([model], train_cfg)

    def step() -> float:            # the training loop's step, on the single device
        loss, _ = train_step([model], opt, [batch], Layout(), train_cfg.lr)
        return loss
    return Runner(name, model, step)


def reference_runner(cfg: ModelConfig, train_cfg: TrainConfig, batch: dict, ours: GPTModel) -> Runner:
    model = RefGPT2(cfg) if cfg.normalization == "LayerNorm" else RefLlama(cfg)
    copy_weights(model, ours, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=train_cfg.lr, weight_decay=train_cfg.weight_decay,
                            betas=(train_cfg.adam_beta1, train_cfg.adam_beta2), eps=train_cfg.adam_eps)
    tokens, labels = batch["tokens"], batch["labels"]

    def step() -> float:
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return Runner("reference", model, step)


@torch.no_grad()
def initial_losses(runners: list[Runner], batch: dict) -> dict[str, float]:
    """Mean token loss of each implementation on the same batch, before any step."""
    out = {}
    for r in runners:
        r.model.eval()
        if isinstance(r.model, GPTModel):
            out[r.name] = r.model(batch["tokens"], labels=batch["labels"]).mean().item()
        else:
            logits = r.model(batch["tokens"])
            out[r.name] = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()
        r.model.train()
    return out


def time_window(r: Runner, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        r.step()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------
def style_config(style: str, args: argparse.Namespace, backend: str) -> ModelConfig:
    common = dict(hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=args.heads,
                  max_position_embeddings=args.seq, attention_backend=backend, params_dtype="float32")
    if style == "llama":
        return ModelConfig.llama(num_query_groups=args.query_groups, **common).validate()
    return ModelConfig.gpt2(**common).validate()


def bench_style(style: str, args: argparse.Namespace) -> list[dict]:
    cfg_naive, cfg_sdpa = style_config(style, args, "naive"), style_config(style, args, "sdpa")
    train_cfg = TrainConfig(seq_length=args.seq, micro_batch_size=args.batch, lr=1e-4, clip_grad=1.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg_naive.vocab_size, (args.batch, args.seq + 1), generator=g)
    batch = {"tokens": x[:, :-1], "labels": x[:, 1:]}

    naive = our_runner("ours/naive", cfg_naive, train_cfg, batch)
    sdpa = our_runner("ours/sdpa", cfg_sdpa, train_cfg, batch)
    ref = reference_runner(cfg_naive, train_cfg, batch, naive.model)
    runners = [naive, sdpa, ref]

    c = cfg_naive
    print(f"\n== {style}: h={c.hidden_size} L={c.num_layers} a={c.num_attention_heads} g={c.query_groups} "
          f"d={c.kv_channels} f={c.ffn_size} V={c.vocab_size} s={args.seq} b={args.batch} float32 "
          f"({c.normalization}, {c.activation}, {c.position_embedding_type}, "
          f"{'untied' if c.untie_embeddings_and_output_weights else 'tied'})")
    losses = initial_losses(runners, batch)
    for r in runners:
        print(f"   {r.name:<11} parameters {r.num_params:>10,}   initial loss {losses[r.name]:.6f}")
    print(f"   same function: max |loss - ours/naive| = "
          f"{max(abs(v - losses['ours/naive']) for v in losses.values()):.1e}   (ln V = {math.log(c.vocab_size):.6f})")

    for r in runners:                                   # warm-up: allocator, lazy init, Adam states
        for _ in range(args.warmup):
            r.step()
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    for _ in range(args.repeats):
        for r in runners:
            times[r.name].append(time_window(r, args.steps))

    tokens_per_window = args.steps * args.batch * args.seq
    rows = []
    ref_best, ref_median = min(times["reference"]), statistics.median(times["reference"])
    print(f"   {'':<11} {'tokens/s: best':>15} {'median':>8} {'worst':>8} {'ms/step best':>13}"
          f" {'vs reference: best':>19} {'median':>7}")
    for r in runners:
        t = times[r.name]
        best, med, worst = min(t), statistics.median(t), max(t)
        row = dict(style=style, impl=r.name, params=r.num_params, tokens_per_s_best=tokens_per_window / best,
                   tokens_per_s_median=tokens_per_window / med, tokens_per_s_worst=tokens_per_window / worst,
                   ms_per_step_best=1000 * best / args.steps, vs_reference_best=ref_best / best,
                   vs_reference_median=ref_median / med)
        rows.append(row)
        print(f"   {r.name:<11} {row['tokens_per_s_best']:>15,.0f} {row['tokens_per_s_median']:>8,.0f}"
              f" {row['tokens_per_s_worst']:>8,.0f} {row['ms_per_step_best']:>13.1f}"
              f" {row['vs_reference_best']:>18.2f}x {row['vs_reference_median']:>6.2f}x")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--styles", nargs="+", choices=["llama", "gpt2"], default=["llama", "gpt2"])
    p.add_argument("--hidden", type=int, default=256, help="h (default 256)")
    p.add_argument("--layers", type=int, default=4, help="L (default 4)")
    p.add_argument("--heads", type=int, default=8, help="a (default 8)")
    p.add_argument("--query-groups", type=int, default=2, help="g for the LLaMA style (default 2)")
    p.add_argument("--seq", type=int, default=128, help="s (default 128)")
    p.add_argument("--batch", type=int, default=8, help="b (default 8)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per implementation (default 3)")
    p.add_argument("--steps", type=int, default=5, help="steps per timed window (default 5)")
    p.add_argument("--repeats", type=int, default=7, help="timed windows per implementation (default 7)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and one short window: checks that it runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.heads, args.query_groups = 32, 2, 4, 2
        args.seq, args.batch, args.warmup, args.steps, args.repeats = 16, 2, 1, 1, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    print(f"command: {cmd}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"threads {torch.get_num_threads()} (interop {torch.get_num_interop_threads()}), "
          f"CPU: {cpu_model()}")
    print(f"timing: {args.warmup} warm-up steps, then {args.repeats} interleaved windows of {args.steps} steps; "
          f"{args.batch * args.seq} tokens per step; best / median / worst window reported")
    for style in args.styles:
        bench_style(style, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
